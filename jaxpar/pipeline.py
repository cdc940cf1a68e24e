"""Pipeline parallelism: each stage holds n_layer/pp of the stacked layers; one executor runs any table.

The blocks run inside `jax.shard_map`, manual over 'pipe' only, so data and tensor parallelism and
ZeRO still come from the shardings. Activations go to the next stage and gradients to the previous
one with `ppermute`. A backward is explicit: `jax.vjp` of the stage on its saved input, recomputing
the forward, so a stage keeps one input per microbatch in flight (at most pp for 1F1B).
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.config import Config
from jaxpar.flops import flops_per_token, hardware_flops_per_token
from jaxpar.model import apply_blocks, cross_entropy, embed, logits_of, split_layers
from jaxpar.orders import BACKWARD, FORWARD, IDLE
from jaxpar.schedule import Schedule, resolve_microbatches
from jaxpar.sharding import constrain

PIPE = "pipe"
HEAD = ("wte", "ln_f")  # the params the loss needs after the last block: the tied lm_head and ln_f


def schedule_for(cfg: Config, mesh, forward_only: bool = False) -> Schedule:
    pp = mesh.shape[PIPE]
    M = resolve_microbatches(cfg, mesh.shape["data"], pp)
    return Schedule("forward" if forward_only else cfg.pipeline.schedule, pp, M)


def tree_add(a, b):
    return jax.tree.map(jnp.add, a, b)


def make_executor(cfg: Config, vocab_size: int, layer_axes: dict, schedule: Schedule, mesh):
    """run(layer_params, head, x0, targets, layer_keys) -> (losses, layer_grads, head_grads, dx0).

    x0 (M, rows, seq, embed) is the embedded input of every microbatch; losses (M,) are each
    microbatch's mean loss; the gradients are summed over microbatches (in order, as one device's
    gradient accumulation sums them). A forward-only schedule returns the losses alone.
    """
    pp, M, train = schedule.pp, schedule.microbatches, schedule.name != "forward"
    table = schedule.executor_arrays()
    dtype = jnp.dtype(cfg.model.dtype)
    to_next = [(s, s + 1) for s in range(pp - 1)]
    to_previous = [(s + 1, s) for s in range(pp - 1)]

    def per_stage(layer_params, head, x0, targets, layer_keys):
        stage = jax.lax.axis_index(PIPE)
        is_first, is_last = stage == 0, stage == pp - 1

        arrays = {name: jnp.asarray(a) for name, a in table.items()}  # one constant each

        def at(name, t):  # this stage's entry of a schedule array at tick t
            return arrays[name][t, stage]

        def run_stage(params, x, k):
            return apply_blocks(params, layer_axes, x, cfg.model, None if layer_keys is None else layer_keys[k])

        def loss_of(head, y, k):
            return cross_entropy(logits_of(head, y, vocab_size, dtype), targets[k])

        def stage_input(c, t):
            return jnp.where(is_first, x0[at("microbatch", t)], c["inputs"][at("input_slot", t)])

        def idle(c, t):
            return c, jnp.zeros_like(x0[0]), jnp.zeros_like(x0[0])

        def forward(c, t):
            k = at("microbatch", t)
            y = run_stage(layer_params, stage_input(c, t), k)

            def loss_here(c):
                if not train:
                    return {**c, "losses": c["losses"].at[k].set(loss_of(head, y, k))}
                loss, (d_head, dy) = jax.value_and_grad(loss_of, argnums=(0, 1))(head, y, k)
                return {**c, "losses": c["losses"].at[k].set(loss),
                        "head_grads": tree_add(c["head_grads"], d_head),
                        "grads_in": c["grads_in"].at[at("grad_slot", t)].set(dy)}
            return jax.lax.cond(is_last, loss_here, lambda c: c, c), y, jnp.zeros_like(y)

        def backward(c, t):
            k = at("microbatch", t)
            x = stage_input(c, t)
            _, vjp = jax.vjp(lambda params, x: run_stage(params, x, k), layer_params, x)
            d_params, dx = vjp(c["grads_in"][at("grad_slot", t)])
            dx0 = c["dx0"].at[k].set(jnp.where(is_first, dx, c["dx0"][k]))
            return {**c, "layer_grads": tree_add(c["layer_grads"], d_params), "dx0": dx0}, \
                jnp.zeros_like(dx), dx

        def store(buffer, slot, value):  # slot < 0: nothing arrives for this stage this tick
            i = jnp.maximum(slot, 0)
            return buffer.at[i].set(jnp.where(slot >= 0, value, buffer[i]))

        def tick(c, t):
            branches = {IDLE: idle, FORWARD: forward} | ({BACKWARD: backward} if train else {})
            c, to_send_next, to_send_previous = jax.lax.switch(
                at("kind", t), [branches[kind] for kind in sorted(branches)], c, t)
            c["inputs"] = store(c["inputs"], at("store_input", t), jax.lax.ppermute(to_send_next, PIPE, to_next))
            if train:
                c["grads_in"] = store(c["grads_in"], at("store_grad", t),
                                      jax.lax.ppermute(to_send_previous, PIPE, to_previous))
            return c, None

        def buffer(slots):
            return constrain(jnp.zeros((slots,) + x0.shape[1:], x0.dtype),
                             ("microbatch", "batch", "seq", "embed"))

        carry = {"inputs": buffer(schedule.input_slots), "losses": jnp.zeros((M,), jnp.float32)}
        if train:
            carry |= {"grads_in": buffer(schedule.grad_slots), "dx0": jnp.zeros_like(x0),
                      "layer_grads": jax.tree.map(jnp.zeros_like, layer_params),
                      "head_grads": jax.tree.map(jnp.zeros_like, head)}
        carry, _ = jax.lax.scan(tick, carry, jnp.arange(schedule.ticks))
        # Only the last stage has losses and head gradients, only the first has dx0: psum shares them.
        losses = jax.lax.psum(carry["losses"], PIPE)
        if not train:
            return losses
        return (losses, carry["layer_grads"], jax.lax.psum(carry["head_grads"], PIPE),
                jax.lax.psum(carry["dx0"], PIPE))

    def run(layer_params, head, x0, targets, layer_keys=None):
        out_specs = (P(), P(PIPE), P(), P()) if train else P()
        in_specs = (P(PIPE), P(), P(), P(), None if layer_keys is None else P(None, PIPE))
        # check_vma=False: nothing differentiates through this map (backwards are explicit vjps).
        return jax.shard_map(per_stage, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             axis_names=frozenset({PIPE}), check_vma=False)(
            layer_params, head, x0, targets, layer_keys)

    return run


def dropout_keys(cfg: Config, round_key, M: int):
    """Per microbatch: the embedding's key and one key per layer, as the unpipelined model splits them."""
    if round_key is None:
        return None, None
    keys = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(round_key[0], round_key[1] * M + i),
                                               cfg.model.n_layer + 1))(jnp.arange(M))
    return keys[:, 0], keys[:, 1:]


