"""One table per Hugging Face model family, from which its readers (HF -> jaxpar, lazy views of the
memory-mapped files) and its writer (jaxpar -> HF, what save_pretrained writes) are both derived,
each entry's transform run one way by the writer and undone by the readers. Used by each
family's Hugging Face adapter (models/gpt2/hf.py, models/llama/hf.py and hf_moe.py,
models/deepseek/hf.py) and by models/hf.py, which picks the family.

A `Weight` names the HF tensors of one jaxpar param, as templates over the layer {i} and the
expert {e}. One layer's param is cut into pieces, each one HF tensor: per expert where the param
has an 'experts' axis (HF saves each expert's tensors), and per name where a Weight names several
(k_proj and v_proj, gate and up: stacked on the param's fused axis, jaxpar.nn.params.FUSED).
A piece's dims are grouped into HF's (`groups`: GPT-2's c_attn is (embed, 3 * heads * head_dim)),
and a matrix that HF stores the other way round to jaxpar's kernel is transposed.
"""

from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from jaxpar.core.config import ModelConfig
from jaxpar.formats.hf_files import Stacked, find_tensor, slice_reader
from jaxpar.nn.params import FUSED, LEAD, MATRIX


@dataclass(frozen=True)
class Weight:
    """Where a jaxpar param lives in HF's files: the tensor `hf` (several: the parts of jaxpar's
    fused axis, in order), each one piece of it; `groups`: how many of the piece's dims make each
    of the tensor's (None: one each)."""
    hf: str | tuple[str, ...]
    groups: tuple[int, ...] | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.hf,) if isinstance(self.hf, str) else self.hf


@dataclass(frozen=True)
class Transform:
    """A piece of jaxpar's `shape` as its HF tensor (to_hf: its dims grouped, then transposed where
    HF stores the matrix the other way round), and the tensor as the piece (to_jaxpar: undone)."""
    shape: tuple[int, ...]
    groups: tuple[int, ...]
    transpose: bool

    @property
    def grouped(self) -> tuple[int, ...]:
        ends = np.cumsum(self.groups)
        return tuple(int(np.prod(self.shape[end - size:end])) for size, end in zip(self.groups, ends))

    @property
    def merges(self) -> bool:
        return len(self.groups) != len(self.shape)

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return self.grouped[::-1] if self.transpose else self.grouped

    def to_jaxpar(self, tensor):
        """A view: nothing is read until it is indexed (no reshape where none is needed)."""
        view = tensor.T if self.transpose else tensor
        return view.reshape(self.shape) if self.merges else view

    def to_hf(self, piece: np.ndarray) -> np.ndarray:
        array = piece.reshape(self.grouped) if self.merges else piece
        return array.T if self.transpose else array


BLOCKS = ("blocks", LEAD)  # the stacked layers' params (LEAD: the dense first ones, jaxpar.models.lead)


