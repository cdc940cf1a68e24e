"""The kernels that the [model] keys name, one entry each: model.attention's (jaxpar.nn.kernels),
model.moe_gemm's and model.moe_dispatch's (jaxpar.nn.moe).

An entry says where its kernel runs, which `auto` picks on a platform, the heads, masks, dtypes and
sequence tiles it takes, and its one-line reasons: why a config that names it is refused (its
`refusals`), and why `auto` does not run it (its `notes`). The config's checks read the names and
the needs here (core cannot import nn), and nn's choosing code reads the same entries.
"""

from dataclasses import dataclass, field

from jaxpar.core.errors import UserError
from jaxpar.core.platform import GPUS

AUTO = "auto"  # every kernel key's default: the platform picks
XLA, SPLASH, CUDNN, TOKAMAX = "xla", "splash", "cudnn", "tokamax"  # model.attention's kernels
RAGGED_DOT, MEGABLOX, BLOCKS = "ragged_dot", "megablox", "blocks"  # model.moe_gemm's, and TOKAMAX
ALL_TO_ALL, RAGGED = "all_to_all", "ragged"  # model.moe_dispatch's
ATTENTION, MOE_GEMM, MOE_DISPATCH = "attention", "moe_gemm", "moe_dispatch"  # the [model] keys
CAUSAL, DOCUMENTS = "causal", "documents"  # the masks: causal, and within data.document_mask's documents
OTHERS = "*"  # in auto_on: every platform where `auto` picks no other kernel of the key
GPU_EXTRA = "pip install -e '.[gpu]'"  # what installs tokamax
SPLASH_TILE = 128  # splash's blocks of queries and keys are multiples of the TPU's 128 lanes
CUDNN_HEADS_HOPPER, CUDNN_HEADS_BEFORE = 256, 128  # jax's check: compute capability 9.0 and up, or below


