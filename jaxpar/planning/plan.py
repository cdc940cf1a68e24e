"""`python -m jaxpar.plan`: compile the real train step for every layout of a target you may not
have (a TPU pod slice, or N host devices), and rank the layouts by estimated speed among those
that fit.

Each layout (dp, tp, pp, ZeRO stage, micro-batch, remat) is checked as `jaxpar.train` checks it,
guessed cheaply, and the most promising are compiled from ShapeDtypeStructs: XLA's own memory
figure decides whether it fits, and its HLO gives the step-time estimate, a roofline of its ops and
collectives (jaxpar.planning.roofline): an upper bound on speed. Writes plan.md, plan.json and plan.png, and prints the train command to run.
"""

import copy
import dataclasses
import itertools
import math
import re

from jaxpar.core.axes import AXES, CONTEXT_AXIS, DATA_AXIS, KEYS, PIPE_AXIS, TENSOR_AXIS, batch_ways
from jaxpar.core.config import MICRO_BATCH_AUTO, Config, TrainConfig, load_config, validate
from jaxpar.core.errors import UserError
from jaxpar.models.flops import NO_PIPELINE
from jaxpar.nn.context import on_mesh
from jaxpar.nn.recipes import recipe_for
from jaxpar.parallel.mesh import resolve_mesh_shape
from jaxpar.planning.layouts import int_list, parse_layouts

DEFAULT_MAX_COMPILES = 32
# Today's two: every policy doubles the compiles, and `none` and `full` bracket the memory; `auto`
# tries them all.
DEFAULT_REMATS = ("none", "full")

# XLA:TPU's refusal: "... required for HLO temporaries (22.24G) exceeds available HBM (15.75G)".
OUT_OF_HBM = re.compile(r"\(([\d.]+)G\) exceeds available HBM")


@dataclasses.dataclass
class Candidate:
    layout: dict  # dp, tp, pp, zero, micro_batch, remat, offload
    cfg: Config
    status: str = "pending"  # skipped | not compiled | error | out of memory | compiled
    reason: str = ""  # why skipped, or the compile error's first line
    guess: dict = dataclasses.field(default_factory=dict)  # the cheap estimate that ordered compiles
    compiled: dict = dataclasses.field(default_factory=dict)  # memory, collectives, estimate
    fits: bool | None = None

    def mesh_spec(self) -> str:
        """The axes the planner searches always; the others where the layout uses them."""
        return ",".join(f"{a.key}={self.layout[a.key]}" for a in AXES
                        if a.planned or self.layout.get(a.key, 1) > 1)


def micro_batch_options(t: TrainConfig, dp: int, pp: int, asked: str) -> list[int]:
    """train.micro_batch values that give distinct rows per pass (one value when pp > 1, where the
    pipeline's microbatches set the rows instead)."""
    rows = t.batch_size // t.grad_accum // max(dp, 1)
    if pp > 1 or rows < 1:  # train.micro_batch=auto is no limit under a pipeline too (training.micro_batch)
        return [0 if t.micro_batch == MICRO_BATCH_AUTO else t.micro_batch]
    if asked != "auto":
        return int_list(asked, "--micro-batch")
    options, k = [], 1
    while k < rows:
        options.append(k)
        k *= 2
    return options + [rows]


def layout_config(cfg: Config, layout: dict) -> Config:
    c = copy.deepcopy(cfg)
    for axis in AXES:
        setattr(c.mesh, axis.key, layout.get(axis.key, 1))
    c.train.zero, c.train.micro_batch, c.model.remat = layout["zero"], layout["micro_batch"], layout["remat"]
    c.train.offload = layout.get("offload", "none")
    c.model.fp8 = layout.get("fp8", c.model.fp8)
    c.model.context_strategy = layout.get("context", c.model.context_strategy)
    return c


def context_choices(sizes: dict) -> list[str | None]:
    """The context strategies a layout tries: every registered one where cp splits the sequence
    (None: the config's own, where it does not)."""
    from jaxpar.nn.context import STRATEGIES
    return list(STRATEGIES) if sizes.get(CONTEXT_AXIS.key, 1) > 1 else [None]


def enumerate_candidates(cfg: Config, devices: int, layouts: str = "auto", zeros=(0, 1, 2, 3),
                         micro: str = "auto", remats=DEFAULT_REMATS, fixed: dict | None = None,
                         offloads=("none",), fp8s=(), platform: str = "cpu", chip: str = "") -> list[Candidate]:
    """Every layout asked for, with each recompute policy, offload and model.fp8 (`fp8s`; none
    given: the config's); those the trainer would refuse on `platform`'s `chip` (a device kind)
    are 'skipped' with its reason."""
    found = []
    for sizes in parse_layouts(layouts, devices, fixed):
        for zero, offload, fp8 in itertools.product(zeros, offloads, fp8s or [cfg.model.fp8]):
            for micro_batch in micro_batch_options(cfg.train, batch_ways(sizes), sizes[PIPE_AXIS.key], micro):
                for remat, strategy in itertools.product(remats, context_choices(sizes)):
                    layout = {**sizes, "zero": zero, "micro_batch": micro_batch, "remat": remat, "offload": offload,
                              "fp8": fp8}
                    layout |= {"context": strategy} if strategy else {}
                    c = Candidate(layout, layout_config(cfg, layout))
                    c.reason = trainer_refusal(c, devices, platform, chip)
                    c.status = "skipped" if c.reason else c.status
                    found.append(c)
    return found


