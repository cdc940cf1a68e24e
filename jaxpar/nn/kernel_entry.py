"""What a registry entry of a kernel is (`Kernel`), the names it is filed under, and the helpers
that ask a [model] key's entries, given to them.

Each kernel's entry is defined by the module that implements it: model.attention's in
jaxpar.nn.kernels, model.moe_gemm's in jaxpar.nn.grouped_gemm, model.moe_dispatch's in
jaxpar.nn.moe; each key's entries are a registry (`by_name`, jaxpar.core.registry), which the
config's checks ask as it loads. An entry says where its kernel runs, which `auto` picks on a
platform, the heads, masks, dtypes and sequence tiles it takes, and its one-line reasons: why a
config that names it is refused (its `refusals`), and why `auto` does not run it (its `notes`).
"""

from collections.abc import Callable
from dataclasses import dataclass, field

from jaxpar.core.errors import UserError
from jaxpar.core.model_config import AUTO
from jaxpar.core.registry import Registry

XLA, SPLASH, CUDNN, TOKAMAX = "xla", "splash", "cudnn", "tokamax"  # model.attention's kernels
RAGGED_DOT, MEGABLOX, BLOCKS = "ragged_dot", "megablox", "blocks"  # model.moe_gemm's, and TOKAMAX
ALL_TO_ALL, RAGGED = "all_to_all", "ragged"  # model.moe_dispatch's
ATTENTION, MOE_GEMM, MOE_DISPATCH = "attention", "moe_gemm", "moe_dispatch"  # the [model] keys
CAUSAL, DOCUMENTS = "causal", "documents"  # the masks: causal, and within data.document_mask's documents
OTHERS = "*"  # in auto_on: every platform where `auto` picks no other kernel of the key
GPU_EXTRA = "pip install -e '.[gpu]'"  # what installs tokamax


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


def by_name(*entries: Kernel, needs: Callable | None = None) -> Registry:
    """One [model] key's registry: its entries by name, in the order its values are listed after
    `auto`; `needs(cfg)`: what the config alone rules out for the kernel it names."""
    return Registry(f"model.{entries[0].key}", {kernel.name: kernel for kernel in entries}, also=(AUTO,),
                    needs=needs)


def auto_kernel(kernels: Registry, platform: str) -> Kernel:
    """The kernel of `kernels` that `auto` picks on `platform`, before the config's needs are asked."""
    entries = kernels.values()
    return next((k for k in entries if platform in k.auto_on), None) or next(k for k in entries if OTHERS in k.auto_on)


def chosen(kernels: Registry, value: str, platform: str) -> str:
    """The key's `value` as it runs on `platform`: itself, or what `auto` picks there among
    `kernels` (for a key whose kernels need nothing checked); its names are checked as the config
    loads."""
    return value if value != AUTO else auto_kernel(kernels, platform).name