@dataclass(frozen=True)
class Mapping:
    """A family's table: the params under 'blocks' (names after the `layer` prefix) and the rest.
    `out_first`: HF stores its matrices (out, in), as torch's Linear does, not (in, out) as
    GPT-2's Conv1D and jaxpar's kernels do; a param jaxpar declares `transposed` is stored out first."""
    layer: str
    blocks: dict[tuple[str, ...], Weight]
    top: dict[tuple[str, ...], Weight]
    out_first: bool

    def weight(self, key: tuple) -> Weight:
        return self.blocks[key[1:]] if key[0] in BLOCKS else self.top[key]

    def names(self, key: tuple, prefix: str, i: int | None, e: int | None) -> list[str]:
        layer = self.layer if key[0] in BLOCKS else ""
        return [(prefix + layer + name).format(i=i, e=e) for name in self.weight(key).names]

    def transform(self, key: tuple, param, shape: tuple) -> Transform:
        """The Transform of a piece of `shape` of the param at `key`."""
        transpose = param.role == MATRIX and param.transposed != self.out_first
        return Transform(shape, self.weight(key).groups or (1,) * len(shape), transpose)

    def view(self, tensors: dict, key: tuple, param, shape: tuple, path: Path, prefix: str,
             i: int | None = None, e: int | None = None):
        """One layer's (or one expert's, or a top param's) jaxpar array of `shape`, as a lazy view
        of its HF tensors, each checked."""
        axes = param.axes[len(param.shape) - len(shape):]
        if axes[0] == "experts":
            return Stacked([self.view(tensors, key, param, shape[1:], path, prefix, i, expert)
                            for expert in range(shape[0])], axis=0)
        names = self.names(key, prefix, i, e)
        axis = fused_axis(axes) if len(names) > 1 else None
        transform = self.transform(key, param, shape if axis is None else shape[:axis] + shape[axis + 1:])
        views = [transform.to_jaxpar(find_tensor(tensors, name, transform.hf_shape, path)) for name in names]
        return views[0] if axis is None else Stacked(views, axis)

    def reader(self, tensors: dict, key: tuple, param, m: ModelConfig, vocab_size: int, path: Path, prefix: str = ""):
        """make_array_from_callback's reader of the param at `key` (a jaxpar.nn.params.Param),
        its tensors checked; an embedding's padding rows past `vocab_size` read as zeros."""
        if key[0] in BLOCKS:
            return slice_reader([self.view(tensors, key, param, param.shape[1:], path, prefix, i)
                                 for i in m.layers_in(param.axes[0])], True)  # the layers of its stack
        rows = vocab_size if "vocab" in param.axes else None
        shape = param.shape if rows is None else (rows,) + param.shape[1:]
        return slice_reader([self.view(tensors, key, param, shape, path, prefix)], False, rows)

    def readers(self, tensors: dict, m: ModelConfig, vocab_size: int, declared: dict, path: Path,
                prefix: str = "") -> dict:
        """{param path: its reader} for every declared param, in order (the first fault is named)."""
        return {key: self.reader(tensors, key, param, m, vocab_size, path, prefix) for key, param in declared.items()}

    def hf_tensors(self, key: tuple, param, array: np.ndarray, dtype, prefix: str = "",
                   i: int | None = None, e: int | None = None) -> dict[str, np.ndarray]:
        """One layer's (or one expert's, or a top param's) jaxpar array as its HF tensors, in `dtype`
        and C order as safetensors stores them."""
        axes = param.axes[len(param.shape) - array.ndim:]
        if axes[0] == "experts":
            return {name: tensor for expert in range(array.shape[0])
                    for name, tensor in self.hf_tensors(key, param, array[expert], dtype, prefix, i, expert).items()}
        names = self.names(key, prefix, i, e)
        pieces = [array] if len(names) == 1 else list(np.moveaxis(array, fused_axis(axes), 0))
        transform = self.transform(key, param, pieces[0].shape)
        return {name: np.ascontiguousarray(transform.to_hf(piece), dtype) for name, piece in zip(names, pieces)}

    def state_dict(self, params: dict, declared: dict, m: ModelConfig, vocab_size: int, dtype=np.float32,
                   prefix: str = "") -> dict[str, np.ndarray]:
        """Every param as its HF tensors (param by param, layer by layer), an embedding's padding
        rows removed."""
        out = {}
        for key, array in host_arrays(params):
            param = declared[key]
            if key[0] in BLOCKS:
                for at, i in enumerate(m.layers_in(param.axes[0])):
                    out |= self.hf_tensors(key, param, array[at], dtype, prefix, i)
            else:
                out |= self.hf_tensors(key, param, array[:vocab_size] if "vocab" in param.axes else array,
                                       dtype, prefix)
        return out


def fused_axis(axes: tuple) -> int:
    """Where a piece's parts (q, k, v or gate, up) are stacked."""
    return next(d for d, axis in enumerate(axes) if axis in FUSED)


def host_arrays(params: dict):
    """(param path, its float32 values on the host) in the params' flattening order, one at a
    time: a param's copy is dropped once its tensors are made."""
    for path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        yield tuple(k.key for k in path), np.asarray(jax.device_get(array), np.float32)
