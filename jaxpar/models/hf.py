"""Hugging Face checkpoints in and out, for every model family: a directory with config.json and
model.safetensors (or the shards model.safetensors.index.json names), as save_pretrained writes it.

Each family's names and layouts are modules in its folder (gpt2/hf.py, llama/hf.py, llama/hf_moe.py,
deepseek/hf.py:
each one table that jaxpar.formats.hf_mapping reads and writes by), which its registry entry names;
one is picked by config.json's model_type on the way in and by the model's family on the way out.
In: `apply_hf_config` sets the model's shape from config.json and refuses what jaxpar does not
compute; `load_hf_params` then puts every weight straight into its sharding on any mesh and ZeRO
stage, each device reading only its own slice of the memory-mapped files (float32, bfloat16 or
float16 ones, into float32 master weights); `hf_tokenizer` is the directory's tokenizer, which the
data it meets is checked against.
Out: `hf_state_dict` and `hf_config` are what save_pretrained writes.
"""

import json
from pathlib import Path

import jax
import numpy as np

from jaxpar.core.axes import TENSOR_AXIS, sizes_of
from jaxpar.core.config import Config, ModelConfig, validate, with_family
from jaxpar.core.errors import UserError
from jaxpar.data.tokenizer import META_FILE, from_meta, load_tokenizer
from jaxpar.formats.hf_files import CONFIG_FILE, EXPECTED, is_a, open_weights, read_hf_config
from jaxpar.models.registry import FAMILIES
from jaxpar.models.transformer import Transformer
from jaxpar.nn.params import in_order

# Each family's formats, found by the config.json model_types they name (MODEL_TYPES) on the way in,
# and on the way out by the family's `exported_as` (jaxpar.models.family.Registered).
ADAPTERS = {kind: adapter for entry in FAMILIES.values() for adapter in entry.hf_formats
            for kind in adapter.MODEL_TYPES}
# What a refusal of an unknown model_type offers: the model_types the formats compute (their LOADS).
LOADED = [f"{kind} ({architecture})" for entry in FAMILIES.values() for adapter in entry.hf_formats
          for kind, architecture in adapter.LOADS.items()]
SUPPORTED = ", ".join(LOADED[:-1]) + " and " + LOADED[-1]


def format_of(config: dict, path: Path):
    kind = config.get("model_type")
    if kind not in ADAPTERS:
        names = ", ".join(config.get("architectures") or []) or "no architectures"
        raise UserError(f"'{path}' describes a model_type '{kind}' model ({names}); jaxpar loads "
                        f"{SUPPORTED} checkpoints")
    return ADAPTERS[kind]


def hf_model_fields(hf_dir) -> tuple[list[tuple[str, object, str]], int, int]:
    """([(model field, value, where config.json says so)], vocab_size, max positions)."""
    config = read_hf_config(hf_dir)
    path = Path(hf_dir) / CONFIG_FILE
    adapter = format_of(config, path)
    check_format_fields(config, adapter, path)
    return adapter.model_fields(config, path)


def check_format_fields(config: dict, adapter, path: Path) -> None:
    """The fields only this format reads (its FIELD_TYPES; hf_files checks every format's), each of
    its type; a null only where the format's MAY_BE_NULL takes it as unset, so that no field is
    read as int(None)."""
    nullable = getattr(adapter, "MAY_BE_NULL", set())
    for key, kind in getattr(adapter, "FIELD_TYPES", {}).items():
        value = config.get(key)
        if key in config and not (value is None and key in nullable) and not is_a(kind, value):
            raise UserError(f"'{path}': {key} must be {EXPECTED[kind]}, got {json.dumps(value)}; "
                            "correct that field, or save the model again with save_pretrained")


def model_overrides_from_hf(hf_dir) -> tuple[dict, int]:
    """({"model.field": value} that make jaxpar's model this checkpoint's, its vocab_size)."""
    fields, vocab_size, _ = hf_model_fields(hf_dir)
    return {f"model.{name}": value for name, value, _ in fields}, vocab_size