def trainer_refusal(c: Candidate, devices: int, platform: str, chip: str) -> str:
    """Why the trainer would refuse c ('' where it runs): its config, its mesh on `devices`, its
    matmul recipe on `platform`'s `chip` (jaxpar.nn.recipes.recipe_for, as plan_execution asks)."""
    try:
        validate(c.cfg)
        shape = resolve_mesh_shape(c.cfg, devices)
        on_mesh(c.cfg.model, shape[CONTEXT_AXIS.key], shape[TENSOR_AXIS.key])
        if c.layout[DATA_AXIS.key] == 1 and c.layout["zero"] > 0:
            raise UserError("with dp=1 every ZeRO stage is the same program as zero 0")
        recipe_for(c.cfg.model, platform, chip)
    except UserError as why:
        return str(why)
    return ""


def guess(c: Candidate, vocab: int, n_params: int, chip, expert_params: int = 0) -> dict:
    from jaxpar.core.axes import pipeline_microbatches
    from jaxpar.core.strategies import passes_within
    from jaxpar.parallel.schedules import make_schedule
    from jaxpar.planning import estimate
    cfg, lay = c.cfg, c.layout
    dp, pp = batch_ways(lay), lay[PIPE_AXIS.key]  # dp: the ways the rows split
    if pp > 1:
        M = pipeline_microbatches(cfg.run, dp, pp)
        schedule = make_schedule(cfg.pipeline.schedule, pp, M, cfg.pipeline.virtual)
        passes, in_flight, bubble = cfg.train.grad_accum * M, schedule.input_slots, schedule.bubble_fraction
        reruns, virtual = schedule.rerun_factors, schedule.virtual
    else:
        passes, in_flight, bubble, reruns, virtual = passes_within(cfg.train, dp), 1, 0.0, NO_PIPELINE, 1
    m, t = cfg.model, cfg.train
    rows = t.batch_size // passes // dp
    ops = estimate.guess_collectives(m, t.grad_accum, virtual, n_params, lay, passes, rows, expert_params)
    comm_s = estimate.collective_seconds(ops, chip, estimate.devices_of(lay))
    state = estimate.optimizer_state_bytes(cfg.optimizer.name, n_params, lay, expert_params)
    host = estimate.host_transfer_bytes(m, t.batch_size, lay, state)
    time = estimate.step_time(m, t.batch_size, vocab, lay, chip, comm_s, bubble, host, reruns)
    memory = estimate.guess_memory(m, cfg.optimizer.name, vocab, n_params, lay, rows, in_flight, expert_params)
    return {"memory_bytes": memory, "rows_per_pass": rows, **time}


def compile_candidate(c: Candidate, vocab: int, devices: list, chip, eot_id: int | None = None) -> None:
    """Compile c's train step for `devices` and fill in c.compiled and c.fits; an error is kept.
    `eot_id`: the documents' token under data.document_mask (jaxpar.training.step.build)."""
    from jaxpar.parallel import hlo, pipeline
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.planning import estimate, roofline
    from jaxpar.planning.gemms import gemm_dtypes
    from jaxpar.training.step.build import build
    try:
        built = build(c.cfg, build_mesh(c.cfg, devices), vocab=vocab, eot_id=eot_id)
        compiled = built.compile_abstract()
        text = compiled.as_text()
        ops = hlo.collective_ops(text)
        summary = {**hlo.memory_summary(compiled), "collectives": hlo.totals(ops)}
        bubble = pipeline.summary(built.model)["bubble_fraction"]
        factor = estimate.dispatch_rows_factor(c.cfg.model, built.plan.moe_mode, c.layout.get("ep", 1))
    except Exception as error:  # a layout XLA cannot compile is listed, not fatal
        c.reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        needs = OUT_OF_HBM.search(c.reason)  # the TPU compiler refuses a step that cannot fit
        c.status, c.fits = ("out of memory", False) if needs else ("error", None)
        if needs:
            c.compiled = {"needs_bytes": float(needs.group(1)) * 2**30}
        return
    roof = roofline.estimate(text, chip, len(devices), routed_share=1 / factor)
    attention = built.plan.describe()["attention"]
    schedule = built.plan.schedule
    step = estimate.compiled_step_time(c.cfg.model, c.cfg.train.batch_size, vocab, c.layout, chip, roof, bubble, c.guess.get("host_bytes", 0.0),
                                       schedule.rerun_factors if schedule is not None else NO_PIPELINE)
    c.compiled = {**summary, "attention": attention, "collective_ops": ops, "dispatch_rows_factor": factor,
                  "gemms": gemm_dtypes(text), **step,
                  "hlo_over_model": step["hlo_flops_per_chip"] / step["model_flops_per_chip"]}
    c.fits = summary["peak_memory_bytes"] <= chip.hbm_bytes
    c.status = "compiled"


