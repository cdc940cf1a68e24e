"""The device mesh's axes as data: one entry per parallelism, and the one rule table built from them.

Each entry names its `--mesh` key (`dp`), its mesh axis (`data`), its place in the device order,
the logical axes it splits, and its checks. The mesh, `--help`, `run.json`, `--dry-run`, the
planner, ZeRO and the rule table read this table; adding a parallelism is one more entry here,
plus the code that is truly new for it (its collective and its model-side op).

The rule table maps each logical axis to the mesh axes whose entries split it, ordered from the
most spread to the most local (`locality`): under context parallelism the tokens split over
('data', 'context'). A size-1 axis splits nothing, so every layout reads the same table.
"""

import math
from dataclasses import dataclass
from typing import ClassVar

from jaxpar.core.axis_costs import AxisCosts, ContextCosts, DataCosts, ExpertCosts, PipeCosts, TensorCosts
from jaxpar.core.errors import UserError

DATA, TENSOR, PIPE, CONTEXT, EXPERT = "data", "tensor", "pipe", "context", "expert"

# Logical axes that no mesh axis splits (the rule table maps them to None).
UNSPLIT = ("embed", "pos", "qkv", "gate_up", "head_dim", "microbatch", "routes", "latent",  # latent: MLA's
           "mtp_layers",  # DeepSeek's multi-token prediction modules
           "lead_layers")  # the dense first layers (jaxpar.models.lead): whole on every pipeline stage


@dataclass(frozen=True)
class Run:
    """What the axes' checks read of a run: its model, the sequences of a step's grad_accum round
    (train.batch_size / train.grad_accum), and pipeline.microbatches (0: chosen)."""
    model: object  # the [model] section (jaxpar.core.model_config.ModelConfig)
    rows: int
    microbatches: int = 0


@dataclass(frozen=True)
class MeshAxis:
    """One parallelism. `locality`: its place in the device order; a higher one is kept on fewer
    hosts (jax.make_mesh puts its last axis on the closest devices). `splits`: the logical axes it
    splits. `planned`: jaxpar.plan tries its sizes in `--layouts auto` (else only those of --KEY)."""
    key: str
    name: str
    locality: int
    splits: tuple[str, ...]
    about: str
    planned: bool = True
    costs: ClassVar[AxisCosts] = AxisCosts()  # the planner's cost terms (jaxpar.core.axis_costs)

    def logical_axes(self, sequence_parallel: bool) -> tuple[str, ...]:
        return self.splits

    def check(self, run: Run, size: int, sizes: dict[str, int]) -> None:
        """Refuse a run this axis cannot run at `size` (sizes: every axis's, by key)."""


class Data(MeshAxis):
    """Data parallelism: the batch split by rows. ZeRO shards the optimizer state, gradients and
    params over it."""
    costs = DataCosts()

    def check(self, run, size, sizes):
        micro_batch = run.rows
        if micro_batch % size:
            raise UserError(f"dp={size} does not divide the batch of {micro_batch} sequences per "
                            f"microbatch (train.batch_size / train.grad_accum); change one of them")


class Tensor(MeshAxis):
    """Megatron tensor parallelism: heads, the MLP's width and the vocabulary split; with
    sequence parallelism the residual stream's sequence too."""
    costs = TensorCosts()

    def logical_axes(self, sequence_parallel):
        return self.splits + (("stream_seq",) if sequence_parallel else ())

    def check(self, run, size, sizes, origin: str | None = None):
        """origin: where the model's shape comes from (a Hugging Face config.json), if not the config."""
        m = run.model
        for field, heads in (("n_head", m.n_head), ("n_kv_head", m.kv_heads)):
            if heads % size == 0:
                continue
            if origin is not None:
                raise UserError(f"tp={size} does not divide {field}={heads} of the model in {origin}; "
                                f"choose tp from the divisors of {heads}, and put the other devices on "
                                "dp (with --zero 3 to split the weights too)")
            if field == "n_head":
                raise UserError(f"tp={size} does not divide model.n_head={heads}; "
                                f"choose tp from the divisors of n_head")
            raise UserError(f"tp={size} does not divide model.n_kv_head={heads}: tensor parallelism "
                            f"splits the KV heads; use tp from the divisors of {heads} and put "
                            f"the other devices on dp (with --zero 3 to split the weights too)")
        if m.sequence_parallel and m.block_size % size:
            raise UserError(f"tp={size} does not divide model.block_size={m.block_size}, which "
                            f"sequence parallelism splits over it; choose a block size divisible by tp "
                            f"or pass --model.sequence_parallel=false")


