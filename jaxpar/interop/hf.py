"""Hugging Face GPT-2 checkpoints (a directory with config.json + model.safetensors) in and out.

In: `apply_hf_config` sets the model's shape from config.json and refuses what jaxpar's GPT does
not compute; `load_hf_params` then puts every weight straight into its sharding on any mesh and
ZeRO stage, each device reading only its own slice of the memory-mapped safetensors file.
Out: `hf_state_dict` and `hf_config` are what GPT2LMHeadModel.save_pretrained writes.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from jaxpar.core.config import Config, set_value, validate
from jaxpar.core.errors import UserError
from jaxpar.interop.safetensors_mmap import open_safetensors
from jaxpar.models.gpt import LN_EPS, abstract_model, padded_vocab

CONFIG_FILE, WEIGHTS_FILE = "config.json", "model.safetensors"
HF_PREFIX = "transformer."  # GPT2LMHeadModel's names; a bare GPT2Model's lack it
# HF's activation names whose math is jaxpar's model.gelu of that kind.
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh",
               "gelu": "exact", "gelu_python": "exact"}
TO_HF_ACTIVATION = {"tanh": "gelu_new", "exact": "gelu"}


@dataclass(frozen=True)
class Weight:
    """Where a jaxpar param comes from: the HF tensor `hf` (per layer: under h.{i}.), whose dims
    are `groups` of jaxpar's per-layer dims in order (e.g. c_attn's 3C is (3, heads, head_dim)),
    swapped first if `transposed`."""
    hf: str
    groups: tuple | None = None  # None: one jaxpar dim per HF dim
    transposed: bool = False


LAYER_WEIGHTS = {
    ("ln_1", "scale"): Weight("ln_1.weight"), ("ln_1", "bias"): Weight("ln_1.bias"),
    # Conv1D stores (in, out), as jaxpar's kernels are; the 3C outputs are q, k, v by head.
    ("qkv", "kernel"): Weight("attn.c_attn.weight", (1, 3)),
    ("qkv", "bias"): Weight("attn.c_attn.bias", (3,)),
    ("attn_out", "kernel"): Weight("attn.c_proj.weight", (2, 1)),
    ("attn_out", "bias"): Weight("attn.c_proj.bias"),
    ("ln_2", "scale"): Weight("ln_2.weight"), ("ln_2", "bias"): Weight("ln_2.bias"),
    ("mlp_in", "kernel"): Weight("mlp.c_fc.weight"), ("mlp_in", "bias"): Weight("mlp.c_fc.bias"),
    # jaxpar stores the MLP output (embed, mlp), out first; HF's Conv1D has it (mlp, embed).
    ("mlp_out", "kernel"): Weight("mlp.c_proj.weight", transposed=True),
    ("mlp_out", "bias"): Weight("mlp.c_proj.bias"),
}
TOP_WEIGHTS = {("wte",): Weight("wte.weight"), ("wpe",): Weight("wpe.weight"),
               ("ln_f", "scale"): Weight("ln_f.weight"), ("ln_f", "bias"): Weight("ln_f.bias")}


def hf_shape(weight: Weight, jaxpar_shape: tuple) -> tuple:
    """The HF tensor's shape for a jaxpar param of `jaxpar_shape` (one layer's)."""
    dims = list(jaxpar_shape[::-1] if weight.transposed else jaxpar_shape)
    shape = []
    for size in weight.groups or (1,) * len(dims):
        shape.append(int(np.prod(dims[:size])))
        dims = dims[size:]
    return tuple(shape)


def to_jaxpar_layout(weight: Weight, array: np.ndarray, jaxpar_shape: tuple) -> np.ndarray:
    """An HF tensor as jaxpar's param (a view: nothing is read until it is indexed)."""
    split = jaxpar_shape[::-1] if weight.transposed else jaxpar_shape
    array = array.reshape(split)
    return array.T if weight.transposed else array


def to_hf_layout(weight: Weight, array: np.ndarray) -> np.ndarray:
    """One layer's jaxpar param as its HF tensor (float32, C-ordered, as safetensors stores it)."""
    hf = (array.T if weight.transposed else array).reshape(hf_shape(weight, array.shape))
    return np.ascontiguousarray(hf, np.float32)


# ---- config.json ----

def hf_files(hf_dir) -> tuple[Path, Path]:
    """(config.json, model.safetensors) of an HF directory, or a UserError naming what is missing."""
    hf_dir = Path(hf_dir)
    if not hf_dir.is_dir():
        raise UserError(f"Hugging Face checkpoint directory '{hf_dir}' not found; pass a directory "
                        f"with {CONFIG_FILE} and {WEIGHTS_FILE} (as save_pretrained writes)")
    config, weights = hf_dir / CONFIG_FILE, hf_dir / WEIGHTS_FILE
    if not config.is_file():
        raise UserError(f"'{hf_dir}' has no {CONFIG_FILE}; pass a directory written by "
                        "save_pretrained")
    if not weights.is_file():
        other = next((p.name for p in hf_dir.glob("*.bin")), None) or next(
            (p.name for p in hf_dir.glob("*.safetensors.index.json")), None)
        fix = (f"it has {other}: save it again with save_pretrained(dir, safe_serialization=True, "
               "max_shard_size='100GB')" if other else "pass a directory written by save_pretrained")
        raise UserError(f"'{hf_dir}' has no {WEIGHTS_FILE}; {fix}")
    return config, weights


