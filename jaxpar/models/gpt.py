"""GPT-2 as in nanoGPT, in Flax NNX, with its blocks stacked on a leading 'layers' axis and run by scan.

The code names logical axes only ('vocab', 'embed', 'heads', ...); jaxpar.core.sharding maps them to
the mesh. The `kernel`s, `wte` and `wpe` get weight decay; `scale` and `bias` do not.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxpar.core.config import Config, ModelConfig
from jaxpar.core.sharding import constrain, param_axes
from jaxpar.models.attention import apply_dropout, causal_attention
from jaxpar.models.matmul import project

VOCAB_MULTIPLE = 64  # pad the vocabulary so it splits over any tensor-parallel size up to 64
LN_EPS = 1e-5
GATHERED = "gathered_weights"  # checkpoint name of weights pinned to their compute layout
STREAM = ("batch", "stream_seq", "embed")  # the residual stream's logical axes between blocks


def padded_vocab(vocab_size: int) -> int:
    return -(-vocab_size // VOCAB_MULTIPLE) * VOCAB_MULTIPLE


def normal_param(rngs: nnx.Rngs, std: float, shape: tuple, axes: tuple) -> nnx.Param:
    return nnx.Param(std * jax.random.normal(rngs.params(), shape, jnp.float32), axes=axes)


class LayerNorm(nnx.Module):
    def __init__(self, shape: tuple, axes: tuple, bias: bool):
        self.scale = nnx.Param(jnp.ones(shape, jnp.float32), axes=axes)
        if bias:
            self.bias = nnx.Param(jnp.zeros(shape, jnp.float32), axes=axes)


class StackedDense(nnx.Module):
    """A linear layer per block: kernel (layers, *in, *out), bias (layers, *out).

    With `out_first` (one in and one out axis) the kernel is stored as (layers, out, in), as
    torch's nn.Linear stores it; it is drawn as (in, out) all the same, so a seed gives the same
    weights in either layout.
    """

    def __init__(self, rngs: nnx.Rngs, std: float, shape: tuple, axes: tuple, n_out_dims: int,
                 bias: bool, out_first: bool = False):
        kernel = normal_param(rngs, std, shape, axes)
        if out_first:
            kernel = nnx.Param(jnp.swapaxes(kernel[...], 1, 2), axes=(axes[0], axes[2], axes[1]))
        self.kernel = kernel
        if bias:
            self.bias = nnx.Param(jnp.zeros(shape[:1] + shape[-n_out_dims:], jnp.float32),
                                  axes=axes[:1] + axes[-n_out_dims:])


class Blocks(nnx.Module):
    """All n_layer pre-LayerNorm transformer blocks; every weight leads with the 'layers' axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        L, C, H = cfg.n_layer, cfg.n_embd, cfg.n_head
        D, F = C // H, 4 * C
        std, resid_std = 0.02, 0.02 / math.sqrt(2 * L)  # GPT-2's scaled residual projections
        b = cfg.bias
        self.ln_1 = LayerNorm((L, C), ("layers", "embed"), b)
        self.qkv = StackedDense(rngs, std, (L, C, 3, H, D),
                                ("layers", "embed", "qkv", "heads", "head_dim"), 3, b)
        self.attn_out = StackedDense(rngs, resid_std, (L, H, D, C),
                                     ("layers", "heads", "head_dim", "embed"), 1, b)
        self.ln_2 = LayerNorm((L, C), ("layers", "embed"), b)
        self.mlp_in = StackedDense(rngs, std, (L, C, F), ("layers", "embed", "mlp"), 1, b)
        # Stored (layers, embed, mlp): its weight gradient dy^T·h then has the wide 'mlp' axis
        # last, which XLA:CPU computes about 1.4x faster than h^T·dy (the whole step: about 4%).
        self.mlp_out = StackedDense(rngs, resid_std, (L, F, C), ("layers", "mlp", "embed"), 1, b,
                                    out_first=True)


def layer_norm(x: jax.Array, p: dict) -> jax.Array:
    x = x.astype(jnp.float32)
    mean = x.mean(-1, keepdims=True)
    var = jnp.square(x - mean).mean(-1, keepdims=True)
    return add_bias((x - mean) * jax.lax.rsqrt(var + LN_EPS) * p["scale"], p)


def add_bias(y: jax.Array, p: dict) -> jax.Array:
    """y + p['bias'], for layers built with bias=True (nanoGPT's `bias` flag)."""
    return y + p["bias"] if "bias" in p else y


def mlp_output(h: jax.Array, p: dict) -> jax.Array:
    """The MLP's output projection of h (tokens, mlp); its kernel is stored (embed, mlp)."""
    return add_bias(jnp.einsum("nf,cf->nc", h, p["kernel"]), p)


def dropout(x: jax.Array, rate: float, key) -> jax.Array:
    if key is None or rate == 0.0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return apply_dropout(x, keep, rate).astype(x.dtype)


