"""Pipeline parallelism: each stage holds n_layer/pp of the stacked layers; one executor runs any table.

The blocks run inside `jax.shard_map`, manual over 'pipe' (and over 'data' while training, where
each stage reduces its gradients once per round), so tensor parallelism, ZeRO, and data
parallelism elsewhere come from the shardings. Activations go to the next stage and gradients to the previous
one with `ppermute`. A backward is explicit: `jax.vjp` of the stage on its saved input, recomputing
the forward, so a stage keeps one input per microbatch in flight (at most pp for 1F1B).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import DATA, PIPE, pipeline_microbatches
from jaxpar.core.config import Config
from jaxpar.core.execution import STAGES_REDUCE
from jaxpar.core.sharding import split_ways
from jaxpar.models.family import Transformer, split_layers
from jaxpar.models.flops import flops_per_token, hardware_flops_per_token
from jaxpar.nn.layers import STREAM, document_positions
from jaxpar.nn.params import LEAD
from jaxpar.parallel.orders import BACKWARD, FORWARD, IDLE, WEIGHT
from jaxpar.parallel.schedule import Schedule


def schedule_for(cfg: Config, mesh, forward_only: bool = False) -> Schedule:
    """Evaluation runs the layers in order (a forward per stage); training runs cfg's schedule."""
    pp = mesh.shape[PIPE]
    M = pipeline_microbatches(cfg, split_ways(mesh, "batch"), pp)
    if forward_only:
        return Schedule("forward", pp, M)
    return Schedule(cfg.pipeline.schedule, pp, M, cfg.pipeline.virtual)


def tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


