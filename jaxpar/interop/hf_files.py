"""Reading a Hugging Face model directory: config.json, and the weights in model.safetensors or in
the shards that model.safetensors.index.json names, every tensor memory-mapped so that a device
reads only its own slice. Writing: one file, or shards with an index above a size, as
save_pretrained does. Every problem is a UserError of one line.
"""

import json
from pathlib import Path

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.interop.safetensors_mmap import open_safetensors
from jaxpar.models.layers import padded_vocab

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"


def config_path(hf_dir) -> Path:
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise UserError(f"Hugging Face checkpoint directory '{hf_dir}' not found; pass a directory "
                        f"with {CONFIG_FILE} and {WEIGHTS_FILE} (as save_pretrained writes)")
    if not (hf_dir / CONFIG_FILE).is_file():
        raise UserError(f"'{hf_dir}' has no {CONFIG_FILE}; pass a directory written by save_pretrained")
    return hf_dir / CONFIG_FILE


def weight_files(hf_dir) -> list[Path]:
    """model.safetensors, or every shard the index names; a missing one is named."""
    hf_dir = Path(hf_dir)
    if (hf_dir / WEIGHTS_FILE).is_file():
        return [hf_dir / WEIGHTS_FILE]
    if (hf_dir / INDEX_FILE).is_file():
        index = read_json(hf_dir / INDEX_FILE)
        shards = sorted(set((index.get("weight_map") or {}).values()))
        missing = [name for name in shards if not (hf_dir / name).is_file()]
        if not shards or missing:
            raise UserError(f"'{hf_dir / INDEX_FILE}' names the shard {missing[0] if missing else '(none)'}, "
                            "which is not in the directory; copy every shard the index lists")
        return [hf_dir / name for name in shards]
    other = next((p.name for p in hf_dir.glob("*.bin")), None)
    fix = (f"it has {other}: save it again with save_pretrained(dir), which writes safetensors" if other
           else "pass a directory written by save_pretrained")
    raise UserError(f"'{hf_dir}' has no {WEIGHTS_FILE} or {INDEX_FILE}; {fix}")


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"'{path}' is not valid JSON ({e}); pass a directory written by "
                        "save_pretrained") from None
    if not isinstance(data, dict):
        raise UserError(f"'{path}' is not a JSON object; pass a directory written by save_pretrained")
    return data


def read_hf_config(hf_dir) -> dict:
    path = config_path(hf_dir)
    weight_files(hf_dir)  # the weights are checked for before anything is built
    return read_json(path)


def open_weights(hf_dir) -> tuple[dict[str, np.ndarray], Path]:
    """(every tensor of the directory, memory-mapped, by name; the path to name in errors)."""
    files = weight_files(hf_dir)
    tensors = {}
    for file in files:
        tensors |= open_safetensors(file)
    return tensors, files[0] if len(files) == 1 else Path(hf_dir) / INDEX_FILE


def find_tensor(tensors: dict, name: str, shape: tuple, path: Path) -> np.ndarray:
    if name not in tensors:
        raise UserError(f"'{path}' has no tensor {name}; pass a checkpoint whose config.json "
                        "matches its weights")
    array = tensors[name]
    if tuple(array.shape) != tuple(shape):
        raise UserError(f"'{path}': {name} has shape {tuple(array.shape)}, but its config.json "
                        f"implies {tuple(shape)}; pass a consistent checkpoint")
    return array


class Stacked:
    """Views of the same shape stacked on a new `axis`, read lazily: indexing reads only the
    parts (and slices) it selects. HF's k_proj and v_proj become jaxpar's one kv kernel this way."""

    def __init__(self, views: list, axis: int):
        self.views, self.axis = views, axis
        shape = list(views[0].shape)
        self.shape = tuple(shape[:axis] + [len(views)] + shape[axis:])

    def __getitem__(self, index: tuple) -> np.ndarray:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        rest = index[:self.axis] + index[self.axis + 1:]
        parts = [np.asarray(self.views[i][rest]) for i in range(*index[self.axis].indices(len(self.views)))]
        return np.stack(parts, axis=self.axis)


def slice_reader(views: list, stacked: bool, rows: int | None = None):
    """make_array_from_callback's callback over per-layer views (or one view when not stacked).

    `rows`: the real row count of an embedding; the padded rows past it are zeros.
    """
    def read(index: tuple) -> np.ndarray:
        if stacked:
            layers = range(*index[0].indices(len(views)))
            return np.stack([np.asarray(views[i][index[1:]], np.float32) for i in layers])
        view = views[0]
        if rows is None:
            return np.array(view[index], np.float32)  # a copy: never an alias of the file
        start, stop, _ = index[0].indices(padded_vocab(rows))
        columns = len(range(*index[1].indices(view.shape[1])))
        out = np.zeros((stop - start, columns), np.float32)
        if start < rows:
            out[:min(stop, rows) - start] = view[start:min(stop, rows), index[1]]
        return out
    return read


def save_weights(tensors: dict[str, np.ndarray], out: Path, max_shard_bytes: int = MAX_SHARD_BYTES) -> list[str]:
    """model.safetensors, or above max_shard_bytes, shards model-0000i-of-0000n.safetensors and
    their index, as save_pretrained writes them; returns the file names."""
    from safetensors.numpy import save_file
    shards, size = [{}], 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_file(tensors, out / WEIGHTS_FILE, metadata={"format": "pt"})
        return [WEIGHTS_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, out / name, metadata={"format": "pt"})
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": {tensor: name for name, shard in zip(names, shards) for tensor in shard}}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names + [INDEX_FILE]