def gelu(x: jax.Array, kind: str = "exact") -> jax.Array:
    """GELU of model.gelu's `kind`: "exact" (erf) as nanoGPT's nn.GELU(), where erf compiles to
    faster CPU code than erfc; "tanh", GPT-2's own approximation (Hugging Face's gelu_new)."""
    if kind == "tanh":
        return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
    return 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))


def exact_qkv_bias(bias: jax.Array) -> jax.Array:
    """The q/k/v bias, with the key bias given its exact gradient: zero.

    A key bias adds q.b_k to every score of a query's row, which softmax ignores. Autodiff returns
    rounding noise instead of 0, and Adam would scale that noise into lr-sized updates that differ
    from one mesh layout to another. The forward pass is unchanged.
    """
    is_key = (jnp.arange(3) == 1)[:, None, None]
    return jnp.where(is_key, jax.lax.stop_gradient(bias), bias)


def weights_for_compute(p: dict, axes: dict) -> dict:
    """Pin weights to their rule-table layout where they are used.

    Under ZeRO-3 they are stored split over 'data' as well, so this is where each layer gathers
    its own weights; otherwise it changes nothing. The name lets a remat policy drop them.
    """
    return jax.tree.map(lambda a, names: checkpoint_name(constrain(a, names), GATHERED), p, axes)


@jax.custom_vjp
def gather_stream(h: jax.Array) -> jax.Array:
    """(batch, seq, embed) from the stream's layout to the matmuls' (batch*seq, embed): an
    all-gather under sequence parallelism. Its gradient, a partial sum over 'tensor', goes
    straight to the stream's layout, where XLA:TPU sums it as a reduce-scatter."""
    B, T, C = h.shape
    return constrain(h.reshape(B * T, C), ("tokens", "embed"))


gather_stream.defvjp(lambda h: (gather_stream(h), h.shape),
                     lambda shape, g: (constrain(g.reshape(shape), STREAM),))


def block(x: jax.Array, p: dict, axes: dict, rate: float, dtype, key,
          gelu_kind: str = "exact") -> jax.Array:
    """One block on one layer's params. The residual stream stays float32; matmuls run in dtype.

    The stream, with LayerNorm, dropout and the residual adds, is (batch, seq, embed) in the
    STREAM layout (split along the sequence under sequence parallelism). Matmuls see the
    activations whole, as (batch*seq, features): plain 2-D dots are the fastest on CPU.
    """
    B, T, C = x.shape
    keys = jax.random.split(key, 3) if key is not None else (None,) * 3
    p = jax.tree.map(lambda a: a.astype(dtype), weights_for_compute(p, axes))

    def matmul_input(x, ln):  # an all-gather of the sequence under sequence parallelism
        return gather_stream(layer_norm(x, ln).astype(dtype))

    def add_to_stream(x, y, p_out, key):  # a row-parallel output: summed into the stream's layout
        return x + dropout(add_bias(constrain(y.reshape(B, T, C), STREAM), p_out), rate, key)

    qkv = project("nc,cshd->nshd", matmul_input(x, p["ln_1"]), p["qkv"]["kernel"], dtype)
    if "bias" in p["qkv"]:
        qkv = qkv + exact_qkv_bias(p["qkv"]["bias"])
    qkv = constrain(qkv.astype(dtype).reshape(B, T, *qkv.shape[1:]), ("batch", "seq", "qkv", "heads", "head_dim"))
    # Split, not indexed: the backward joins the three gradients (a concatenate) instead of adding
    # three zero-padded copies of the whole qkv.
    q, k, v = (constrain(part[:, :, 0].transpose(0, 2, 1, 3), ("batch", "heads", "seq", "head_dim"))
               for part in jnp.split(qkv, 3, axis=2))
    y = causal_attention(q, k, v, rate, keys[0]).reshape(B * T, *q.shape[1:2], q.shape[3])
    y = constrain(y, ("tokens", "heads", "head_dim"))
    x = add_to_stream(x, project("nhd,hdc->nc", y, p["attn_out"]["kernel"], dtype), p["attn_out"], keys[1])
    h = project("nc,cf->nf", matmul_input(x, p["ln_2"]), p["mlp_in"]["kernel"], dtype)
    h = constrain(gelu(add_bias(h, p["mlp_in"]).astype(dtype), gelu_kind), ("tokens", "mlp"))
    x = add_to_stream(x, project("nf,cf->nc", h, p["mlp_out"]["kernel"], dtype), p["mlp_out"], keys[2])
    return constrain(x, STREAM)


def split_layers(params: dict, axes: dict) -> tuple[dict, dict, dict, dict]:
    """(top params, top axes, stacked layer params, per-layer axes without the 'layers' axis)."""
    top, top_axes = dict(params), dict(axes)
    layer_params, stacked_axes = top.pop("blocks"), top_axes.pop("blocks")
    layer_axes = jax.tree.map(lambda names: names[1:], stacked_axes,
                              is_leaf=lambda n: isinstance(n, tuple))
    return top, top_axes, layer_params, layer_axes