def read_hf_config(hf_dir) -> dict:
    path, _ = hf_files(hf_dir)
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"'{path}' is not valid JSON ({e}); pass a directory written by "
                        "save_pretrained") from None
    if not isinstance(config, dict):
        raise UserError(f"'{path}' is not a JSON object; pass a directory written by save_pretrained")
    return config


def check_supported(config: dict, path: Path) -> None:
    """Refuse a config.json that is not GPT-2, or whose options change math jaxpar lacks."""
    kind = config.get("model_type")
    if kind != "gpt2":
        names = ", ".join(config.get("architectures") or []) or "no architectures"
        raise UserError(f"'{path}' describes a model_type '{kind}' model ({names}); only GPT-2 "
                        "(model_type gpt2) checkpoints can be loaded")
    C = config.get("n_embd", 768)
    unsupported = [
        ("scale_attn_by_inverse_layer_idx", config.get("scale_attn_by_inverse_layer_idx", False),
         False),
        ("scale_attn_weights", config.get("scale_attn_weights", True), True),
        ("add_cross_attention", config.get("add_cross_attention", False), False),
        ("tie_word_embeddings", config.get("tie_word_embeddings", True), True),
        ("n_inner", config.get("n_inner"), None if config.get("n_inner") is None else 4 * C),
        ("layer_norm_epsilon", config.get("layer_norm_epsilon", 1e-5), LN_EPS),
    ]
    for key, found, needed in unsupported:
        if found != needed:
            raise UserError(f"'{path}' has {key}={json.dumps(found)}, which jaxpar's GPT does not "
                            f"compute (it needs {json.dumps(needed)}); use a standard GPT-2 checkpoint")
    activation = config.get("activation_function", "gelu_new")
    if activation not in ACTIVATIONS:
        raise UserError(f"'{path}' has activation_function '{activation}', which jaxpar's GPT does "
                        f"not compute; it knows {', '.join(ACTIVATIONS)}")


def hf_model_fields(hf_dir) -> tuple[list[tuple[str, object, str]], int]:
    """([(model field, value, where config.json says so)], vocab_size) of a supported GPT-2."""
    config = read_hf_config(hf_dir)
    path = Path(hf_dir) / CONFIG_FILE
    check_supported(config, path)
    try:
        fields = [(field, int(config[key]), f"{key}={config[key]}") for field, key in
                  [("n_layer", "n_layer"), ("n_head", "n_head"), ("n_embd", "n_embd"),
                   ("block_size", "n_positions")]]
        vocab_size = int(config["vocab_size"])
    except KeyError as e:
        raise UserError(f"'{path}' has no {e.args[0]}; pass a complete GPT-2 config.json") from None
    activation = config.get("activation_function", "gelu_new")
    fields += [("bias", True, "biases (every GPT-2 has them)"),
               ("gelu", ACTIVATIONS[activation], f"activation_function={activation}")]
    return fields, vocab_size


def model_overrides_from_hf(hf_dir) -> tuple[dict, int]:
    """({"model.field": value} that make jaxpar's model this GPT-2's, its vocab_size)."""
    fields, vocab_size = hf_model_fields(hf_dir)
    return {f"model.{name}": value for name, value, _ in fields}, vocab_size


def apply_hf_config(cfg: Config, hf_dir, explicit: dict) -> int:
    """Set cfg.model to the GPT-2 in hf_dir and return its vocab_size.

    `explicit` holds the user's own `section.field` overrides: a model.* one that disagrees with
    the checkpoint is a UserError, as is an n_head the mesh's tensor axis cannot split.
    """
    fields, vocab_size = hf_model_fields(hf_dir)
    where = Path(hf_dir) / CONFIG_FILE
    for name, value, source in fields:
        key = f"model.{name}"
        if key in explicit:
            scratch = Config()
            set_value(scratch, key, explicit[key])
            if getattr(scratch.model, name) != value:
                raise UserError(f"{key}={explicit[key]} conflicts with {source} in {where}; "
                                "drop the override")
        setattr(cfg.model, name, value)
    tp, n_head = cfg.mesh.tp, cfg.model.n_head
    if tp > 1 and n_head % tp:
        raise UserError(f"tp={tp} does not divide n_head={n_head} of the GPT-2 in {where}; "
                        f"choose tp from the divisors of {n_head}")
    validate(cfg)
    return vocab_size


# ---- model.safetensors ----

def hf_names(tensors: dict) -> str:
    """The prefix of the file's names: 'transformer.' (GPT2LMHeadModel) or '' (GPT2Model)."""
    return HF_PREFIX if HF_PREFIX + "wte.weight" in tensors else ""


