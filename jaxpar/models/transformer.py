"""The one model built on a family: its params declared (jaxpar.nn.params), initialised, and
applied through a scan over the stacked layers, as its execution plan (jaxpar.core.execution) lays
them out. The family's contract is jaxpar.models.family; the registry, jaxpar.models.registry.
"""

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxpar.core import remat
from jaxpar.core.config import Config, ModelConfig
from jaxpar.core.execution import ExecutionPlan
from jaxpar.models import lead
from jaxpar.models.family import Family
from jaxpar.models.registry import family_of
from jaxpar.nn import params as declared_params
from jaxpar.nn.layers import GATHERED, KVCache, document_positions, document_starts, weights_for_compute
from jaxpar.nn.loss import sequence_loss


def split_layers(params: dict, axes: dict) -> tuple[dict, dict, dict, dict]:
    """(top params, top axes, stacked layer params, per-layer axes without the 'layers' axis);
    the dense first layers (jaxpar.models.lead) are in neither: Transformer.run_lead runs them."""
    top, top_axes = dict(params), dict(axes)
    top.pop(lead.LEAD, None)
    top_axes.pop(lead.LEAD, None)
    layer_params, stacked_axes = top.pop("blocks"), top_axes.pop("blocks")
    return top, top_axes, layer_params, declared_params.per_layer(stacked_axes)


def add_losses(total: dict, more: dict) -> dict:
    """Auxiliary losses summed by name (a dense layer has none of a sparse one's)."""
    return total | {name: total.get(name, 0.0) + value for name, value in more.items()}