def apply_hf_config(cfg: Config, hf_dir, explicit: dict) -> int:
    """Set cfg.model to the model in hf_dir and return its vocab_size.

    `explicit` holds the user's own `section.field` overrides: a model.* one that disagrees with
    the checkpoint is a UserError, as is a head count the mesh's tensor axis cannot split. A
    block_size past the positions the model knows is capped to them unless it is explicit.
    """
    fields, vocab_size, positions = hf_model_fields(hf_dir)
    where = Path(hf_dir) / CONFIG_FILE
    family = next(value for name, value, _ in fields if name == "family")
    cfg.model = with_family(cfg.model, family)  # first: the model's keys are its family's
    for name, value, source in fields:
        key = f"model.{name}"
        if key in explicit:
            scratch = Config()
            scratch.set("model.family", family)
            scratch.set(key, explicit[key])
            if getattr(scratch.model, name) != value:
                raise UserError(f"{key}={explicit[key]} conflicts with {source} in {where}; "
                                "drop the override")
        setattr(cfg.model, name, value)
    if cfg.model.block_size > positions:
        if "model.block_size" in explicit:
            raise UserError(f"model.block_size={cfg.model.block_size} is past max_position_embeddings="
                            f"{positions} in {where}; pass at most {positions}")
        cfg.model.block_size = positions
    sizes = sizes_of(cfg.mesh)  # the tensor axis's check, naming config.json as where the heads come from
    TENSOR_AXIS.check(cfg.run, sizes[TENSOR_AXIS.key], sizes, origin=str(where))
    validate(cfg)
    return vocab_size


def declared_params(m: ModelConfig, vocab_size: int) -> dict:
    """{param path: its declaration (jaxpar.nn.params.Param)} of the model m describes."""
    return dict(in_order(Transformer(m, vocab_size).declared))


def module_for(m: ModelConfig):
    """The module that names and lays out this model's weights as HF does."""
    exported_as = FAMILIES[m.family].exported_as
    if exported_as is None:
        raise UserError(f"model.family={m.family} has no Hugging Face format in jaxpar yet; "
                        "its checkpoints stay jaxpar's (eval and sample read them)")
    return exported_as(m)


def load_hf_params(hf_dir, m: ModelConfig, vocab_size: int, param_shardings: dict) -> dict:
    """The model in hf_dir as jaxpar's params (the model's pure dict), each leaf made in its
    sharding from the slices its devices hold; weights holding a NaN or an infinity are a
    UserError that names the first. m is the cfg.model that apply_hf_config set."""
    module, model = module_for(m), Transformer(m, vocab_size)
    shapes, declared = model.shapes(), dict(in_order(model.declared))
    tensors, path = open_weights(hf_dir)
    readers = module.readers(tensors, m, vocab_size, declared, path)  # all checked first
    params = jax.tree_util.tree_map_with_path(
        lambda p, s, where: jax.make_array_from_callback(s.shape, where, readers[tuple(k.key for k in p)]),
        shapes, param_shardings)
    check_finite(params, hf_dir)  # before training, evaluating or sampling starts from them
    return params


_all_finite = jax.jit(lambda leaves: [jax.numpy.isfinite(x).all() for x in leaves])


def check_finite(params, source) -> None:
    """A model with a NaN or an infinity in its weights is refused: whatever it trained from,
    evaluated, sampled or exported would be garbage that looks like output (jaxpar.inference.loading
    checks a checkpoint's params with it too)."""
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(params)[0])
    bad = [jax.tree_util.keystr(path) for path, ok in zip(paths, jax.device_get(_all_finite(list(leaves))))
           if not ok]
    if bad:
        raise UserError(f"the weights in '{source}' hold NaN or infinite values (params{bad[0]}"
                        + (f" and {len(bad) - 1} more" if len(bad) > 1 else "") + "); use a checkpoint of "
                        "a run that trained without diverging, or weights saved intact")


def hf_tokenizer(hf_dir):
    """hf_dir's tokenizer: its tokenizer.json, else the one a jaxpar export named in META_FILE
    (tiktoken's); None without either."""
    directory = Path(hf_dir)
    if (directory / "tokenizer.json").is_file():
        return load_tokenizer(str(directory / "tokenizer.json"))
    meta = directory / META_FILE
    if not meta.is_file():
        return None
    try:
        return from_meta(json.loads(meta.read_text(encoding="utf-8")))
    except (ValueError, KeyError, TypeError, AttributeError):
        raise UserError(f"'{meta}' does not name a tokenizer; export the model again with jaxpar.export") from None


def hf_state_dict(params: dict, m: ModelConfig, vocab_size: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """jaxpar's params under save_pretrained's names and shapes, in `dtype`."""
    return module_for(m).state_dict(params, declared_params(m, vocab_size), m, vocab_size, dtype)


def hf_config(m: ModelConfig, vocab_size: int, eot_id: int | None, dtype: str = "float32") -> dict:
    """config.json as save_pretrained writes it for this model."""
    return module_for(m).hf_config(m, vocab_size, eot_id, dtype)
