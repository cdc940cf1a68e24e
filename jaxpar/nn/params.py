"""Parameters declared once: each one's shape, logical axes, role and initialiser, in a nested dict
that a model family returns from `declare`. The params, their shapes, their logical axes (for the
rule table) and their roles (for the optimizer's groups, the checkpoint and the Hugging Face maps)
are all read from it.

Roles: `matrix` (a projection inside the blocks), `embedding` (a table indexed by token or
position, or an lm_head over the vocabulary), `norm` (a norm's scale), `bias`, `balance` (a
router's per-expert selection bias, moved after each step by the balancing update and never by the
optimizer: jaxpar.nn.routing.rebalanced).
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp

MATRIX, EMBEDDING, NORM, BIAS, BALANCE = "matrix", "embedding", "norm", "bias", "balance"
FUSED = ("qkv", "gate_up")  # the axis of a fused kernel's parts (q, k, v or gate, up)
ROLES = (MATRIX, EMBEDDING, NORM, BIAS, BALANCE)
LEAD = "lead_blocks"  # the params of the dense first layers, stacked apart (jaxpar.models.lead)


@dataclass(frozen=True)
class Param:
    """One parameter. Matrices and embeddings are drawn from N(0, std); a `transposed` stacked
    matrix is drawn as (layers, in, out) and stored as (layers, out, in), so a seed gives the same
    weights in either layout. Norm scales start at 1, biases and balance biases at 0."""
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    role: str
    std: float = 0.0
    transposed: bool = False
    # A matrix's view as matrices, for Muon: (the dims its input contracts, its output dims); the
    # rest are batch dims (layers, experts, and the parts of a fused q/k/v or gate/up kernel,
    # each its own matrix).
    matrix: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    @property
    def random(self) -> bool:
        return self.role in (MATRIX, EMBEDDING)

    def initial(self, key) -> jax.Array:
        if self.role == NORM:
            return jnp.ones(self.shape, jnp.float32)
        if self.role in (BIAS, BALANCE):
            return jnp.zeros(self.shape, jnp.float32)
        if not self.transposed:
            return self.std * jax.random.normal(key, self.shape, jnp.float32)
        layers, out, inp = self.shape
        return jnp.swapaxes(self.std * jax.random.normal(key, (layers, inp, out), jnp.float32), 1, 2)


def dense(std: float, shape: tuple, axes: tuple, n_out_dims: int, bias: bool, transposed: bool = False) -> dict:
    """A stacked linear layer: kernel (layers, *in, *out), or with `transposed` (one in and one out
    axis) (layers, out, in) as torch's nn.Linear stores it; bias (layers, *out)."""
    if transposed:
        layers, inp, out = shape
        kernel = Param((layers, out, inp), (axes[0], axes[2], axes[1]), MATRIX, std, transposed=True,
                       matrix=((2,), (1,)))
    else:
        n = len(shape)
        outputs = tuple(d for d in range(n - n_out_dims, n) if axes[d] not in FUSED)
        kernel = Param(shape, axes, MATRIX, std, matrix=(tuple(range(1, n - n_out_dims)), outputs))
    declared = {"kernel": kernel}
    if bias:
        declared["bias"] = Param(shape[:1] + shape[-n_out_dims:], axes[:1] + axes[-n_out_dims:], BIAS)
    return declared


def norm(shape: tuple, axes: tuple, bias: bool = False) -> dict:
    """A norm's scale, and with `bias` LayerNorm's bias."""
    declared = {"scale": Param(shape, axes, NORM)}
    if bias:
        declared["bias"] = Param(shape, axes, BIAS)
    return declared


def is_param(node) -> bool:
    return isinstance(node, Param)


def in_order(declared: dict, prefix: tuple = ()):
    """(path, Param) of every declared parameter, in declaration order (depth first)."""
    for name, node in declared.items():
        if is_param(node):
            yield prefix + (name,), node
        else:
            yield from in_order(node, prefix + (name,))


def tree_of(declared: dict, fn) -> dict:
    """The nested dict of fn(Param) for every declared parameter."""
    return {name: fn(node) if is_param(node) else tree_of(node, fn) for name, node in declared.items()}


def initial_params(declared: dict, seed: int) -> dict:
    """The params, each random one drawn with the next key of the seed's stream (key i is
    fold_in(key(seed), i), in declaration order: Flax NNX's Rngs(seed).params() stream)."""
    base, keys, count = jax.random.key(seed), {}, 0
    for path, param in in_order(declared):
        if param.random:
            keys[path], count = jax.random.fold_in(base, count), count + 1
    values = {path: param.initial(keys.get(path)) for path, param in in_order(declared)}
    return unflatten(values)


def unflatten(flat: dict[tuple, object]) -> dict:
    out: dict = {}
    for path, value in flat.items():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return out


def shapes_of(declared: dict) -> dict:
    return tree_of(declared, lambda p: jax.ShapeDtypeStruct(p.shape, jnp.float32))


def axes_of(declared: dict) -> dict:
    return tree_of(declared, lambda p: p.axes)


def per_layer(stacked_axes: dict) -> dict:
    """A stack's axes without its stacked one: each layer's (axes_of's tree, or part of it)."""
    return jax.tree.map(lambda names: names[1:], stacked_axes, is_leaf=lambda n: isinstance(n, tuple))


def roles_of(declared: dict) -> dict:
    return tree_of(declared, lambda p: p.role)


def matrices_of(declared: dict) -> dict:
    """Each param's matrix view (Param.matrix), or None where it is not a matrix."""
    return tree_of(declared, lambda p: p.matrix if p.role == MATRIX else None)