def embed(top: dict, tokens: jax.Array, rate: float, key) -> jax.Array:
    """Token + position embeddings of (batch, seq) tokens, with dropout."""
    x = top["wte"][tokens] + top["wpe"][: tokens.shape[1]]
    return dropout(constrain(x, STREAM), rate, key)


def apply_blocks(layer_params: dict, layer_axes: dict, x: jax.Array, cfg: ModelConfig,
                 layer_keys=None, regather_weights: bool = False) -> jax.Array:
    """Run x through the stacked layers in `layer_params` (all of them, or one pipeline stage's)."""
    dtype = jnp.dtype(cfg.dtype)

    def step(x, layer):
        p, key = layer
        return block(x, p, layer_axes, cfg.dropout, dtype, key, cfg.gelu), None

    # Recomputation needs a rolled scan: unrolled, XLA:CPU schedules the reruns early and keeps
    # every layer's activations all the same (the tiny model at block 128: 34 MB of temporaries
    # with remat or without; rolled, 10 MB with remat).
    unroll = cfg.unroll_layers and not regather_weights and cfg.remat == "none"
    if cfg.remat == "full":  # save each layer's input alone; the backward reruns the layer
        step = jax.checkpoint(step, prevent_cse=False)
    elif regather_weights:
        # A rolled scan gathers one layer at a time, in the forward and again in the backward.
        step = jax.checkpoint(step, policy=jax.checkpoint_policies.save_anything_except_these_names(
            GATHERED))
    x, _ = jax.lax.scan(step, x, (layer_params, layer_keys), unroll=unroll)
    return x


def logits_of(top: dict, x: jax.Array, vocab_size: int, dtype) -> jax.Array:
    """Final LayerNorm and the tied lm_head: (batch, seq, embed) -> float32 logits over the padded vocab."""
    x = constrain(layer_norm(x, top["ln_f"]), ("batch", "seq", "embed"))  # the whole sequence
    logits = project("btc,vc->btv", x.astype(dtype), top["wte"].astype(dtype), dtype)
    logits = constrain(logits, ("batch", "seq", "vocab"))
    # Padding rows of the vocabulary can never be predicted.
    is_real = jnp.arange(logits.shape[-1]) < vocab_size
    return jnp.where(is_real, logits, -1e9)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy; logits are float32."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot sum, not a gather: exact all the same, it splits over a vocab-parallel axis, and
    # XLA's partitioner crashes on this gather inside a pipeline stage with data and tensor axes.
    picked = jnp.sum(jnp.where(jax.nn.one_hot(targets, logits.shape[-1], dtype=bool), logits, 0.0), -1)
    return jnp.mean(log_z - picked)


class GPT(nnx.Module):
    """Token + position embeddings, stacked blocks, final LayerNorm, lm_head tied to wte."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, rngs: nnx.Rngs,
                 regather_weights: bool = False):
        self.cfg = cfg
        self.vocab_size = vocab_size
        # Recompute each layer's gathered weights in the backward pass instead of saving them.
        self.regather_weights = regather_weights
        self.wte = normal_param(rngs, 0.02, (padded_vocab(vocab_size), cfg.n_embd), ("vocab", "embed"))
        self.wpe = normal_param(rngs, 0.02, (cfg.block_size, cfg.n_embd), ("pos", "embed"))
        self.blocks = Blocks(cfg, rngs)
        self.ln_f = LayerNorm((cfg.n_embd,), ("embed",), cfg.bias)

    def __call__(self, tokens: jax.Array, dropout_key=None) -> jax.Array:
        """tokens (batch, seq) int -> logits (batch, seq, padded vocab) float32."""
        state = nnx.state(self)
        top, top_axes, layer_params, layer_axes = split_layers(nnx.to_pure_dict(state),
                                                               param_axes(state))
        top = weights_for_compute(top, top_axes)
        keys = layer_keys = None
        if dropout_key is not None:
            keys = jax.random.split(dropout_key, self.cfg.n_layer + 1)
            layer_keys = keys[1:]
        x = embed(top, tokens, self.cfg.dropout, None if keys is None else keys[0])
        x = apply_blocks(layer_params, layer_axes, x, self.cfg, layer_keys, self.regather_weights)
        return logits_of(top, x, self.vocab_size, jnp.dtype(self.cfg.dtype))


def build_model(cfg: Config, vocab_size: int) -> GPT:
    # ZeRO-3 gathers each layer's weights when it runs; recomputing the gather in the backward
    # pass (rather than saving the gathered weights) is what keeps them from piling up.
    return GPT(cfg.model, vocab_size, nnx.Rngs(cfg.train.seed), regather_weights=cfg.train.zero == 3)


def abstract_model(cfg: Config, vocab_size: int):
    """(graphdef, pure dict of ShapeDtypeStructs, pure dict of logical axes), with no allocation."""
    graphdef, state = nnx.split(nnx.eval_shape(lambda: build_model(cfg, vocab_size)))
    return graphdef, nnx.to_pure_dict(state), param_axes(state)
