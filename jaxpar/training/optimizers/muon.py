"""Muon's Newton-Schulz work split over the devices, not repeated on each.

optax.contrib's Muon orthogonalises each matrix where its momentum lives. Under a mesh that is
every matrix on every device: ZeRO splits the momentum over 'data' and tensor parallelism the
matrix over 'tensor', so jit gathers each matrix whole on every device of a pipeline stage, and
each of them runs the same iterations.

Here the matrices of one shape, from every param (each layer's q, k, v and output projection are
one (embed, embed) batch; a (3072, 768) matrix is a transposed (768, 3072) one), are stacked into
one batch, padded to a multiple of the stage's devices, and that batch is split over every mesh
axis but 'pipe': each device orthogonalises its share of whole matrices, and the results go
where the params live (one all-gather where the params are whole over 'data', ZeRO 0-2; an
all-to-all under ZeRO 3). A pipeline stage orthogonalises its own layers' matrices, and an
expert group its own experts' ('expert' already splits them: `Batch.owners`). The arithmetic per
matrix is optax's (`orthogonalize_via_newton_schulz` on the 2-D matrix), so the update is the
same as the naive form's.
"""

import itertools
import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from optax.contrib import _muon

from jaxpar.core.axes import PIPE, TENSOR
from jaxpar.core.sharding import names_of


@dataclass(frozen=True)
class Split:
    """Where the Newton-Schulz work runs: `mesh`, and each param's sharding at rest (the updates
    are put there)."""
    mesh: jax.sharding.Mesh
    params: dict  # NamedShardings shaped like the params

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes a stage's matrices are split over: every one but 'pipe'."""
        return tuple(a for a in self.mesh.axis_names if a != PIPE and self.mesh.shape[a] > 1)



def scale_by_muon(o, dims: dict, split: Split | None) -> optax.GradientTransformation:
    """optax.contrib's scale_by_muon (Nesterov momentum, Frobenius-normalised Newton-Schulz with
    its coefficients) on the params with matrix views `dims` (MuonDimensionNumbers, MaskedNode
    elsewhere), the orthogonalisation split by `split` (None: optax's own, per param)."""
    base = _muon.scale_by_muon(ns_steps=o.ns_steps, beta=o.momentum, nesterov=True, weight_dimension_numbers=dims)
    if split is None:
        return base
    beta = o.momentum

    def update(updates, state, params=None):
        mu = optax.tree.update_moment(updates, state.mu, beta, 1)
        count = optax.safe_increment(state.count)
        mu_hat = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g,
                              optax.tree.bias_correction(mu, beta, optax.safe_increment(count)),
                              optax.tree.bias_correction(updates, beta, count))
        orthogonal = orthogonalize(mu_hat, dims, split, lambda x: _muon.orthogonalize_via_newton_schulz(
            x, state.ns_coeffs, o.ns_steps))
        return orthogonal, _muon.MuonState(count=count, mu=mu, ns_coeffs=state.ns_coeffs)

    return optax.GradientTransformation(base.init, update)