def make_round_fn(cfg: Config, vocab_size: int, axes: dict, mesh, forward_only: bool = False):
    """f(params, inputs, targets, round_key) -> (mean loss, grads) for one round of M microbatches.

    inputs/targets are (M, rows, seq). The embedding runs before the pipeline and the head's loss
    on the last stage; the embedding's backward is a vjp of the first stage's input gradients.
    round_key is (step key, round index) when dropout is on, else None. forward_only: loss only.
    """
    schedule = schedule_for(cfg, mesh, forward_only)
    rate = cfg.model.dropout

    def round_fn(params, inputs, targets, round_key=None):
        top, _, layer_params, layer_axes = split_layers(params, axes)
        run = make_executor(cfg, vocab_size, layer_axes, schedule, mesh)
        embed_keys, layer_keys = dropout_keys(cfg, round_key, schedule.microbatches)
        head = {name: top[name] for name in HEAD}

        def embed_all(top):
            if embed_keys is None:
                return jax.vmap(lambda tokens: embed(top, tokens, rate, None))(inputs)
            return jax.vmap(lambda tokens, key: embed(top, tokens, rate, key))(inputs, embed_keys)

        if forward_only:
            return run(layer_params, head, embed_all(top), targets, layer_keys).mean()
        x0, embed_vjp = jax.vjp(embed_all, top)
        losses, layer_grads, head_grads, dx0 = run(layer_params, head, x0, targets, layer_keys)
        (top_grads,) = embed_vjp(dx0)
        grads = {**top_grads, **{name: tree_add(top_grads[name], head_grads[name]) for name in HEAD},
                 "blocks": layer_grads}
        return losses.mean(), jax.tree.map(lambda g: g / schedule.microbatches, grads)

    return round_fn


def summary(cfg: Config, mesh, vocab_size: int) -> dict:
    """The schedule's shape and theoretical bubble; a bubble of 0 without a pipeline."""
    if mesh.shape["pipe"] == 1:
        return {"bubble_fraction": 0.0}
    schedule = schedule_for(cfg, mesh)
    model_flops = flops_per_token(cfg.model, vocab_size)
    return {"schedule": schedule.name, "microbatches": schedule.microbatches, "ticks": schedule.ticks,
            "bubble_fraction": schedule.bubble_fraction, "inputs_held_per_stage": schedule.input_slots,
            # Each backward reruns its stage's forward from the saved input: HFU = MFU x this.
            "hardware_flops_factor": hardware_flops_per_token(cfg.model, vocab_size, schedule.pp) / model_flops}