def compile_order(candidates: list[Candidate], capacity: float) -> list[Candidate]:
    """Valid layouts, most promising first: those guessed to fit by guessed speed, then the rest
    by guessed memory. Meshes take turns (each one's best, then each one's second, ...), so a
    compile cap still sees every mesh rather than one mesh's ZeRO and micro-batch variants."""
    valid = [c for c in candidates if c.status == "pending"]
    fit = sorted((c for c in valid if c.guess["memory_bytes"] <= capacity),
                 key=lambda c: -c.guess["tokens_per_s"])
    rest = sorted((c for c in valid if c.guess["memory_bytes"] > capacity),
                  key=lambda c: c.guess["memory_bytes"])
    return take_turns(fit) + take_turns(rest)


def take_turns(ordered: list[Candidate]) -> list[Candidate]:
    """Round-robin over meshes, keeping each mesh's own order and the meshes' first-seen order."""
    by_mesh: dict[str, list] = {}
    for c in ordered:
        by_mesh.setdefault(c.mesh_spec(), []).append(c)
    queues = list(by_mesh.values())
    return [q[i] for i in range(max(map(len, queues), default=0)) for q in queues if i < len(q)]


def train_command(config: str | None, overrides: dict, c: Candidate) -> str:
    """The `jaxpar.train` command line that runs layout c."""
    set_here = {f"mesh.{key}" for key in KEYS} | {"train.zero", "train.micro_batch", "model.remat", "train.offload",
                                                  "model.context_strategy", "model.fp8"}
    parts = ["python -m jaxpar.train"] + ([f"--config {config}"] if config else [])
    parts += [f"--{k}={v}" for k, v in overrides.items() if k not in set_here]
    lay = c.layout
    parts += [f"--mesh {c.mesh_spec()}", f"--zero {lay['zero']}"]
    if lay[PIPE_AXIS.key] == 1:
        parts.append(f"--train.micro_batch={lay['micro_batch']}")
    if lay["remat"] != "none":
        parts.append(f"--model.remat={lay['remat']}")
    if lay.get("offload", "none") != "none":
        parts.append(f"--train.offload={lay['offload']}")
    if "context" in lay:
        parts.append(f"--model.context_strategy={lay['context']}")
    fp8 = lay.get("fp8", "none")
    if fp8 != "none" or "model.fp8" in overrides or (config and load_config(config, {}).model.fp8 != "none"):
        parts.append(f"--model.fp8={fp8}")  # none too, where the config or an override would say otherwise
    return " ".join(parts)


def plan(cfg: Config, target, args, overrides: dict, devices: list) -> list[Candidate]:
    """Every candidate layout, ranked and compiled as far as --max-compiles allows, for the
    target's `devices`; the report in args.out (which the caller holds locked)."""
    from tqdm import tqdm

    from jaxpar.data.loader import load_dataset, model_ids
    from jaxpar.models.transformer import build_model
    from jaxpar.nn.params import in_order
    from jaxpar.planning.hardware import chip_for
    from jaxpar.planning.plan_report import write_report
    tokenizer = load_dataset(cfg.data, cfg.model.block_size).tokenizer
    vocab, eot_id = model_ids(cfg, tokenizer)  # a bad vocabulary or document_mask fails before any compile
    chip = chip_for(target, devices, cfg.model.dtype)
    declared = [param for _, param in in_order(build_model(cfg, vocab).declared)]
    n_params = sum(math.prod(param.shape) for param in declared)
    expert_params = sum(math.prod(param.shape) for param in declared if "experts" in param.axes)
    candidates = enumerate_candidates(cfg, target.chips, args.layouts, args.zero, args.micro_batch,
                                      args.remat, args.fixed, args.offload, args.fp8, target.platform,
                                      getattr(devices[0], "device_kind", ""))
    for c in candidates:
        if c.status == "pending":
            c.guess = guess(c, vocab, n_params, chip, expert_params)
    order = compile_order(candidates, chip.hbm_bytes)
    for c in order[args.max_compiles:]:
        c.status, c.reason = "not compiled", f"past --max-compiles {args.max_compiles}"
    for c in tqdm(order[: args.max_compiles], desc=f"compiling for {target.name}", unit="layout",
                  dynamic_ncols=True):
        compile_candidate(c, vocab, devices, chip, eot_id)
    command = lambda c: train_command(args.config, overrides, c)
    write_report(args.out, target, chip, cfg, candidates, command, args.top)
    return candidates
