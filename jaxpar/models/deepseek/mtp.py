"""DeepSeek-V3's multi-token prediction (arXiv 2412.19437, section 2.2): model.mtp_layers = D modules
after the main model, module k predicting the token k + 1 places ahead of each position.

Module k takes the hidden state h^{k-1}_i (the main model's last layer output for k = 1, before its
final norm) and the embedding of token i + k, each through its own RMSNorm, concatenated (the
embedding first, as DeepSeek's checkpoints' eh_proj reads them), projected back to the model's
width, through one transformer block of the main model's kind (MLA and experts), then its own
RMSNorm and the shared lm_head. Its cross-entropy is over the positions that have a token k + 1
ahead in the row: T - k of them. The modules' mean loss, times model.mtp_weight, joins the training
loss and is logged as `mtp_loss`; their routers' losses join the main model's. Evaluation and
sampling never run them.

Under a context ring the rows arrive in its zigzag layout, and a token's k-ahead neighbour may be
on another device: the modules put the main model's output and the rows back in order and run on
the whole sequence, the ring's devices each computing all of it (the modules are one block each).
In a pipeline they run on the last stage, beside the head (jaxpar.parallel.pipeline).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.models.llama.model import rms_norm
from jaxpar.nn import context, recipes
from jaxpar.nn.loss import cross_entropy
from jaxpar.nn.params import dense, norm, per_layer, tree_of

STACK = "mtp_layers"  # the modules' stacked axis (replicated: every device holds every module)


def declare_mtp(family) -> dict:
    """The modules' params: per module its two input norms, the projection (2C -> C), one block
    of the main model's sparse kind (its layers' stack renamed), and its output norm."""
    cfg = family.cfg
    D, C = cfg.mtp_layers, cfg.n_embd
    one_block = type(family)(dataclasses.replace(cfg, n_layer=D, dense_layers="", mtp_layers=0)).declare_blocks()
    block = tree_of(one_block, lambda p: dataclasses.replace(p, axes=(STACK, *p.axes[1:])))
    return {"enorm": norm((D, C), (STACK, "embed")), "hnorm": norm((D, C), (STACK, "embed")),
            "eh_proj": dense(0.02, (D, 2 * C, C), (STACK, "embed", "embed"), 1, False),
            "block": block, "norm": norm((D, C), (STACK, "embed"))}


def module(stacked: dict, k: int) -> dict:
    """Module k's (from 1) params out of the stacked ones."""
    return jax.tree.map(lambda a: a[k - 1], stacked)


def mtp_losses(model, top: dict, x: jax.Array, targets: jax.Array, doc_starts=None) -> dict:
    """{"mtp_loss": the modules' mean cross-entropy, and their routers' losses} for rows whose
    next tokens are `targets`, x the main model's last layer output on them; `top` holds the
    embedding, the head and the modules."""
    ring_axis, ring = model.plan.ring()
    laid_out = context.of(model.plan).permutation(targets.shape[1], ring) if ring > 1 else None
    if ring > 1:  # each device the whole sequence
        model = model.on(model.plan.unsplit(ring_axis))
    if laid_out is not None:  # in order
        order = np.argsort(laid_out)
        x, targets = x[:, order], targets[:, order]
        doc_starts = None if doc_starts is None else doc_starts[:, order]
    family, plan, cfg = model.family, model.plan, model.cfg
    axes = per_layer(model.axes()["mtp"]["block"])
    T, D = targets.shape[1], cfg.mtp_layers
    h, losses, router = x, [], {}
    for k in range(1, D + 1):  # position i reads token i + k (targets[i + k - 1]) and predicts i + k + 1
        n, p = T - k, module(top["mtp"], k)  # the positions with a token k + 1 ahead
        embedded = family.embed(plan, top, targets[:, k - 1:k - 1 + n])
        joined = jnp.concatenate([rms_norm(embedded, p["enorm"], cfg.norm_eps),
                                  rms_norm(h[:, :n], p["hnorm"], cfg.norm_eps)], axis=-1)
        h = recipes.of(plan, family.dtype).project("btc,cd->btd", joined.astype(family.dtype),
                                                   p["eh_proj"]["kernel"].astype(family.dtype))
        docs = None if doc_starts is None else doc_starts[:, :n]
        h, more, _ = family.block(plan, h, p["block"], axes, None, None, docs)
        head = {**model.head(top), "norm": p["norm"]}
        losses.append(cross_entropy(model.logits_of(head, h), targets[:, k:k + n]))
        router = {name: router.get(name, 0.0) + value for name, value in more.items()}
    return router | {"mtp_loss": sum(losses) / D}