def chunk_major(tree, pp: int, virtual: int, axis: int = 0, inverse: bool = False):
    """Reorder a layer axis so that stage s's contiguous share holds chunks s, s+pp, ... (interleaved).

    Params stay in layer order everywhere else (checkpoints, evaluation, export); under jit the
    reorder and its inverse for the gradients are communication over 'pipe' every round (an
    all-to-all on XLA:CPU; docs/benchmarks.md has what XLA:TPU makes of it).
    """
    if virtual == 1:
        return tree
    order = (virtual, pp) if not inverse else (pp, virtual)

    def move(a):
        shape = a.shape
        split = a.reshape(shape[:axis] + order + (shape[axis] // (pp * virtual),) + shape[axis + 1:])
        return jnp.swapaxes(split, axis, axis + 1).reshape(shape)
    return jax.tree.map(move, tree)


class StageOps:
    """One pipeline stage inside `shard_map`: the schedule table's entries for this stage, and the
    ops a tick can run (idle, F, B, W), each (carry, tick) -> (carry, to next stage, to previous).

    The carry holds the stage's buffers: inputs and output gradients in their slots, the losses,
    each auxiliary loss of its own layers, and the gradients summed so far. A backward's output
    gradient is the loss's for the stage's output, and each auxiliary loss's weight for its part.
    """

    def __init__(self, model: Transformer, layer_axes: dict, schedule: Schedule, table: dict,
                 layer_params, head, x0, targets, layer_keys, doc_starts=None):
        """`model`: under the plan inside the executor's shard_map."""
        self.model, self.layer_axes, self.schedule = model, layer_axes, schedule
        self.weights = {name: jnp.float32(w) for name, w in model.family.loss_weights().items()}
        self.head, self.x0, self.targets, self.doc_starts = head, x0, targets, doc_starts
        self.V, self.train = schedule.virtual, schedule.name != "forward"
        self.split_backward = schedule.name == "zb-h1"  # B the input gradient only; W the weights
        self.stage = jax.lax.axis_index(PIPE)
        self.is_first, self.is_last = self.stage == 0, self.stage == schedule.pp - 1
        self.arrays = {name: jnp.asarray(a) for name, a in table.items()}  # one constant each
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
        return c, jnp.zeros_like(self.x0[0]), jnp.zeros_like(self.x0[0])

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
        c = jax.lax.cond(self.is_last & (chunk == self.V - 1), loss_here, lambda c: c, c)
        return c, y, jnp.zeros_like(y)

    def add_weight_grads(self, c, chunk, d_params):
        return {**c, "layer_grads": jax.tree.map(lambda g, d: g.at[chunk].add(d), c["layer_grads"], d_params)}

    def backward(self, c, t):
        """The input gradient, and unless ZB-H1 splits off W, the weight gradient."""
        k, chunk, x, dy = self.op_input(c, t)
        if self.split_backward:
            (_, aux), vjp = jax.vjp(lambda x: self.run_chunk(self.chunk_params(chunk), x, k, chunk), x)
            (dx,) = vjp((dy, self.cotangents(aux)))
        else:
            (_, aux), vjp = jax.vjp(lambda params, x: self.run_chunk(params, x, k, chunk), self.chunk_params(chunk), x)
            d_params, dx = vjp((dy, self.cotangents(aux)))
            c = self.add_weight_grads(c, chunk, d_params)
        dx0 = c["dx0"].at[k].set(jnp.where(self.is_first & (chunk == 0), dx, c["dx0"][k]))
        return {**c, "dx0": dx0}, jnp.zeros_like(dx), dx

    def weight(self, c, t):
        """ZB-H1's W: the weight gradient, rerunning the chunk from its saved input."""
        k, chunk, x, dy = self.op_input(c, t)
        (_, aux), vjp = jax.vjp(lambda params: self.run_chunk(params, x, k, chunk), self.chunk_params(chunk))
        (d_params,) = vjp((dy, self.cotangents(aux)))
        return self.add_weight_grads(c, chunk, d_params), jnp.zeros_like(x), jnp.zeros_like(x)

    def tick(self, c, t, to_next, to_previous):
        """Run this tick's op, then store what the neighbours sent into the slots the table names."""
        branches = {IDLE: self.idle, FORWARD: self.forward}
        if self.train:
            branches[BACKWARD] = self.backward
        if self.split_backward:
            branches[WEIGHT] = self.weight
        kind, ops = self.at("kind", t), [branches[kind] for kind in sorted(branches)]
        if self.model.plan.ring()[1] > 1:
            # A context ring's collective-permutes are one op over every device: each stage runs
            # every op and keeps its own, so all of them send in the same order (a switch whose
            # branch differs between stages would leave the sends unmatched).
            outs = [op(c, t) for op in ops]
            c, to_send_next, to_send_previous = jax.tree.map(lambda *xs: jax.lax.select_n(kind, *xs), *outs)
        else:
            c, to_send_next, to_send_previous = jax.lax.switch(kind, ops, c, t)
        c["inputs"] = store(c["inputs"], self.at("store_input", t), jax.lax.ppermute(to_send_next, PIPE, to_next))
        if self.train:
            c["grads_in"] = store(c["grads_in"], self.at("store_grad", t),
                                  jax.lax.ppermute(to_send_previous, PIPE, to_previous))
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


def make_executor(model: Transformer, layer_axes: dict, schedule: Schedule):
    """run(layer_params, head, x0, targets, layer_keys, doc_starts) -> (losses, aux, layer_grads,
    head_grads, dx0).

    x0 (M, rows, seq, embed) is the embedded input of every microbatch, doc_starts (M, rows, seq)
    its tokens' document starts or None; losses (M,) are each
    microbatch's mean loss, aux each auxiliary loss's (M,) over every stage's layers; the gradients
    are summed over microbatches (in order, as one device's gradient accumulation sums them). A
    forward-only schedule returns the losses alone. With V layer chunks per stage, layer_params and
    layer_keys come in chunk_major order.
    """
    pp, train = schedule.pp, schedule.name != "forward"
    table = schedule.executor_arrays()
    ring = schedule.virtual > 1  # the last stage's output feeds stage 0's next chunk
    to_next = [(s, (s + 1) % pp) for s in range(pp if ring else pp - 1)]
    to_previous = [((s + 1) % pp, s) for s in range(pp if ring else pp - 1)]

    # Each stage sums its microbatches' weight gradients over its own rows and reduces them over
    # 'data' once per round, the rows split over 'data' by hand, where the plan says so
    # (jaxpar.training.execution); else the shardings reduce each microbatch's.
    plan = model.plan
    local = train and plan.pipeline["gradients_reduced"] == STAGES_REDUCE
    manual, rows = (frozenset({PIPE, DATA}), P(None, DATA)) if local else (frozenset({PIPE}), P())
    stage_model = model.on(plan.inside(*manual))

    def per_stage(layer_params, head, x0, targets, layer_keys, doc_starts):
        ops = StageOps(stage_model, layer_axes, schedule, table, layer_params, head, x0, targets, layer_keys,
                       doc_starts)
        carry, _ = jax.lax.scan(lambda c, t: ops.tick(c, t, to_next, to_previous), ops.initial_carry(),
                                jnp.arange(schedule.ticks))
        # Only the last stage has losses and head gradients, only the first has dx0: psum shares them.
        losses, aux = jax.lax.psum((carry["losses"], carry["aux"]), PIPE)
        if not train:
            return losses
        layer_grads = jax.tree.map(lambda g, p: g.reshape(p.shape), carry["layer_grads"], layer_params)
        head_grads = jax.lax.psum(carry["head_grads"], PIPE)
        dx0 = jax.lax.psum(carry["dx0"], PIPE)
        if local:  # a device's loss is the mean over its own rows: the batch's is the mean of those
            losses, aux, layer_grads, head_grads = jax.lax.pmean((losses, aux, layer_grads, head_grads), DATA)
            dx0 = dx0 / plan.sizes[DATA]
        return losses, aux, layer_grads, head_grads, dx0

    def run(layer_params, head, x0, targets, layer_keys=None, doc_starts=None):
        out_specs = (P(), P(), P(PIPE), P(), rows) if train else P()
        in_specs = (P(PIPE), P(), rows, rows, None if layer_keys is None else P(None, PIPE),
                    None if doc_starts is None else rows)
        # check_vma=False: nothing differentiates through this map (backwards are explicit vjps).
        # Inside it the rule table leaves out the manual axes (pipe, and data when local).
        return jax.shard_map(per_stage, mesh=plan.mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=manual, check_vma=False)(
            layer_params, head, x0, targets, layer_keys, doc_starts)

    return run


def dropout_keys(cfg: Config, round_key, M: int):
    """Per microbatch: the embedding's key and one key per layer, as the unpipelined model splits them."""
    if round_key is None:
        return None, None
    keys = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(round_key[0], round_key[1] * M + i),
                                               cfg.model.n_layer + 1))(jnp.arange(M))
    return keys[:, 0], keys[:, 1:]