@dataclass(frozen=True, eq=False)  # hashed by identity: jax.jit(model) caches on it
class Transformer:
    """A family's model for one vocabulary: its params declared, initialised, and applied.

    `eot_id`: with data.document_mask, the end-of-text token that opens each document of a row
    (attention stays within a document, positions restart at its start); None: a row is one
    sequence. `plan`: how it is laid out and computed (the default: one device, no mesh, the
    CPU's choices); `on` gives the same model under another plan."""
    cfg: ModelConfig
    vocab_size: int
    eot_id: int | None = None
    plan: ExecutionPlan = field(default_factory=ExecutionPlan)

    def on(self, plan: ExecutionPlan) -> "Transformer":
        return dataclasses.replace(self, plan=plan)

    @cached_property
    def family(self) -> Family:
        return family_of(self.cfg)

    @cached_property
    def declared_by_family(self) -> dict:
        return self.family.declare(self.vocab_size)

    @cached_property
    def declared(self) -> dict:
        """The family's params, the dense first layers stacked apart (jaxpar.models.lead)."""
        return lead.split_declared(self.declared_by_family, self.cfg.lead_layers)

    def init(self, seed: int) -> dict:
        drawn = declared_params.initial_params(self.declared_by_family, seed)
        return lead.split_params(drawn, self.declared_by_family, self.cfg.lead_layers)

    def shapes(self) -> dict:
        return declared_params.shapes_of(self.declared)

    def axes(self) -> dict:
        return declared_params.axes_of(self.declared)

    def matrices(self) -> dict:
        return declared_params.matrices_of(self.declared)

    def roles(self) -> dict:
        return declared_params.roles_of(self.declared)

    def __call__(self, params: dict, tokens: jax.Array, dropout_key=None) -> jax.Array:
        """tokens (batch, seq) int -> logits (batch, seq, padded vocab) float32."""
        return self.apply(params, tokens, dropout_key)[0]

    def apply(self, params: dict, tokens: jax.Array, dropout_key=None) -> tuple[jax.Array, dict]:
        """(logits, auxiliary losses summed over the layers) of (batch, seq) tokens."""
        top, x, losses = self.stream(params, tokens, dropout_key)
        return self.family.logits(self.plan, top, x, self.vocab_size), losses

    def loss(self, params: dict, tokens: jax.Array, targets: jax.Array, dropout_key=None) -> tuple[jax.Array, dict]:
        """(mean next-token cross-entropy, auxiliary losses), the logits over model.loss_chunks
        pieces of the sequence (jaxpar.nn.loss.sequence_loss)."""
        top, x, losses = self.stream(params, tokens, dropout_key)
        ahead = self.family.ahead_losses(self, top, x, targets, self.doc_starts(tokens))
        return self.sequence_loss(self.head(top), x, targets), add_losses(losses, ahead) if ahead else losses

    def sequence_loss(self, head: dict, x: jax.Array, targets: jax.Array) -> jax.Array:
        """Mean next-token cross-entropy of the last layer's output x, over model.loss_chunks
        pieces, each piece's log-sum-exp as the plan says (jaxpar.nn.loss.sequence_loss)."""
        return sequence_loss(self.logits_of, head, x, targets, self.cfg.loss_chunks, self.plan.one_pass_log_sum_exp)

    def head(self, top: dict) -> dict:
        """The top-level weights the loss reads after the last block (the family's head_names)."""
        return {name: top[name] for name in self.family.head_names}

    def logits_of(self, head: dict, x: jax.Array) -> jax.Array:
        """The float32 logits of the final stream x on the `head` weights."""
        return self.family.logits(self.plan, head, x, self.vocab_size)

    def stream(self, params: dict, tokens: jax.Array, dropout_key=None) -> tuple[dict, jax.Array, dict]:
        """(the top-level weights for compute, the last layer's output stream, auxiliary losses)."""
        top, top_axes, _, _ = split_layers(params, self.axes())
        top = weights_for_compute(self.plan, top, top_axes)
        keys = layer_keys = None
        if dropout_key is not None:
            keys = jax.random.split(dropout_key, self.cfg.n_layer + 1)
            layer_keys = keys[1:]
        doc_starts = self.doc_starts(tokens)
        x = self.family.embed(self.plan, top, tokens, None if keys is None else keys[0],
                              document_positions(self.plan, doc_starts, tokens.shape[1]))
        x, losses, _ = self.run_all(params, x, layer_keys, doc_starts=doc_starts)
        return top, x, losses

    def run_all(self, params: dict, x: jax.Array, layer_keys=None, cache=None, doc_starts=None):
        """x through every layer, the dense first ones (run_lead), then the stacked rest:
        (x, auxiliary losses, the new cache); layer_keys and cache: every layer's."""
        _, _, layer_params, layer_axes = split_layers(params, self.axes())
        k = self.cfg.lead_layers
        if not k:
            return self.run_layers(layer_params, layer_axes, x, layer_keys, cache, doc_starts)
        part = lambda tree, lo, hi=None: jax.tree.map(lambda a: a[lo:hi], tree)
        lead_cache, cache = (None, None) if cache is None else (
            cache._replace(k=cache.k[:k], v=cache.v[:k]), cache._replace(k=cache.k[k:], v=cache.v[k:]))
        x, lead_losses, lead_cache = self.run_lead(params, x, part(layer_keys, 0, k), lead_cache, doc_starts)
        x, losses, cache = self.run_layers(layer_params, layer_axes, x, part(layer_keys, k), cache, doc_starts)
        if lead_cache is not None:
            cache = cache._replace(k=jnp.concatenate([lead_cache.k, cache.k]),
                                   v=jnp.concatenate([lead_cache.v, cache.v]))
        return x, add_losses(losses, lead_losses), cache

    def run_lead(self, params: dict, x: jax.Array, layer_keys=None, cache=None, doc_starts=None):
        """x through the dense first layers (params[lead.LEAD]) one by one: (x, their auxiliary
        losses, their cache); nothing where the model has none."""
        if lead.LEAD not in params:
            return x, {}, cache
        step = self.layer_step(declared_params.per_layer(self.axes()[lead.LEAD]), cache, doc_starts)
        kv = None if cache is None else (cache.k, cache.v)
        x, (losses, kv) = jax.lax.scan(step, x, (params[lead.LEAD], layer_keys, kv), unroll=True)
        return x, {name: jnp.sum(values) for name, values in losses.items()}, None if cache is None else KVCache(
            *kv, cache.pos)

    def doc_starts(self, tokens: jax.Array) -> jax.Array | None:
        """Each token's document start (jaxpar.nn.layers), or None without documents."""
        return None if self.eot_id is None else document_starts(self.plan, tokens, self.eot_id)

    def run_layers(self, layer_params: dict, layer_axes: dict, x: jax.Array, layer_keys=None, cache=None,
                   doc_starts=None):
        """x through the stacked layers in `layer_params` (all of them, or one pipeline stage's):
        (x, auxiliary losses summed over them, the new cache). `cache`: the layers' KV caches
        while decoding (a KVCache of stacked arrays, one pos). doc_starts: the rows' documents."""
        cfg = self.cfg
        # Recomputation needs a rolled scan: unrolled, XLA:CPU schedules the reruns early and keeps
        # every layer's activations all the same (the tiny model at block 128: 34 MB of temporaries
        # with remat or without; rolled, 10 MB with remat).
        unroll = (cfg.unroll_layers and not self.plan.regather_weights
                  and not remat.POLICIES[cfg.remat].checkpointed and cache is None)
        kv = None if cache is None else (cache.k, cache.v)
        stacks = self.stacks()
        if set(stacks.values()) == {"layers"}:
            step = self.layer_step(layer_axes, cache, doc_starts)
            x, (losses, kv) = jax.lax.scan(step, x, (layer_params, layer_keys, kv), unroll=unroll)
        else:
            x, (losses, kv) = self.scan_mixed(layer_params, layer_axes, stacks, x, layer_keys, kv, cache, unroll,
                                              doc_starts)
        summed = {name: jnp.sum(values) for name, values in losses.items()}
        return x, summed, None if cache is None else KVCache(*kv, cache.pos)

    def layer_step(self, layer_axes: dict, cache=None, doc_starts=None):
        """(x, (one layer's params, dropout key, KV cache)) -> (x, (losses, KV cache)), remat as asked."""
        family, cfg, plan = self.family, self.cfg, self.plan

        def step(x, layer):
            p, key, kv = layer
            x = checkpoint_name(x, remat.LAYER_INPUT)  # the name full_offloaded keeps in host memory
            x, losses, kv = family.block(plan, x, p, layer_axes, key, None if kv is None else KVCache(*kv, cache.pos),
                                         doc_starts)
            return x, (losses, None if kv is None else (kv.k, kv.v))

        policy = remat.POLICIES[cfg.remat]
        if policy.checkpointed and cache is None:  # keep what the policy names; the backward reruns the rest
            return jax.checkpoint(step, prevent_cse=False, policy=policy.jax_policy())
        if plan.regather_weights:
            # A rolled scan gathers one layer at a time, in the forward and again in the backward.
            return jax.checkpoint(step, policy=jax.checkpoint_policies.save_anything_except_these_names(GATHERED))
        return step

    def stacks(self) -> dict[str, str]:
        """Each block param's stacked axis: 'layers', or where the kinds of layer mix, the stack of
        its kind's layers (ModelConfig.layers_in)."""
        return {name: jax.tree.leaves(axes, is_leaf=lambda n: isinstance(n, tuple))[0][0]
                for name, axes in self.axes()["blocks"].items()}

    def scan_mixed(self, layer_params, layer_axes, stacks, x, layer_keys, kv, cache, unroll, doc_starts=None):
        """The layers of mixed kinds: those before the kinds start to repeat one by one, then a
        scan over groups of `period` layers, the shortest repeat of the rest; each layer takes its
        shared params and the next of its own kind's. Scanned, a layer's weights are gathered
        (ZeRO-3) and its activations kept one layer at a time. (Dense first layers followed by
        sparse ones only are stacked apart instead: jaxpar.models.lead.)"""
        n = jax.tree.leaves({k: v for k, v in layer_params.items() if stacks[k] == "layers"})[0].shape[0]
        # A pipeline chunk's first n layers stand for all of its layers: every chunk has its kinds
        # in the same places (jaxpar.core.axes.check_chunks).
        kinds = set(stacks.values()) - {"layers"}
        kind = [next(s for s in kinds if i in self.cfg.layers_in(s)) for i in range(n)]
        first, period = repeat_of(kind)
        steps = {s: self.layer_step({k: v for k, v in layer_axes.items() if stacks[k] in ("layers", s)}, cache,
                                    doc_starts) for s in kinds}
        ahead = {s: kind[:first].count(s) for s in kinds} | {"layers": first}  # each stack's leading layers
        part = lambda tree, lo, hi=None: jax.tree.map(lambda a: a[lo:hi], tree)
        leading = {name: part(tree, 0, ahead[stacks[name]]) for name, tree in layer_params.items()}
        rest = {name: part(tree, ahead[stacks[name]]) for name, tree in layer_params.items()}
        per_group = {s: kind[first:first + period].count(s) for s in kinds} | {"layers": period}

        def grouped(a, stack):  # (layers of the stack, ...) -> (groups, its layers in a group, ...)
            return a.reshape(((n - first) // period, per_group[stack]) + a.shape[1:])

        def run_group(x, p, group_keys, group_kv, group_kinds):
            losses, kv_out, taken = {}, [], dict.fromkeys(kinds, 0)
            for j, s in enumerate(group_kinds):
                at = {"layers": j, s: taken[s]}  # this layer's index in each stack it takes from
                layer = {name: jax.tree.map(lambda a, i=at[stacks[name]]: a[i], tree)
                         for name, tree in p.items() if stacks[name] in at}
                taken[s] += 1
                key, layer_kv = jax.tree.map(lambda a, j=j: a[j], (group_keys, group_kv))
                x, (more, layer_kv) = steps[s](x, (layer, key, layer_kv))
                losses, kv_out = add_losses(losses, more), kv_out + [layer_kv]
            return x, (losses, None if group_kv is None else jax.tree.map(lambda *a: jnp.stack(a), *kv_out))

        lead_losses, lead_kv = {}, None
        if first:
            x, (lead_losses, lead_kv) = run_group(x, leading, *part((layer_keys, kv), 0, first), kind[:first])
        params = {name: jax.tree.map(lambda a, s=stacks[name]: grouped(a, s), tree) for name, tree in rest.items()}
        keys, rest_kv = jax.tree.map(lambda a: grouped(a, "layers"), part((layer_keys, kv), first))
        x, (losses, rest_kv) = jax.lax.scan(
            lambda x, group: run_group(x, *group, kind[first:first + period]), x, (params, keys, rest_kv), unroll=unroll)
        losses = add_losses({name: jnp.sum(values) for name, values in losses.items()}, lead_losses)
        kv = jax.tree.map(lambda a: a.reshape((n - first,) + a.shape[2:]), rest_kv)
        if lead_kv is not None:
            kv = jax.tree.map(lambda *a: jnp.concatenate(a), lead_kv, kv)
        return x, (losses, kv)


def repeat_of(kind: list) -> tuple[int, int]:
    """(first, period) of a list of layer kinds: after the first `first` layers, the kinds repeat
    every `period` layers, the pair with the fewest layers written out (first + period), e.g.
    dense, dense, sparse, dense, sparse: (1, 2); Llama's moe_every=2: (0, 2)."""
    n = len(kind)
    repeats = lambda first, p: (n - first) % p == 0 and kind[first:] == kind[first:first + p] * ((n - first) // p)
    return min(((first, next(p for p in range(1, n - first + 1) if repeats(first, p))) for first in range(n)),
               key=lambda pair: pair[0] + pair[1])


def build_model(cfg: Config, vocab_size: int, eot_id: int | None = None,
                plan: ExecutionPlan | None = None) -> Transformer:
    """The model of cfg, under `plan` (jaxpar.training.step.execution.plan_execution; None: one device,
    no mesh); `eot_id`: the tokenizer's end-of-text token, which opens documents when
    data.document_mask is on."""
    return Transformer(cfg.model, vocab_size, eot_id=eot_id if cfg.data.document_mask else None,
                       plan=plan or ExecutionPlan())


def abstract_model(cfg: Config, vocab_size: int, eot_id: int | None = None) -> tuple[Transformer, dict, dict]:
    """(the model, a pure dict of ShapeDtypeStructs, a pure dict of logical axes), with no allocation."""
    model = build_model(cfg, vocab_size, eot_id)
    return model, model.shapes(), model.axes()
