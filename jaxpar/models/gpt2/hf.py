"""Hugging Face's GPT2LMHeadModel and jaxpar's GPT-2 family: config.json's fields, the weights'
names and layouts, and what save_pretrained writes. Used through jaxpar.models.hf.
"""

import json
from pathlib import Path

import numpy as np

from jaxpar.core.config import ModelConfig
from jaxpar.core.errors import UserError
from jaxpar.formats.hf_mapping import Mapping, Weight
from jaxpar.models.gpt2.model import LN_EPS

FAMILY = "gpt2"
LOADS = {FAMILY: "GPT2LMHeadModel"}  # the config.json model_types computed here, with their architectures
MODEL_TYPES = tuple(LOADS)  # the config.json model_types read here
HF_PREFIX = "transformer."  # GPT2LMHeadModel's names; a bare GPT2Model's lack it
# HF's activation names whose math is jaxpar's model.gelu of that kind.
ACTIVATIONS = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh",
               "gelu": "exact", "gelu_python": "exact"}
TO_HF_ACTIVATION = {"tanh": "gelu_new", "exact": "gelu"}
# HF's names, after "transformer.". Conv1D stores (in, out), as jaxpar's kernels are; the 3C
# outputs of c_attn are q, k, v by head. jaxpar stores the MLP output (embed, mlp), out first
# (declared `transposed`), so it is swapped on the way.
MAPPING = Mapping(layer="h.{i}.", out_first=False, blocks={
    ("ln_1", "scale"): Weight("ln_1.weight"), ("ln_1", "bias"): Weight("ln_1.bias"),
    ("qkv", "kernel"): Weight("attn.c_attn.weight", (1, 3)), ("qkv", "bias"): Weight("attn.c_attn.bias", (3,)),
    ("attn_out", "kernel"): Weight("attn.c_proj.weight", (2, 1)), ("attn_out", "bias"): Weight("attn.c_proj.bias"),
    ("ln_2", "scale"): Weight("ln_2.weight"), ("ln_2", "bias"): Weight("ln_2.bias"),
    ("mlp_in", "kernel"): Weight("mlp.c_fc.weight"), ("mlp_in", "bias"): Weight("mlp.c_fc.bias"),
    ("mlp_out", "kernel"): Weight("mlp.c_proj.weight"), ("mlp_out", "bias"): Weight("mlp.c_proj.bias"),
}, top={("wte",): Weight("wte.weight"), ("wpe",): Weight("wpe.weight"),
        ("ln_f", "scale"): Weight("ln_f.weight"), ("ln_f", "bias"): Weight("ln_f.bias")})
TIED_HEAD = "lm_head.weight"  # wte, when a file stores it at all


def check_supported(config: dict, path: Path) -> None:
    """Refuse a GPT-2 config.json whose options change math jaxpar lacks."""
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


def model_fields(config: dict, path: Path) -> tuple[list[tuple[str, object, str]], int, int]:
    """([(model field, value, where config.json says so)], vocab_size, positions it can see)."""
    check_supported(config, path)
    try:
        fields = [(field, int(config[key]), f"{key}={config[key]}") for field, key in
                  [("n_layer", "n_layer"), ("n_head", "n_head"), ("n_embd", "n_embd"),
                   ("block_size", "n_positions")]]
        vocab_size = int(config["vocab_size"])
    except KeyError as e:
        raise UserError(f"'{path}' has no {e.args[0]}; pass a complete GPT-2 config.json") from None
    activation = config.get("activation_function", "gelu_new")
    fields += [("family", FAMILY, "model_type=gpt2"), ("bias", True, "biases (every GPT-2 has them)"),
               ("gelu", ACTIVATIONS[activation], f"activation_function={activation}")]
    return fields, vocab_size, int(config["n_positions"])


def readers(tensors: dict, m: ModelConfig, vocab_size: int, declared: dict, path: Path) -> dict:
    """{param path: make_array_from_callback's reader} for every declared param (a dict of
    jaxpar.nn.params.Param by path), all checked."""
    if not m.bias:
        raise UserError("model.bias=false cannot hold a GPT-2 checkpoint, which has biases; "
                        "drop the override")
    wte = MAPPING.top[("wte",)].hf
    prefix = HF_PREFIX if HF_PREFIX + wte in tensors else ""
    MAPPING.reader(tensors, ("wte",), declared[("wte",)], m, vocab_size, path, prefix)  # wte checked first,
    head = tensors.get(TIED_HEAD)  # then the tied head: a file with another is a model jaxpar cannot hold
    if head is not None and not np.array_equal(head, tensors[prefix + wte]):
        raise UserError(f"'{path}': {TIED_HEAD} differs from {wte}, and jaxpar's lm_head "
                        "is tied to wte; use a checkpoint with tied embeddings")
    return MAPPING.readers(tensors, m, vocab_size, declared, path, prefix)


def state_dict(params: dict, declared: dict, m: ModelConfig, vocab_size: int,
               dtype=np.float32) -> dict[str, np.ndarray]:
    """jaxpar's params as GPT2LMHeadModel.save_pretrained writes them: its names and shapes, with
    wte's padding rows removed (the tied lm_head is not stored)."""
    if not m.bias:
        raise UserError("this model was trained with model.bias=false, and a Hugging Face GPT-2 "
                        "always has biases; only a model.bias=true run can be exported")
    return MAPPING.state_dict(params, declared, m, vocab_size, dtype, HF_PREFIX)


def hf_config(m: ModelConfig, vocab_size: int, eot_id: int | None, dtype: str = "float32") -> dict:
    """config.json for GPT2LMHeadModel, as save_pretrained writes it for this model."""
    return {
        "activation_function": TO_HF_ACTIVATION[m.gelu], "add_cross_attention": False,
        "architectures": ["GPT2LMHeadModel"], "attn_pdrop": m.dropout,
        "bos_token_id": eot_id, "eos_token_id": eot_id, "dtype": dtype,
        "embd_pdrop": m.dropout, "initializer_range": 0.02, "layer_norm_epsilon": LN_EPS,
        "model_type": "gpt2", "n_ctx": m.block_size, "n_embd": m.n_embd, "n_head": m.n_head,
        "n_inner": None, "n_layer": m.n_layer, "n_positions": m.block_size, "pad_token_id": None,
        "reorder_and_upcast_attn": False, "resid_pdrop": m.dropout,
        "scale_attn_by_inverse_layer_idx": False, "scale_attn_weights": True,
        "summary_activation": None, "summary_first_dropout": m.dropout,
        "summary_proj_to_labels": True, "summary_type": "cls_index", "summary_use_proj": True,
        "tie_word_embeddings": True, "use_cache": True, "vocab_size": vocab_size,
    }