def make_round_fn(cfg: Config, model: Transformer, forward_only: bool = False):
    """f(params, inputs, targets, round_key) -> (metrics, grads) for one round of M microbatches:
    the metrics are the mean cross-entropy `loss` and each auxiliary loss, means over the round.

    inputs/targets are (M, rows, seq). The embedding and the dense first layers (jaxpar.models.lead)
    run before the pipeline and the head's loss on the last stage; their backward is a vjp of the
    first stage's input gradients.
    round_key is (step key, round index) when dropout is on, else None. forward_only: loss only.
    """
    schedule = schedule_for(cfg, model.plan.mesh, forward_only)
    family, plan = model.family, model.plan

    def round_fn(params, inputs, targets, round_key=None):
        top, _, layer_params, layer_axes = split_layers(params, model.axes())
        run = make_executor(model, layer_axes, schedule)
        embed_keys, layer_keys = dropout_keys(cfg, round_key, schedule.microbatches)
        k = cfg.model.lead_layers
        lead_keys, layer_keys = (None, None) if layer_keys is None else (layer_keys[:, :k], layer_keys[:, k:])
        head = model.head(top) | {name: top[name] for name in family.ahead_params()}  # the last stage's
        doc_starts = None if model.eot_id is None else jax.vmap(model.doc_starts)(inputs)
        positions = document_positions(plan, doc_starts, inputs.shape[-1])  # broadcast over microbatches
        lead = {LEAD: params[LEAD]} if LEAD in params else {}

        def embed_all(top, lead):
            """Every microbatch embedded and through the dense first layers: (x0, their losses (M,))."""
            keys = () if embed_keys is None else (embed_keys,)

            def embed(tokens, at, *key):
                return family.embed(plan, top, tokens, key[0] if key else None, at)
            x0 = jax.vmap(embed, in_axes=(0, None if positions is None else 0) + (0,) * len(keys))(
                inputs, positions, *keys)
            if not lead:
                return x0, {}
            first = lambda mb: model.run_lead(lead, mb[0], mb[1], doc_starts=mb[2])[:2]
            return jax.lax.map(first, (x0, lead_keys, doc_starts))

        if forward_only:
            return run(layer_params, head, embed_all(top, lead)[0], targets, layer_keys, doc_starts).mean()
        (x0, lead_aux), embed_vjp = jax.vjp(embed_all, top, lead)
        pp, V = schedule.pp, schedule.virtual
        losses, aux, layer_grads, head_grads, dx0 = run(
            chunk_major(layer_params, pp, V), head, x0, targets, chunk_major(layer_keys, pp, V, axis=1), doc_starts)
        layer_grads = chunk_major(layer_grads, pp, V, inverse=True)
        weights = family.loss_weights()
        top_grads, lead_grads = embed_vjp((dx0, {name: jnp.full_like(values, weights[name])
                                                 for name, values in lead_aux.items()}))
        grads = {**top_grads, **{name: tree_add(top_grads[name], grad) for name, grad in head_grads.items()},
                 **lead_grads, "blocks": layer_grads}
        aux = {name: values + lead_aux.get(name, 0.0) for name, values in aux.items()}
        metrics = {"loss": losses.mean(), **{name: values.mean() for name, values in aux.items()}}
        return metrics, jax.tree.map(lambda g: g / schedule.microbatches, grads)

    return round_fn


def summary(cfg: Config, mesh, vocab_size: int) -> dict:
    """The schedule's shape and theoretical bubble; a bubble of 0 without a pipeline."""
    if mesh.shape[PIPE] == 1:
        return {"bubble_fraction": 0.0}
    schedule = schedule_for(cfg, mesh)
    model_flops = flops_per_token(cfg.model, vocab_size)
    return {"schedule": schedule.name, "virtual": schedule.virtual, "microbatches": schedule.microbatches,
            "ticks": schedule.ticks,
            "bubble_fraction": schedule.bubble_fraction, "inputs_held_per_stage": schedule.input_slots,
            "grads_held_per_stage": schedule.grad_slots,
            # Each backward reruns its stage's forward from the saved input: HFU = MFU x this.
            "hardware_flops_factor": hardware_flops_per_token(cfg.model, vocab_size, schedule.pp,
                                                              schedule.name) / model_flops}