@dataclass(frozen=True)
class Kernel:
    """One kernel that model.<key> names. Its refusals and notes are str.format templates, by
    reason, over the kernel (`kernel`) and the config's figures (`facts`); a reason it has no
    template of its own for takes the shared one (REFUSALS, NOTES)."""
    name: str
    key: str  # the [model] key that names it
    platforms: tuple[str, ...] = ()  # where a config may name it (the first is the one a refusal names); (): any
    auto_on: tuple[str, ...] = ()  # the platforms where `auto` picks it, before the config's needs are asked
    widest_head: int = 0  # the widest attention head it takes anywhere (0: any); a device may take fewer
    head_multiple: int = 1
    tile: int = 1  # it takes sequences, and a context ring's chunks, in multiples of this many tokens
    masks: tuple[str, ...] = (CAUSAL, DOCUMENTS)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    dropout: bool = True  # it drops attention probabilities out (model.dropout)
    ring: bool = True  # it runs a context ring's block pairs
    package: str = ""  # what it needs installed beyond jax
    stand_in: str = ""  # the kernel of the key that `auto` runs in its place (jaxpar.nn says where)
    refusals: dict[str, str] = field(default_factory=dict, hash=False)
    notes: dict[str, str] = field(default_factory=dict, hash=False)

    def takes_heads(self, head_dim: int, widest: int = 0) -> bool:
        """Whether it takes heads head_dim wide, where a device takes at most `widest` (0: its own widest)."""
        too_wide = self.widest_head and head_dim > (widest or self.widest_head)
        return not too_wide and head_dim % self.head_multiple == 0

    def needs(self, m, documents: bool = False, widest: int = 0, context: int = 1) -> dict[str, bool]:
        """Each need of it, by reason, in the order asked: whether model config m leaves it unmet.
        `documents`: data.document_mask, `widest`: the widest head here, `context`: the ring's size."""
        return {"dropout": m.dropout > 0 and not self.dropout,
                "documents": documents and DOCUMENTS not in self.masks,
                "heads": not self.takes_heads(m.head_size, widest),
                "dtype": m.dtype not in self.dtypes,
                "tile": m.block_size % self.tile != 0,
                "ring": context > 1 and not self.ring,
                "chunks": context > 1 and m.block_size // (2 * context) % self.tile != 0}

    def unmet(self, m, documents: bool = False, widest: int = 0, context: int = 1) -> str | None:
        """The first of its needs that model config m leaves unmet, as a reason, or None."""
        return next((reason for reason, unmet in self.needs(m, documents, widest, context).items() if unmet), None)

    def refused(self, reason: str, **facts) -> UserError:
        """The one-line error for a config that names it where it cannot run, for `reason`."""
        return UserError({**REFUSALS, **self.refusals}[reason].format(kernel=self, **facts))

    def note(self, reason: str, **facts) -> str:
        """Why `auto` does not run it, for `reason`, in words for its one-line note."""
        return {**NOTES, **self.notes}[reason].format(kernel=self, **facts)


def model_facts(m, context: int = 1) -> dict:
    """The figures of model config m (on a context ring of `context`) that the messages name."""
    return {"dropout": m.dropout, "block_size": m.block_size, "head": m.head_size, "dtype": m.dtype,
            "context": context, "chunk": m.block_size // (2 * context)}


NOTES = {  # attention's, after "model.attention=auto runs xla: "
    "dropout": "{kernel.name} has no attention dropout (model.dropout={dropout})",
    "tile": "{kernel.name}'s tiles are {kernel.tile} tokens (model.block_size={block_size})",
    "chunks": "the context ring's chunks are {chunk} tokens (block {block_size} / 2 cp={context}), not a multiple "
              "of {kernel.name}'s {kernel.tile}-token tiles"}
REFUSALS = {  # attention's
    "dropout": "model.attention={kernel.name} has no attention dropout, and model.dropout={dropout}; set "
               "--model.dropout=0, or --model.attention=auto (xla)",
    "tile": "model.attention={kernel.name} runs tiles of {kernel.tile} tokens, and model.block_size={block_size} is "
            "not a multiple; choose one, or --model.attention=auto",
    "chunks": "model.attention={kernel.name}: " + NOTES["chunks"] + "; use a block_size that is a multiple of "
              "{multiple}, or --model.attention=auto",
    "ring": "model.attention={kernel.name} runs no context ring; use --model.attention=auto",
    "package": "model.attention={kernel.name} needs {kernel.package}: " + GPU_EXTRA + "; use --model.attention=auto",
    "platform": "model.attention={kernel.name} needs {kernel.platforms[0]} devices, and this mesh is on {platform}; "
                "use --model.attention=auto"}

CUDNN_KERNEL = Kernel(
    CUDNN, ATTENTION, platforms=GPUS, auto_on=GPUS, widest_head=CUDNN_HEADS_HOPPER, head_multiple=8, masks=(CAUSAL,),
    dtypes=("bfloat16",), dropout=False, stand_in=TOKAMAX,
    refusals={
        "heads": "model.attention=cudnn takes heads up to {kernel.widest_head} dims (Hopper and later GPUs) in "
                 "multiples of {kernel.head_multiple}, and this model's are {head}; use --model.attention=auto "
                 "(tokamax's kernel on GPUs)",
        "heads here": "model.attention=cudnn takes heads up to {widest} dims here ({kernel.widest_head} where the "
                      "host's GPU is a Hopper), and this model's are {head}; use --model.attention=auto",
        "dtype": "model.attention=cudnn takes bfloat16 only; set --model.dtype=bfloat16, or --model.attention=auto",
        "documents": "model.attention=cudnn cannot keep data.document_mask's documents apart: jax's cuDNN attention "
                     "has no segment ids; use --model.attention=auto (tokamax's kernel on GPUs, where it is installed)"},
    notes={
        "documents": "jax's cuDNN attention has no segment ids for data.document_mask, and tokamax's kernel, which "
                     "has, {why_not_stand_in}",
        "heads": "cuDNN's fused attention takes heads up to {widest} dims here ({kernel.widest_head} where the host's "
                 "GPU is a Hopper), in multiples of {kernel.head_multiple} (this model's: {head}); tokamax's kernel "
                 "takes them, and took 1.9x xla's time at 192-dim heads on an H200",
        "dtype": "cuDNN's fused attention takes bfloat16 only (model.dtype={dtype})",
        # measured: one H200, jax 0.11.2, GPT-2 124M at batch 16 (docs/benchmarks.md)
        "xla's cost": "xla keeps every head's scores: GPT-2 124M's step took 1.47x the time and 2.2x the memory on "
                      "an H200",
        "stand-in": "model.attention=auto plans tokamax: cuDNN runs {head}-dim heads on these GPUs, but jax checks "
                    "that against this host's device; tokamax's flash attention stands in for its memory (on an "
                    "H200 it took 4.2x cuDNN's time)"})

ENTRIES = (
    Kernel(XLA, ATTENTION, auto_on=(OTHERS,)),
    # splash off TPU: in Pallas interpret mode (the tests)
    Kernel(SPLASH, ATTENTION, platforms=("tpu", "cpu"), auto_on=("tpu",), tile=SPLASH_TILE, dropout=False),
    CUDNN_KERNEL,
    # tokamax's flash attention off GPUs: its XLA reference (the tests)
    Kernel(TOKAMAX, ATTENTION, platforms=(*GPUS, "cpu"), dropout=False, ring=False, package="tokamax",
           notes={"ring": "runs no context ring", "package": "is not installed (" + GPU_EXTRA + ")"}),
    Kernel(RAGGED_DOT, MOE_GEMM),
    Kernel(MEGABLOX, MOE_GEMM, auto_on=("tpu",)),  # interpreted off TPU
    Kernel(BLOCKS, MOE_GEMM, auto_on=("cpu",)),
    Kernel(TOKAMAX, MOE_GEMM, platforms=GPUS, auto_on=(OTHERS,), package="tokamax", stand_in=RAGGED_DOT,
           refusals={"platform": "model.moe_gemm=tokamax needs tokamax on an NVIDIA GPU (it runs on NVIDIA GPUs "
                                 "only); or use --model.moe_gemm=auto",
                     "package": "model.moe_gemm=tokamax needs tokamax on an NVIDIA GPU (install it: " + GPU_EXTRA
                                + "); or use --model.moe_gemm=auto"},
           notes={"package": "model.moe_gemm=auto runs XLA's ragged_dot, a masked product over every expert (E "
                             "times the routed FLOPs): tokamax is not installed (" + GPU_EXTRA + ")"}),
    Kernel(ALL_TO_ALL, MOE_DISPATCH, auto_on=("cpu",)),  # XLA:CPU has no ragged-all-to-all
    Kernel(RAGGED, MOE_DISPATCH, auto_on=(OTHERS,)),
)
KERNELS = {key: {k.name: k for k in ENTRIES if k.key == key} for key in (ATTENTION, MOE_GEMM, MOE_DISPATCH)}


def names(key: str) -> tuple[str, ...]:
    """The values model.<key> takes: auto, then its kernels."""
    return (AUTO, *KERNELS[key])


def check_name(key: str, value: str) -> None:
    """Refuse a value of model.<key> that names none of its kernels."""
    if value not in names(key):
        raise UserError(f"model.{key} must be one of {', '.join(names(key))}, got '{value}'")


def chosen(key: str, value: str, platform: str) -> str:
    """model.<key> as it runs on `platform`: `value`, or what `auto` picks there (for a key whose
    kernels need nothing checked; model.moe_dispatch: ragged_all_to_all on TPU and GPU, as XLA:CPU
    has none; the plan's moe_mode says whether a dispatch runs at all)."""
    return value if value != AUTO else auto_kernel(key, platform).name


def auto_kernel(key: str, platform: str) -> Kernel:
    """The kernel that `auto` picks for model.<key> on `platform`, before the config's needs are asked."""
    kernels = KERNELS[key].values()
    return next((k for k in kernels if platform in k.auto_on), None) or next(k for k in kernels if OTHERS in k.auto_on)