def orthogonalize(tree: dict, dims: dict, split: Split, on_matrix) -> dict:
    """`on_matrix` (one 2-D matrix, rows <= columns) applied to every matrix of every param in
    `tree` under its view in `dims`. The matrices of one shape, stage count and owners (`Batch`)
    are one batch, split over the stage's devices; each result goes back to its param's shape
    and sharding."""
    is_leaf = lambda node: isinstance(node, (optax.MaskedNode, _muon.MuonDimensionNumbers))  # noqa: E731
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    shardings = treedef.flatten_up_to(split.params)
    batches: dict[tuple, list[tuple[int, Batch]]] = {}
    for i, (x, view, sharding) in enumerate(zip(leaves, treedef.flatten_up_to(dims), shardings)):
        if not isinstance(x, optax.MaskedNode):
            batch = Batch(x, view, sharding, split.mesh)
            batches.setdefault(batch.key, []).append((i, batch))
    out = list(leaves)
    for members in batches.values():
        first = members[0][1]
        others = tuple(a for a in split.axes if a not in first.owners)  # split the batch's count
        stacked = jnp.concatenate([batch.flat for _, batch in members], axis=2)
        count = stacked.shape[2]
        stacked = jnp.pad(stacked, ((0, 0), (0, 0), (0, -count % math.prod(split.mesh.shape[a] for a in others)),
                                    (0, 0), (0, 0)))
        spread = first.sharding(others)
        done = jax.vmap(jax.vmap(jax.vmap(on_matrix)))(jax.lax.with_sharding_constraint(stacked, spread))
        done = jax.lax.with_sharding_constraint(done, spread)
        # One all-gather over the axes that split no param of the batch (the data axis but under
        # ZeRO 3) and over 'tensor' (it splits a matrix's dims, which each device then slices out
        # locally), before each param's matrices are taken out of the batch.
        kept = tuple(a for a in others if a != TENSOR and any(a in axes_of(shardings[i]) for i, _ in members))
        if kept != others:
            done = jax.lax.with_sharding_constraint(done, first.sharding(kept))
        offsets = [0, *itertools.accumulate(batch.flat.shape[2] for _, batch in members)]
        for (i, batch), start, stop in zip(members, offsets, offsets[1:]):
            out[i] = jax.lax.with_sharding_constraint(batch.back(done[:, :, start:stop]), shardings[i])
    return treedef.unflatten(out)


def axes_of(sharding: NamedSharding) -> set[str]:
    return {axis for entry in sharding.spec for axis in names_of(entry)}


class Batch:
    """A param's matrices as `flat`: (stages, owners, count, rows, columns), rows <= columns (a
    tall matrix transposed, as Newton-Schulz would). `owners` are the mesh axes, but 'pipe', that
    split the param's batch dims where it lives ('expert' on the experts' dim): each device
    orthogonalises only matrices it owns, and the batch's count splits over the other axes."""

    def __init__(self, x: jax.Array, view: _muon.MuonDimensionNumbers, sharding: NamedSharding, mesh):
        reduction, output = _muon._normalize_axes(x, view)
        batch = [d for d in range(x.ndim) if d not in reduction + output]
        entries = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
        split_by = [tuple(a for a in names_of(entries[d]) if mesh.shape[a] > 1) for d in batch]
        ways = [math.prod(mesh.shape[a] for a in axes) for axes in split_by]
        self.stages = mesh.shape[PIPE] if split_by and PIPE in split_by[0] else 1
        self.owners = tuple(a for axes in split_by for a in axes if a != PIPE)
        rows, columns = (math.prod(x.shape[d] for d in dims) for dims in (reduction, output))
        self.tall, self.mesh = rows > columns, mesh
        # Each batch dim as (its ways, the rest), the ways moved in front: (pipe and owners, rest).
        moved = x.transpose(batch + list(reduction) + list(output))
        parts = [n for d, w in zip(batch, ways) for n in (w, x.shape[d] // w)]
        k = len(batch)
        order = list(range(0, 2 * k, 2)) + list(range(1, 2 * k, 2)) + [2 * k, 2 * k + 1]
        flat = moved.reshape(*parts, rows, columns).transpose(order)
        flat = flat.reshape(self.stages, math.prod(ways) // self.stages, -1, rows, columns)
        self.flat = flat.transpose(0, 1, 2, 4, 3) if self.tall else flat
        self.key = (self.stages, self.owners, *self.flat.shape[3:])

        def back(done):
            done = done.transpose(0, 1, 2, 4, 3) if self.tall else done
            unflat = done.reshape(*(parts[i] for i in order[:2 * k]), rows, columns)
            unmoved = unflat.transpose([order.index(i) for i in range(2 * k + 2)])
            return unmoved.reshape(*(x.shape[d] for d in batch + list(reduction) + list(output))).transpose(
                [(batch + list(reduction) + list(output)).index(d) for d in range(x.ndim)])
        self.back = back

    def sharding(self, count_axes: tuple[str, ...]) -> NamedSharding:
        """The batch with its count split over `count_axes`."""
        return NamedSharding(self.mesh, P(PIPE if self.stages > 1 else None, self.owners or None,
                                          count_axes or None, None, None))
