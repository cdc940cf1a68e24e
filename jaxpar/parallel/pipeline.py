"""Pipeline parallelism: each stage holds its share of the stacked layers; one executor runs any table.

The blocks run inside `jax.shard_map`, manual over 'pipe' (and over 'data' while training, where
each stage reduces its gradients once per round), so tensor parallelism, ZeRO, and data
parallelism elsewhere come from the shardings. Activations go to the next stage and gradients to the previous
one with `ppermute`. A backward is explicit: `jax.vjp` of the stage on its saved input, recomputing
the forward, so a stage keeps one input per microbatch in flight (at most pp for 1F1B). A stage's
ops are jaxpar.parallel.stage's.
"""

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import DATA, PIPE
from jaxpar.core.strategies import StageGrads
from jaxpar.models.flops import flops_per_token, hardware_flops_per_token
from jaxpar.models.transformer import Transformer, split_layers
from jaxpar.nn.layers import document_positions
from jaxpar.nn.params import LEAD
from jaxpar.parallel.schedules import evaluation
from jaxpar.parallel.schedules.base import PipelineSchedule
from jaxpar.parallel.stage import StageOps, tree_add


def make_executor(model: Transformer, layer_axes: dict, schedule: PipelineSchedule):
    """run(layer_params, head, x0, targets, layer_keys, doc_starts) -> (losses, aux, layer_grads,
    head_grads, dx0).

    x0 (M, rows, seq, embed) is the embedded input of every microbatch, doc_starts (M, rows, seq)
    its tokens' document starts or None; losses (M,) are each
    microbatch's mean loss, aux each auxiliary loss's (M,) over every stage's layers; the gradients
    are summed over microbatches (in order, as one device's gradient accumulation sums them). A
    forward-only schedule returns the losses alone. With V layer chunks per stage, layer_params and
    layer_keys come in the placement's stage-major order.
    """
    pp, train = schedule.pp, schedule.trains
    table = schedule.executor_arrays()
    ring = schedule.placement.wraps  # in a loop of chunks the last stage's output feeds stage 0's next
    down = [(s, (s + 1) % pp) for s in range(pp if ring else pp - 1)]
    up = [((s + 1) % pp, s) for s in range(pp if ring else pp - 1)]

    # Each stage sums its microbatches' weight gradients over its own rows and reduces them over
    # 'data' once per round, the rows split over 'data' by hand, where the plan says so
    # (jaxpar.training.step.execution); else the shardings reduce each microbatch's.
    plan = model.plan
    local = train and plan.stage_grads == StageGrads.STAGES_REDUCE
    manual, rows = (frozenset({PIPE, DATA}), P(None, DATA)) if local else (frozenset({PIPE}), P())
    stage_model = model.on(plan.inside(*manual))

    def per_stage(layer_params, head, x0, targets, layer_keys, doc_starts):
        ops = StageOps(stage_model, layer_axes, schedule, table, layer_params, head, x0, targets, layer_keys,
                       doc_starts)
        carry, _ = jax.lax.scan(lambda c, t: ops.tick(c, t, down, up), ops.initial_carry(),
                                jnp.arange(schedule.ticks))
        # Only the loss's stage has losses and head gradients, only the first has dx0: psum shares them.
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


def dropout_keys(n_layer: int, round_key, M: int):
    """Per microbatch: the embedding's key and one key per layer, as the unpipelined model splits them."""
    if round_key is None:
        return None, None
    keys = jax.vmap(lambda i: jax.random.split(jax.random.fold_in(round_key[0], round_key[1] * M + i),
                                               n_layer + 1))(jnp.arange(M))
    return keys[:, 0], keys[:, 1:]


def make_round_fn(model: Transformer, forward_only: bool = False):
    """f(params, inputs, targets, round_key) -> (metrics, grads) for one round of M microbatches:
    the metrics are the mean cross-entropy `loss` and each auxiliary loss, means over the round.

    inputs/targets are (M, rows, seq). The embedding and the dense first layers (jaxpar.models.lead)
    run before the pipeline and the head's loss on the last stage; their backward is a vjp of the
    first stage's input gradients.
    round_key is (step key, round index) when dropout is on, else None. forward_only: loss only.
    """
    family, plan, schedule = model.family, model.plan, model.plan.schedule
    if forward_only:  # evaluation runs the layers in order, a forward per stage
        schedule = evaluation(schedule.pp, schedule.microbatches)

    def round_fn(params, inputs, targets, round_key=None):
        top, _, layer_params, layer_axes = split_layers(params, model.axes())
        run = make_executor(model, layer_axes, schedule)
        embed_keys, layer_keys = dropout_keys(model.cfg.n_layer, round_key, schedule.microbatches)
        k = model.cfg.lead_layers
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
        staged = schedule.placement.stage_major
        losses, aux, layer_grads, head_grads, dx0 = run(
            staged(layer_params), head, x0, targets, staged(layer_keys, axis=1), doc_starts)
        layer_grads = staged(layer_grads, inverse=True)
        weights = family.loss_weights()
        top_grads, lead_grads = embed_vjp((dx0, {name: jnp.full_like(values, weights[name])
                                                 for name, values in lead_aux.items()}))
        grads = {**top_grads, **{name: tree_add(top_grads[name], grad) for name, grad in head_grads.items()},
                 **lead_grads, "blocks": layer_grads}
        aux = {name: values + lead_aux.get(name, 0.0) for name, values in aux.items()}
        metrics = {"loss": losses.mean(), **{name: values.mean() for name, values in aux.items()}}
        return metrics, jax.tree.map(lambda g: g / schedule.microbatches, grads)

    return round_fn


def summary(model: Transformer) -> dict:
    """The schedule's shape and theoretical bubble; a bubble of 0 without a pipeline."""
    schedule, m, vocab_size = model.plan.schedule, model.cfg, model.vocab_size
    if schedule is None:
        return {"bubble_fraction": 0.0}
    model_flops = flops_per_token(m, vocab_size)
    return {"schedule": schedule.name, "virtual": schedule.virtual, "microbatches": schedule.microbatches,
            "ticks": schedule.ticks,
            "bubble_fraction": schedule.bubble_fraction, "inputs_held_per_stage": schedule.input_slots,
            "grads_held_per_stage": schedule.grad_slots,
            # Each backward reruns its stage's forward from the saved input: HFU = MFU x this.
            "hardware_flops_factor": hardware_flops_per_token(m, vocab_size, schedule.rerun_factors) / model_flops}