def find_tensor(tensors: dict, prefix: str, name: str, shape: tuple, path: Path) -> np.ndarray:
    if prefix + name not in tensors:
        raise UserError(f"'{path}' has no tensor {prefix + name}; pass a GPT-2 checkpoint "
                        "whose config.json matches its weights")
    array = tensors[prefix + name]
    if tuple(array.shape) != tuple(shape):
        raise UserError(f"'{path}': {prefix + name} has shape {tuple(array.shape)}, but its "
                        f"config.json implies {tuple(shape)}; pass a consistent checkpoint")
    return array


def check_tied_head(tensors: dict, wte: np.ndarray, path: Path) -> None:
    """GPT-2's lm_head is wte; a file that stores a different one is a model jaxpar cannot hold."""
    head = tensors.get("lm_head.weight")
    if head is not None and not np.array_equal(head, wte):
        raise UserError(f"'{path}': lm_head.weight differs from wte.weight, and jaxpar's lm_head "
                        "is tied to wte; use a checkpoint with tied embeddings")


def slice_reader(views: list[np.ndarray], stacked: bool, rows: int | None = None):
    """make_array_from_callback's callback over per-layer views (or one view when not stacked).

    `rows`: the real row count of wte; the padded rows past it are zeros.
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


def load_hf_params(hf_dir, cfg: Config, vocab_size: int, param_shardings: dict) -> dict:
    """The GPT-2 in hf_dir as jaxpar's params (abstract_model's pure dict), each leaf made
    in its sharding from the slices its devices hold. cfg comes from apply_hf_config."""
    _, weights_path = hf_files(hf_dir)
    if not cfg.model.bias:
        raise UserError("model.bias=false cannot hold a GPT-2 checkpoint, which has biases; "
                        "drop the override")
    _, shapes, _ = abstract_model(cfg, vocab_size)
    tensors = open_safetensors(weights_path)
    prefix, L = hf_names(tensors), cfg.model.n_layer

    def source(path: tuple, shape: tuple):
        if path[0] == "blocks":
            weight = LAYER_WEIGHTS[path[1:]]
            names = [f"h.{i}.{weight.hf}" for i in range(L)]
            shape = shape[1:]
        else:
            weight, names = TOP_WEIGHTS[path], [TOP_WEIGHTS[path].hf]
        real = (vocab_size,) + shape[1:] if path == ("wte",) else shape
        arrays = [find_tensor(tensors, prefix, n, hf_shape(weight, real), weights_path)
                  for n in names]
        if path == ("wte",):
            check_tied_head(tensors, arrays[0], weights_path)
        views = [to_jaxpar_layout(weight, a, real) for a in arrays]
        return slice_reader(views, path[0] == "blocks", vocab_size if path == ("wte",) else None)

    flat = jax.tree_util.tree_flatten_with_path(shapes)[0]
    readers = {keys(p): source(keys(p), s.shape) for p, s in flat}  # all checked before any read
    return jax.tree_util.tree_map_with_path(
        lambda p, s, where: jax.make_array_from_callback(s.shape, where, readers[keys(p)]),
        shapes, param_shardings)


def keys(path) -> tuple[str, ...]:
    return tuple(k.key for k in path)


# ---- out ----

def hf_state_dict(params: dict, cfg: Config, vocab_size: int) -> dict[str, np.ndarray]:
    """jaxpar's params as GPT2LMHeadModel.save_pretrained writes them: its names, shapes and
    float32, with wte's padding rows removed (the tied lm_head is not stored)."""
    if not cfg.model.bias:
        raise UserError("this model was trained with model.bias=false, and a Hugging Face GPT-2 "
                        "always has biases; only a model.bias=true run can be exported")
    out = {}
    for path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        path, array = keys(path), np.asarray(jax.device_get(array), np.float32)
        if path[0] == "blocks":
            weight = LAYER_WEIGHTS[path[1:]]
            for i in range(cfg.model.n_layer):
                out[f"{HF_PREFIX}h.{i}.{weight.hf}"] = to_hf_layout(weight, array[i])
        else:
            weight = TOP_WEIGHTS[path]
            out[HF_PREFIX + weight.hf] = to_hf_layout(weight, array[:vocab_size] if path == ("wte",)
                                                      else array)
    return out


def hf_config(cfg: Config, vocab_size: int, eot_id: int | None) -> dict:
    """config.json for GPT2LMHeadModel, as save_pretrained writes it for this model."""
    m = cfg.model
    return {
        "activation_function": TO_HF_ACTIVATION[m.gelu], "add_cross_attention": False,
        "architectures": ["GPT2LMHeadModel"], "attn_pdrop": m.dropout,
        "bos_token_id": eot_id, "eos_token_id": eot_id, "dtype": "float32",
        "embd_pdrop": m.dropout, "initializer_range": 0.02, "layer_norm_epsilon": LN_EPS,
        "model_type": "gpt2", "n_ctx": m.block_size, "n_embd": m.n_embd, "n_head": m.n_head,
        "n_inner": None, "n_layer": m.n_layer, "n_positions": m.block_size, "pad_token_id": None,
        "reorder_and_upcast_attn": False, "resid_pdrop": m.dropout,
        "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
        "summary_activation": None, "summary_first_dropout": m.dropout,
        "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
        "tie_word_embeddings": True, "use_cache": True, "vocab_size": vocab_size,
    }