class Pipe(MeshAxis):
    """Pipeline parallelism: the stacked layers split into stages (jaxpar.parallel.pipeline)."""
    costs = PipeCosts()

    def check(self, run, size, sizes):
        if size > 1:
            pipeline_microbatches(run, batch_ways(sizes), size)


class Context(MeshAxis):
    """Context parallelism: every activation's sequence split over the axis's devices, attention by
    the plan's context strategy (jaxpar.nn.context: the zigzag ring, or Ulysses' all-to-alls),
    which lays the batch out and checks what it needs."""
    costs = ContextCosts()

    def check(self, run, size, sizes):
        m, tp = run.model, sizes[TENSOR_AXIS.key]
        if size > 1 and m.sequence_parallel and m.block_size % (size * tp):
            raise UserError(f"sequence parallelism with cp={size} splits the stream over cp*tp={size * tp}; "
                            f"model.block_size={m.block_size} does not divide by it")


class Expert(MeshAxis):
    """Expert parallelism: a mixture of experts' experts split over devices (jaxpar.nn.moe),
    and everywhere else more data parallelism, the batch's rows split over (data, expert)."""
    costs = ExpertCosts()

    def check(self, run, size, sizes):
        if size == 1:
            return
        experts = run.model.n_experts
        if not experts:
            raise UserError(f"ep={size} splits a mixture of experts, and this model has none; set "
                            f"--model.n_experts (a llama-family model), or drop ep")
        if experts % size:
            raise UserError(f"ep={size} does not divide model.n_experts={experts}; choose ep from its divisors")
        micro_batch, rows = run.rows, batch_ways(sizes)
        if micro_batch % rows:
            raise UserError(f"dp x ep = {rows} does not divide the batch of {micro_batch} sequences per "
                            f"microbatch (train.batch_size / train.grad_accum); change one of them")


DATA_AXIS = Data("dp", DATA, 0, ("batch", "tokens"), "data parallelism: the batch split by rows")
TENSOR_AXIS = Tensor("tp", TENSOR, 4, ("vocab", "heads", "kv_heads", "mlp"),
                     "tensor parallelism: heads, MLP width and vocabulary split (Megatron)")
PIPE_AXIS = Pipe("pp", PIPE, 1, ("layers", "sparse_layers", "dense_layers"),
                 "pipeline parallelism: the layers split into stages")
CONTEXT_AXIS = Context("cp", CONTEXT, 3, ("seq", "stream_seq", "tokens"),
                       "context parallelism: the sequence split over a ring", planned=False)
EXPERT_AXIS = Expert("ep", EXPERT, 2, ("batch", "tokens", "experts"),
                     "expert parallelism: a mixture's experts split, the batch too", planned=False)
# In the mesh's axis order (new axes go last); `locality` gives the device order.
AXES: tuple[MeshAxis, ...] = (DATA_AXIS, TENSOR_AXIS, PIPE_AXIS, CONTEXT_AXIS, EXPERT_AXIS)
BY_KEY = {a.key: a for a in AXES}
BY_NAME = {a.name: a for a in AXES}
KEYS = tuple(a.key for a in AXES)
NAMES = tuple(a.name for a in AXES)


def rule_table(sequence_parallel: bool = False) -> dict[str, str | tuple | None]:
    """Logical axis -> the mesh axes that split it (None: none; one name; or a tuple, most spread
    first). `sequence_parallel` adds the stream's sequence to 'tensor' (Megatron's SP)."""
    split_by: dict[str, list[MeshAxis]] = {name: [] for name in UNSPLIT}
    for axis in AXES:
        for logical in axis.logical_axes(sequence_parallel):
            split_by.setdefault(logical, []).append(axis)
    table = {}
    for logical, axes in split_by.items():
        names = tuple(a.name for a in sorted(axes, key=lambda a: a.locality))
        table[logical] = None if not names else names[0] if len(names) == 1 else names
    return table


