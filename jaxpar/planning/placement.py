"""`--dry-run`: where every tensor lives and what one device holds, computed without training.

Nothing is allocated: shapes are abstract and the step is compiled from ShapeDtypeStructs, the same
way `jaxpar.plan` compiles it for a target.
"""

import math

import jax

from jaxpar.core.axes import CONTEXT, PIPE, TENSOR, pipelined_layers
from jaxpar.core.config import Config, ModelConfig
from jaxpar.core.remat import DEFAULT, POLICIES
from jaxpar.core.sharding import split_ways
from jaxpar.data.loader import load_dataset
from jaxpar.models.decode import cache_bytes_per_token
from jaxpar.models.registry import family_of
from jaxpar.nn.layers import padded_vocab
from jaxpar.parallel import hlo
from jaxpar.parallel.mesh import axes_crossing_processes, build_mesh, mesh_shape
from jaxpar.parallel.zero import expected_bytes_per_device
from jaxpar.training.optimizers import registry as optimizers
from jaxpar.training.step.build import Built, build


def mib(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def activation_bytes(m: ModelConfig, vocab_size: int, rows_per_pass: int, tp: int,
                     layers: int | None = None, cp: int = 1) -> int:
    """Saved activations of one forward pass on one device: the family's `activation_units` per
    token and layer (for GPT-2, Korthikanti et al. (2022), eq. 2 with tensor parallelism,
    s*b*h*(10 + 24/t + 5*a*s/(h*t)) bytes per layer for 2-byte activations; eq. 4, 10/t for the
    first term, with sequence parallelism), scaled to the compute dtype, plus the float32 logits.
    Under a checkpointed model.remat policy (jaxpar.core.remat) a layer keeps the device bytes its
    registry entry declares (`full`: its float32 input alone; `full_offloaded`: nothing, its input
    is in host memory), and one layer's activations live while it reruns. `layers`: those this
    device runs (default: all). Context parallelism splits every activation along the sequence:
    1/cp of it (the ring's K/V blocks in flight aside)."""
    tokens = m.block_size * rows_per_pass
    layers = m.n_layer if layers is None else layers
    split = tp if m.sequence_parallel else 1  # eq. 4: LayerNorm, dropout and residual split too
    units = family_of(m).activation_units(tp, split)
    per_layer = tokens * POLICIES[DEFAULT].bytes_per_token(m, tp, split, units)  # what autodiff keeps
    policy = POLICIES[m.remat]
    saved = layers * tokens * policy.bytes_per_token(m, tp, split, units) + (per_layer if policy.checkpointed else 0)
    logits = tokens * padded_vocab(vocab_size) // tp * jax.numpy.dtype(m.logits_dtype).itemsize * 2  # and their gradient
    return int((saved + logits) / cp)


def activation_estimate(built: Built, rows_per_pass: int) -> dict[str, int]:
    """Activation bytes per device by part. A pipeline stage holds the stage inputs and output
    gradients its schedule's table keeps in flight, and one layer chunk's activations while a
    backward reruns it; without a pipeline, one pass's saved activations."""
    m, vocab, mesh, schedule = built.model.cfg, built.model.vocab_size, built.mesh, built.plan.schedule
    tp, pp = mesh.shape[TENSOR], mesh.shape[PIPE]
    if schedule is None:
        return {"activations (estimate)": activation_bytes(m, vocab, rows_per_pass, tp, cp=mesh.shape[CONTEXT])}
    held = schedule.input_slots + schedule.grad_slots
    split = tp if m.sequence_parallel else 1  # the buffers hold the stream's layout
    one = rows_per_pass * m.block_size * m.n_embd * 4 // split
    chunk = pipelined_layers(m) // (pp * schedule.virtual)
    rows = {f"stage buffers ({schedule.input_slots}+{schedule.grad_slots} held)": held * one,
            f"activations ({chunk}-layer chunk)": activation_bytes(m, vocab, rows_per_pass, tp, layers=chunk)}
    k, M = m.lead_layers, schedule.microbatches
    if k:  # ahead of the pipeline, kept for their backward until the round's last
        lead = activation_bytes(m, vocab, M * rows_per_pass, tp, layers=k) - activation_bytes(
            m, vocab, M * rows_per_pass, tp, layers=0)
        rows[f"activations ({k} dense first layer{'s' if k > 1 else ''} x {M} microbatches)"] = lead
    return rows


def execution_rows(execution) -> list[str]:
    """The execution plan, a line a decision (the rule table left out: the tensors show it)."""
    described = {k: v for k, v in execution.describe().items() if k not in ("rules", "mesh")}
    rows = [f"attention kernel: {described.pop('attention')}", "execution plan:"]
    return rows + [f"  {key}: {value}" for key, value in described.items()]


def tensor_rows(shapes: dict, plan, abstract_opt, opt_shardings) -> list[str]:
    """A row per param: its shape, where it and its optimizer state live, and the bytes one
    device holds of both (the state the optimizer really keeps for it)."""
    flat = jax.tree_util.tree_leaves_with_path(shapes)
    paths = [tuple(k.key for k in path) for path, _ in flat]
    state = optimizers.state_bytes_by_param(abstract_opt, opt_shardings, paths)
    rows = [f"{'tensor':28s} {'shape':>18s}  {'param spec':40s} {'moment spec':40s} {'bytes/device':>12s}"]
    for (path, shape), key, p_sh, m_sh in zip(flat, paths, jax.tree.leaves(plan.params),
                                              jax.tree.leaves(plan.moments)):
        per_device = 4 * math.prod(p_sh.shard_shape(shape.shape)) + state[key]
        rows.append(f"{jax.tree_util.keystr(path, simple=True, separator='.'):28s} "
                    f"{shape.shape!s:>18s}  {p_sh.spec!s:40s} {m_sh.spec!s:40s} {per_device:>12,d}")
    return rows


def compiled_rows(built: Built) -> list[str]:
    memory = hlo.memory_summary(built.compile_abstract())
    if not memory:
        return []
    peak = memory["peak_memory_bytes"]  # the figure jaxpar.plan reports
    host = memory.get("host_memory_bytes")  # offloaded state, where XLA counts it apart
    return ["", "compiled train step, per device (XLA memory_analysis):",
            f"  arguments {mib(memory['argument_bytes'])}, outputs {mib(memory['output_bytes'])} "
            f"(aliased with arguments: {mib(memory['alias_bytes'])}), temporaries {mib(memory['temp_bytes'])}",
            f"  peak per device: {mib(peak)} ({peak:,d} bytes)"] + (
                [f"  host memory (pinned_host) per device: {mib(host)}"] if host else [])


def dry_run(cfg: Config, devices=None) -> str:
    mesh = build_mesh(cfg, devices)
    built = build(cfg, mesh, load_dataset(cfg.data, cfg.model.block_size).tokenizer)
    model, execution, zero_plan, shardings = built.model, built.plan, built.zero, built.shardings
    with jax.set_mesh(mesh):
        shapes = model.shapes()
        abstract_opt = jax.eval_shape(built.tx.init, shapes)
        crossing = ", ".join(axes_crossing_processes(mesh)) or "none"
        rows = [f"mesh {mesh_shape(mesh)}, {zero_plan.describe()}; axes across processes: {crossing}",
                *execution_rows(execution), *([built.note] if built.note else []), "",
                *tensor_rows(shapes, zero_plan, abstract_opt, shardings.opt_state)]
        micro = execution.passes
        rows_per_pass = cfg.train.batch_size // micro // split_ways(mesh, "batch")
        estimate = {
            "params": expected_bytes_per_device(zero_plan.params, shapes),
            "gradients": expected_bytes_per_device(zero_plan.grads, shapes),
        }
        optimizer = {f"optimizer state ({cfg.optimizer.name}{', in host memory' if built.offload else ''})":
                     expected_bytes_per_device(shardings.opt_state, abstract_opt)}
        estimate = {**estimate, **({} if built.offload else optimizer), **activation_estimate(built, rows_per_pass)}
        passes = (f"rows a pass on each device: {rows_per_pass}, {micro} passes a step "
                  f"(train.micro_batch={execution.rows_per_pass})")
        heads, k_width, v_width = model.family.cache_widths()
        cache = (f"decoding cache: {cache_bytes_per_token(model):,} bytes a token ({cfg.model.n_layer} layers x "
                 f"{heads} x ({k_width} + {v_width}) in {cfg.model.dtype})")
        rows += ["", passes, cache, "", "peak memory per device, by part:"]
        rows += [f"  {name:30s} {mib(n):>14s}" for name, n in estimate.items()]
        rows.append(f"  {'total':30s} {mib(sum(estimate.values())):>14s}")
        if built.offload:  # not the device's
            rows += [f"  {name:30s} {mib(n):>14s}" for name, n in optimizer.items()]
        rows += compiled_rows(built)
    return "\n".join(rows)
