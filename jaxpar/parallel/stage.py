"""One pipeline stage inside the executor's `shard_map` (jaxpar.parallel.pipeline): the schedule
table's entries for this stage, and the ops a tick runs (idle, F, B, B without W, W) on the
stage's buffers. Where a chunk's output goes (down the stages, up them, or kept) is the table's,
from the schedule's placement: the stage compares no schedule's name.
"""

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.axes import PIPE
from jaxpar.models.transformer import Transformer
from jaxpar.nn.layers import STREAM
from jaxpar.parallel.schedules.base import SOURCES, PipelineSchedule
from jaxpar.parallel.schedules.ops import BACKWARD, DOWN, FORWARD, IDLE, INPUT_GRAD, UP, WEIGHT


def tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


class StageOps:
    """One pipeline stage inside `shard_map`: the schedule table's entries for this stage, and the
    ops a tick can run (idle, F, B, B without W, W), each (carry, tick) -> (carry, its output: the
    forward's activation or the backward's input gradient, sent where the table says).

    The carry holds the stage's buffers: inputs and output gradients in their slots, the losses,
    each auxiliary loss of its own layers, and the gradients summed so far. A backward's output
    gradient is the loss's for the stage's output, and each auxiliary loss's weight for its part.
    """

    def __init__(self, model: Transformer, layer_axes: dict, schedule: PipelineSchedule, table: dict,
                 layer_params, head, x0, targets, layer_keys, doc_starts=None):
        """`model`: under the plan inside the executor's shard_map."""
        self.model, self.layer_axes, self.schedule = model, layer_axes, schedule
        self.weights = {name: jnp.float32(w) for name, w in model.family.loss_weights().items()}
        self.head, self.x0, self.targets, self.doc_starts = head, x0, targets, doc_starts
        self.V, self.train = schedule.virtual, schedule.trains
        self.stage = jax.lax.axis_index(PIPE)
        last_stage, last_chunk = schedule.placement.last  # the loss follows the last chunk's forward
        self.is_first = self.stage == 0  # the first chunk's home: stage 0's chunk 0
        self.is_last_chunk = lambda chunk: (self.stage == last_stage) & (chunk == last_chunk)
        self.arrays = {name: jnp.asarray(a) for name, a in table.items()}  # one constant each
        # (where it comes from, whether a gradient) of every value the table stores: the stores to emit
        self.routes = {(direction, int(grad)) for direction, source in SOURCES.items()
                       for slot, grad in zip(table[f"{source}_slot"].flat, table[f"{source}_grad"].flat) if slot >= 0}
        # (V * layers per chunk, ...) -> (V, layers per chunk, ...); the keys are (M, layers, ...)
        self.chunks = jax.tree.map(lambda a: a.reshape((self.V, -1) + a.shape[1:]), layer_params)
        self.key_chunks = None if layer_keys is None else layer_keys.reshape(
            (schedule.microbatches, self.V, -1) + layer_keys.shape[2:])

    def at(self, name: str, t):
        """This stage's entry of a schedule array at tick t."""
        return self.arrays[name][t, self.stage]

    def chunk_params(self, chunk):
        return jax.tree.map(lambda a: a[chunk], self.chunks)

    def run_chunk(self, params, x, k, chunk):
        """(the chunk's output, its layers' auxiliary losses) for microbatch k."""
        keys = None if self.key_chunks is None else self.key_chunks[k, chunk]
        docs = None if self.doc_starts is None else self.doc_starts[k]
        y, aux, _ = self.model.run_layers(params, self.layer_axes, x, keys, doc_starts=docs)
        return y, aux

    def loss_of(self, head, y, k):
        """(the training loss of microbatch k's last output y, (its cross-entropy, the losses of
        predictions further ahead: DeepSeek's multi-token prediction, on this last stage))."""
        loss = self.model.sequence_loss(self.model.head(head), y, self.targets[k])
        docs = None if self.doc_starts is None else self.doc_starts[k]
        ahead = self.model.family.ahead_losses(self.model, head, y, self.targets[k], docs)
        return loss + sum(self.weights[name] * value for name, value in ahead.items()), (loss, ahead)

    def cotangents(self, aux: dict) -> dict:
        """Each auxiliary loss's weight, for the losses a chunk gives."""
        return {name: self.weights[name] for name in aux}

    def op_input(self, c, t):
        """(microbatch, chunk, its input, its output gradient) for the op at tick t."""
        k, chunk = self.at("microbatch", t), self.at("chunk", t)
        x = jnp.where(self.is_first & (chunk == 0), self.x0[k], c["inputs"][self.at("input_slot", t)])
        return k, chunk, x, c["grads_in"][self.at("grad_slot", t)] if self.train else None

    def idle(self, c, t):
        return c, jnp.zeros_like(self.x0[0])

    def forward(self, c, t):
        k, chunk, x, _ = self.op_input(c, t)
        y, aux = self.run_chunk(self.chunk_params(chunk), x, k, chunk)
        c = {**c, "aux": {name: values.at[k].add(aux.get(name, 0.0)) for name, values in c["aux"].items()}}

        def loss_here(c):  # the last chunk's output goes into the loss; its gradient starts B
            if not self.train:  # evaluation: the cross-entropy alone
                loss = self.model.sequence_loss(self.model.head(self.head), y, self.targets[k])
                return {**c, "losses": c["losses"].at[k].set(loss)}
            (_, (loss, ahead)), (d_head, dy) = jax.value_and_grad(self.loss_of, argnums=(0, 1), has_aux=True)(
                self.head, y, k)
            return {**c, "losses": c["losses"].at[k].set(loss),
                    "aux": {name: values.at[k].add(ahead.get(name, 0.0)) for name, values in c["aux"].items()},
                    "head_grads": tree_add(c["head_grads"], d_head),
                    "grads_in": c["grads_in"].at[self.at("grad_slot", t)].set(dy)}
        c = jax.lax.cond(self.is_last_chunk(chunk), loss_here, lambda c: c, c)
        return c, y

    def add_weight_grads(self, c, chunk, d_params):
        return {**c, "layer_grads": jax.tree.map(lambda g, d: g.at[chunk].add(d), c["layer_grads"], d_params)}

    def backward(self, c, t, weights: bool = True):
        """The input gradient, and unless its W runs apart (INPUT_GRAD), the weight gradient."""
        k, chunk, x, dy = self.op_input(c, t)
        if not weights:
            (_, aux), vjp = jax.vjp(lambda x: self.run_chunk(self.chunk_params(chunk), x, k, chunk), x)
            (dx,) = vjp((dy, self.cotangents(aux)))
        else:
            (_, aux), vjp = jax.vjp(lambda params, x: self.run_chunk(params, x, k, chunk), self.chunk_params(chunk), x)
            d_params, dx = vjp((dy, self.cotangents(aux)))
            c = self.add_weight_grads(c, chunk, d_params)
        dx0 = c["dx0"].at[k].set(jnp.where(self.is_first & (chunk == 0), dx, c["dx0"][k]))
        return {**c, "dx0": dx0}, dx

    def input_grad(self, c, t):
        return self.backward(c, t, weights=False)

    def weight(self, c, t):
        """W: the weight gradient, rerunning the chunk from its saved input."""
        k, chunk, x, dy = self.op_input(c, t)
        (_, aux), vjp = jax.vjp(lambda params: self.run_chunk(params, x, k, chunk), self.chunk_params(chunk))
        (d_params,) = vjp((dy, self.cotangents(aux)))
        return self.add_weight_grads(c, chunk, d_params), jnp.zeros_like(x)

    def tick(self, c, t, down_pairs, up_pairs):
        """Run this tick's op, send its output down or up the stages (or keep it), then store what
        arrived into the slots the table names."""
        every = {IDLE: self.idle, FORWARD: self.forward, BACKWARD: self.backward, WEIGHT: self.weight,
                 INPUT_GRAD: self.input_grad}
        kinds = self.schedule.kinds
        branch = jnp.asarray(np.searchsorted(kinds, np.arange(max(kinds) + 1)), jnp.int32)[self.at("kind", t)]
        ops = [every[kind] for kind in kinds]
        if self.model.plan.ring()[1] > 1:
            # A context ring's collective-permutes are one op over every device: each stage runs
            # every op and keeps its own, so all of them send in the same order (a switch whose
            # branch differs between stages would leave the sends unmatched).
            outs = [op(c, t) for op in ops]
            c, out = jax.tree.map(lambda *xs: jax.lax.select_n(branch, *xs), *outs)
        else:
            c, out = jax.lax.switch(branch, ops, c, t)
        send, used = self.at("send", t), {direction for direction, _ in self.routes}
        arrived = {direction: jax.lax.ppermute(jnp.where(send == direction, out, 0), PIPE, pairs)
                   for direction, pairs in ((DOWN, down_pairs), (UP, up_pairs)) if direction in used}
        for direction, source in SOURCES.items():
            value = arrived.get(direction, out)
            for buffer, is_grad in (("inputs", 0), ("grads_in", 1)):
                if (direction, is_grad) in self.routes:
                    slot = jnp.where(self.at(f"{source}_grad", t) == is_grad, self.at(f"{source}_slot", t), -1)
                    c[buffer] = store(c[buffer], slot, value)
        return c, None

    def initial_carry(self) -> dict:
        def buffer(slots):
            return self.model.plan.constrain(jnp.zeros((slots,) + self.x0.shape[1:], self.x0.dtype),
                                             ("microbatch",) + STREAM)

        per_microbatch = jnp.zeros((self.schedule.microbatches,), jnp.float32)
        carry = {"inputs": buffer(self.schedule.input_slots), "losses": per_microbatch,
                 "aux": {name: per_microbatch for name in self.weights}}
        if self.train:
            carry |= {"grads_in": buffer(self.schedule.grad_slots), "dx0": jnp.zeros_like(self.x0),
                      "layer_grads": jax.tree.map(jnp.zeros_like, self.chunks),
                      "head_grads": jax.tree.map(jnp.zeros_like, self.head)}
        return carry


def store(buffer, slot, value):
    """buffer[slot] = value; slot < 0: nothing arrives for this stage this tick."""
    i = jnp.maximum(slot, 0)
    return buffer.at[i].set(jnp.where(slot >= 0, value, buffer[i]))
