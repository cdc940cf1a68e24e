"""Reading a Hugging Face model directory: config.json, and the weights in model.safetensors or in
the shards that model.safetensors.index.json names, every tensor memory-mapped so that a device
reads only its own slice. Writing: one file, or shards with an index above a size, as
save_pretrained does, with the mode of any other new file; and jaxpar.export's manifest, which lists
the files that it wrote into a folder (the only ones it may later replace). Every problem is a
UserError of one line.
"""

import json
import math
import os
from pathlib import Path

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.formats.safetensors_mmap import open_safetensors
from jaxpar.nn.layers import padded_vocab

CONFIG_FILE, WEIGHTS_FILE, INDEX_FILE = "config.json", "model.safetensors", "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size, "5GB"
MANIFEST_FILE, WRITER = "jaxpar_export.json", "jaxpar.export"

# The type of every config.json field that the Hugging Face formats' readers use (GPT-2's, Llama's and
# its relatives', the mixtures of experts'), checked before any is read. A float field takes
# an integer too (rope_theta 10000); an integer field takes no float, 2.0 included.
FIELD_TYPES = {
    "model_type": str, "architectures": list[str], "vocab_size": int, "tie_word_embeddings": bool,
    "n_layer": int, "n_head": int, "n_embd": int, "n_positions": int, "n_inner": int, "layer_norm_epsilon": float,
    "activation_function": str, "scale_attn_by_inverse_layer_idx": bool, "scale_attn_weights": bool,
    "add_cross_attention": bool,
    "num_hidden_layers": int, "num_attention_heads": int, "hidden_size": int, "intermediate_size": int,
    "num_key_value_heads": int, "max_position_embeddings": int, "head_dim": int, "rms_norm_eps": float,
    "hidden_act": str, "attention_bias": bool, "mlp_bias": bool, "sliding_window": int, "use_sliding_window": bool,
    "rope_theta": float, "rope_scaling": dict, "rope_parameters": dict,
    "num_local_experts": int, "num_experts": int, "num_experts_per_tok": int, "moe_intermediate_size": int,
    "norm_topk_prob": bool, "decoder_sparse_step": int, "mlp_only_layers": list[int],
    "n_shared_experts": int, "num_shared_experts": int, "shared_expert_intermediate_size": int, "scoring_func": str,
    "n_group": int, "topk_group": int, "router_jitter_noise": float, "first_k_dense_replace": int,
}
ROPE_FIELD_TYPES = {"rope_type": str, "type": str, "rope_theta": float, "factor": float, "low_freq_factor": float,
                    "high_freq_factor": float, "original_max_position_embeddings": int}
# Fields that save_pretrained writes as null for "none" or "the default", which the readers take so.
MAY_BE_NULL = {"model_type", "architectures", "n_inner", "num_key_value_heads", "head_dim", "sliding_window",
               "attention_bias", "mlp_bias", "rope_scaling", "rope_parameters", "num_local_experts", "num_experts",
               "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
               "mlp_only_layers", "n_shared_experts", "num_shared_experts", "shared_expert_intermediate_size",
               "n_group", "topk_group", "router_jitter_noise", "first_k_dense_replace"}
EXPECTED = {int: "an integer", float: "a finite number", bool: "true or false", str: "a string", dict: "an object",
            list[int]: "a list of integers", list[str]: "a list of strings"}


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
        weight_map = index.get("weight_map") or {}
        if not isinstance(weight_map, dict) or not is_a(list[str], list(weight_map.values())):
            raise UserError(f"'{hf_dir / INDEX_FILE}': weight_map must map each tensor's name to its "
                            "shard's file name; save the model again with save_pretrained")
        shards = sorted(set(weight_map.values()))
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
    config = read_json(path)
    check_field_types(config, FIELD_TYPES, path)
    for key in ("rope_scaling", "rope_parameters"):
        if isinstance(config.get(key), dict):
            check_field_types(config[key], ROPE_FIELD_TYPES, path, f"{key}.")
    return config


def check_field_types(config: dict, types: dict, path: Path, prefix: str = "") -> None:
    """Each field of `types` that config.json holds has its type (or is a null that may be)."""
    for key, kind in types.items():
        value = config.get(key)
        if key not in config or (value is None and not prefix and key in MAY_BE_NULL) or is_a(kind, value):
            continue
        raise UserError(f"'{path}': {prefix}{key} must be {EXPECTED[kind]}, got {json.dumps(value)}; "
                        "correct that field, or save the model again with save_pretrained")


def is_a(kind, value) -> bool:
    """Whether a JSON value is of `kind`; JSON's true and false are not numbers here."""
    if kind in (list[int], list[str]):
        return isinstance(value, list) and all(is_a(kind.__args__[0], item) for item in value)
    if isinstance(value, bool):
        return kind is bool
    if kind is float:
        return isinstance(value, (int, float)) and math.isfinite(value)
    return isinstance(value, kind)


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
    shards, size = [{}], 0
    for name, array in tensors.items():
        if shards[-1] and size + array.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = array
        size += array.nbytes
    if len(shards) == 1:
        save_tensors(tensors, out / WEIGHTS_FILE)
        return [WEIGHTS_FILE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_tensors(shard, out / name)
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
             "weight_map": {tensor: name for name, shard in zip(names, shards) for tensor in shard}}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return names + [INDEX_FILE]


def save_tensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    """One safetensors file, of the mode a new file gets (0644 under umask 022): safetensors writes
    a temporary file of mode 0600 and renames it, which would keep it from the files beside it."""
    from safetensors.numpy import save_file
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0o022)  # the only way to read it; set back at once
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def write_manifest(folder: Path, files: list[str]) -> None:
    """Record in `folder` that jaxpar.export wrote `files` there."""
    manifest = {"written_by": WRITER, "files": sorted(files)}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def written_files(folder: Path) -> set[str]:
    """The files of `folder` that jaxpar.export wrote, as its manifest lists them (the manifest
    too); none where there is no readable manifest. Only plain names: never a path elsewhere."""
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    if manifest.get("written_by") != WRITER or not is_a(list[str], files):
        return set()
    plain = {name for name in files if os.path.basename(name) == name and name not in ("", ".", "..")}
    return plain | {MANIFEST_FILE}