def splitting(*logical: str) -> tuple[str, ...]:
    """The mesh axes that split any of these logical axes: ("batch", "seq") gives those an
    inference command computes each sample whole on (data, context, expert)."""
    return tuple(a.name for a in AXES if set(logical) & set(a.splits))


def sizes_of(mesh_cfg) -> dict[str, int]:
    """{'dp': .., 'tp': .., ...} of a MeshConfig (-1 where an axis is inferred)."""
    return {key: getattr(mesh_cfg, key) for key in KEYS}


def batch_ways(sizes: dict[str, int]) -> int:
    """How many ways a batch's rows are split: the product of the axes that split 'batch'."""
    return math.prod(sizes[a.key] for a in AXES if "batch" in a.splits)


def check_axes(run: Run, sizes: dict[str, int]) -> None:
    """Every axis's checks, at the sizes of a resolved mesh."""
    for axis in AXES:
        axis.check(run, sizes[axis.key], sizes)


def check_chunks(m, pp: int, virtual: int) -> None:
    """A pipeline schedule's pp x `virtual` layer chunks: each the same number of layers, and every
    stage runs one program on its chunks, so where layers with experts and dense ones mix, each
    chunk must have them in the same places (the dense first ones run ahead)."""
    n_layer = pipelined_layers(m)
    if n_layer % (pp * virtual):
        layers = (f"model.n_layer={n_layer}" if n_layer == m.n_layer else
                  f"the {n_layer} layers after the {m.lead_layers} dense first ones (which run ahead)")
        raise UserError(f"pp={pp} x {virtual} layer chunks a stage (pipeline.virtual, or the schedule's own) do "
                        f"not divide {layers}; every chunk needs the same number of layers")
    chunk, sparse = n_layer // (pp * virtual), m.sparse_layers[m.lead_layers:]
    if any(sparse[i] != sparse[i % chunk] for i in range(len(sparse))):
        raise UserError(f"pp={pp} x pipeline.virtual={virtual} chunks of {chunk} layers differ in which layers "
                        f"have experts (model.moe_every={m.moe_every}, model.dense_layers='{m.dense_layers}'), "
                        f"and every stage runs one program; choose a pattern that repeats every {chunk} layers, "
                        "or another pp")


def pipelined_layers(m) -> int:
    """The layers a pipeline's stages split: all but the dense first ones (jaxpar.models.lead)."""
    return m.n_layer - m.lead_layers


def layers_per_stage(m, stages: int) -> int:
    """The layers a pipeline stage runs: its share, and the dense first ones ahead of the pipeline."""
    return m.n_layer if stages == 1 else pipelined_layers(m) // stages + m.lead_layers


def pipeline_microbatches(run: Run, dp: int, pp: int) -> int:
    """The pipeline's microbatch count M for this config and mesh, after checking that the stages
    split the layers and the microbatches the rows; dp: the ways the rows split (batch_ways). The
    schedule checks the rest (jaxpar.parallel.schedules)."""
    m, rows = run.model, run.rows
    n_layer = pipelined_layers(m)
    layers = (f"model.n_layer={n_layer}" if n_layer == m.n_layer else
              f"the {n_layer} layers after the {m.lead_layers} dense first ones (which run ahead)")
    if n_layer % pp:
        raise UserError(f"pp={pp} does not divide {layers}; every stage needs the same number of layers")
    M = run.microbatches
    if M == 0:  # the largest multiple of pp up to 4*pp that splits the batch evenly over dp
        M = next((m for m in range(4 * pp, 0, -pp) if rows % (m * dp) == 0), 0)
        if M == 0:
            raise UserError(f"cannot split {rows} sequences per step into dp={dp} x M microbatches "
                            f"with M a multiple of pp={pp}; set --pipeline.microbatches=M or "
                            f"change train.batch_size")
    if rows % (M * dp):
        raise UserError(f"train.batch_size / train.grad_accum = {rows} sequences do not split into "
                        f"dp={dp} x {M} microbatches; change pipeline.microbatches or train.batch_size")
    return M
