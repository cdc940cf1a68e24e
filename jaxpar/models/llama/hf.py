"""Hugging Face's LlamaForCausalLM and jaxpar's Llama family: config.json's fields (transformers 4's
rope_theta and rope_scaling, or 5's rope_parameters), the weights' names and layouts, and what
save_pretrained writes. Used through jaxpar.models.hf.

HF's Linear weights are (out, in); jaxpar's kernels are (in, *out) with the heads split out, so each
maps with a transpose and a reshape, and k/v and gate/up are stacked into one kernel each: MAPPING,
which jaxpar.formats.hf_mapping runs both ways.
"""

import json
from pathlib import Path

import numpy as np

from jaxpar.core.config import ModelConfig
from jaxpar.core.errors import UserError
from jaxpar.formats.hf_mapping import Mapping, Weight

FAMILY = "llama"
ROPE_TYPES = ("default", "llama3")
LLAMA3_KEYS = {"rope_factor": "factor", "rope_low_freq_factor": "low_freq_factor",
               "rope_high_freq_factor": "high_freq_factor",
               "rope_original_max_position": "original_max_position_embeddings"}
# The config.json model_types computed here, with their architectures: Mistral without a sliding window is
# Llama's math, Qwen3 Llama's with QK-norm. Qwen2 is read too, so that its refusal can name its biases.
LOADS = {FAMILY: "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}
MODEL_TYPES = (*LOADS, "qwen2")
MAPPING = Mapping(layer="model.layers.{i}.", out_first=True, blocks={
    ("attn_norm", "scale"): Weight("input_layernorm.weight"),
    ("q", "kernel"): Weight("self_attn.q_proj.weight", (1, 2)),  # (embed, heads, head_dim)
    ("kv", "kernel"): Weight(("self_attn.k_proj.weight", "self_attn.v_proj.weight"), (1, 2)),
    ("attn_out", "kernel"): Weight("self_attn.o_proj.weight", (2, 1)),  # (heads, head_dim, embed)
    ("q_norm", "scale"): Weight("self_attn.q_norm.weight"),  # Qwen3's, over each head's dims
    ("k_norm", "scale"): Weight("self_attn.k_norm.weight"),
    ("mlp_norm", "scale"): Weight("post_attention_layernorm.weight"),
    ("gate_up", "kernel"): Weight(("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp_out", "kernel"): Weight("mlp.down_proj.weight"),  # (embed, mlp) in both
}, top={("wte",): Weight("model.embed_tokens.weight"), ("norm", "scale"): Weight("model.norm.weight"),
        ("lm_head",): Weight("lm_head.weight")})


def refuse(path: Path, what: str, fix: str = "jaxpar's Llama computes plain LlamaForCausalLM math"):
    raise UserError(f"'{path}' has {what}, which jaxpar does not compute; {fix}")


def rope_fields(config: dict, path: Path) -> list[tuple[str, object, str]]:
    """RoPE's settings from transformers 5's rope_parameters or 4's rope_theta + rope_scaling."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ROPE_TYPES:
        refuse(path, f"rope type '{kind}'", f"it knows rope types {', '.join(ROPE_TYPES)}")
    theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    fields = [("rope_theta", theta, f"rope_theta={theta}"), ("rope_type", kind, f"rope type {kind}")]
    if kind == "llama3":
        try:
            fields += [(name, (int if name == "rope_original_max_position" else float)(rope[key]),
                        f"{key}={rope[key]}") for name, key in LLAMA3_KEYS.items()]
        except KeyError as e:
            raise UserError(f"'{path}': llama3 rope scaling without {e.args[0]}; pass a complete "
                            "config.json") from None
    return fields


QK_NORMED = ("qwen3", "qwen3_moe")  # model_types with Qwen3's per-head q_norm and k_norm


def check_supported(config: dict, path: Path) -> None:
    if config.get("model_type") == "qwen2":
        refuse(path, "Qwen2's biases on q, k and v (model_type qwen2)")
    if config.get("sliding_window") is not None and config.get("use_sliding_window", True):
        refuse(path, f"sliding_window={config['sliding_window']}", "it attends to the whole block")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            refuse(path, f"{key}=true")
    if config.get("hidden_act", "silu") != "silu":
        refuse(path, f"hidden_act '{config['hidden_act']}'", "its SwiGLU uses silu")


def model_fields(config: dict, path: Path) -> tuple[list[tuple[str, object, str]], int, int]:
    """([(model field, value, where config.json says so)], vocab_size, positions it can see)."""
    check_supported(config, path)
    try:
        fields = [(field, int(config[key]), f"{key}={config[key]}") for field, key in
                  [("n_layer", "num_hidden_layers"), ("n_head", "num_attention_heads"),
                   ("n_embd", "hidden_size"), ("mlp_dim", "intermediate_size")]]
        kv = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        vocab_size, positions = int(config["vocab_size"]), int(config.get("max_position_embeddings", 2048))
    except KeyError as e:
        raise UserError(f"'{path}' has no {e.args[0]}; pass a complete Llama config.json") from None
    eps, tied = float(config.get("rms_norm_eps", 1e-6)), bool(config.get("tie_word_embeddings", False))
    fields += [("family", FAMILY, f"model_type={config.get('model_type')}"),
               ("n_kv_head", kv, f"num_key_value_heads={kv}"), ("norm_eps", eps, f"rms_norm_eps={eps}"),
               ("tie_embeddings", tied, f"tie_word_embeddings={json.dumps(tied)}"),
               ("max_positions", positions, f"max_position_embeddings={positions}")]
    head_dim = int(config.get("head_dim") or 0)
    if head_dim * int(config["num_attention_heads"]) == int(config["hidden_size"]):
        head_dim = 0  # hidden_size / num_attention_heads: jaxpar's default
    qk_norm = "head" if config.get("model_type") in QK_NORMED else "none"
    fields += [("head_dim", head_dim, f"head_dim={config.get('head_dim')}"),
               ("qk_norm", qk_norm, f"model_type={config.get('model_type')}"),
               ("n_experts", 0, f"model_type={config.get('model_type')} (a dense MLP)")]
    return fields + rope_fields(config, path), vocab_size, positions


def readers(tensors: dict, m: ModelConfig, vocab_size: int, declared: dict, path: Path,
            mapping: Mapping = MAPPING) -> dict:
    """{param path: make_array_from_callback's reader} for every declared param (a dict of
    jaxpar.nn.params.Param by path), all checked."""
    out = mapping.readers(tensors, m, vocab_size, declared, path)
    embedding, head = (mapping.top[key].hf for key in (("wte",), ("lm_head",)))
    if m.tie_embeddings and head in tensors and not np.array_equal(tensors[head], tensors[embedding]):
        raise UserError(f"'{path}': {head} differs from the embedding, but config.json says "
                        "tie_word_embeddings=true; pass a consistent checkpoint")
    return out


def state_dict(params: dict, declared: dict, m: ModelConfig, vocab_size: int,
               dtype=np.float32) -> dict[str, np.ndarray]:
    """jaxpar's params as LlamaForCausalLM.save_pretrained writes them: its names and shapes, the
    vocabulary's padding rows removed, lm_head.weight only when untied."""
    return MAPPING.state_dict(params, declared, m, vocab_size, dtype)


def architecture(m: ModelConfig) -> dict:
    """config.json's architecture: LlamaForCausalLM, or Qwen3ForCausalLM with per-head QK-norm."""
    if m.qk_norm == "full":
        raise UserError("this model normalises queries and keys over all heads together (model.qk_norm=full, "
                        "OLMoE's), and jaxpar writes only Llama, Qwen3, Mixtral and Qwen3-MoE checkpoints; "
                        "use model.qk_norm=head or none")
    if m.qk_norm == "head":
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "use_sliding_window": False,
                "sliding_window": None, "max_window_layers": m.n_layer}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "mlp_bias": False, "pretraining_tp": 1}


def hf_config(m: ModelConfig, vocab_size: int, eot_id: int | None, dtype: str = "float32") -> dict:
    """config.json for LlamaForCausalLM (or Qwen3ForCausalLM), as transformers 5's save_pretrained
    writes it, with transformers 4's rope_theta and rope_scaling beside rope_parameters."""
    rope = {"rope_theta": m.rope_theta, "rope_type": m.rope_type}
    if m.rope_type == "llama3":
        rope |= {key: getattr(m, name) for name, key in LLAMA3_KEYS.items()}
    scaling = None if m.rope_type == "default" else {k: v for k, v in rope.items() if k != "rope_theta"}
    return architecture(m) | {
        "attention_bias": False, "attention_dropout": m.dropout,
        "bos_token_id": eot_id, "eos_token_id": eot_id, "dtype": dtype, "head_dim": m.head_size,
        "hidden_act": "silu", "hidden_size": m.n_embd, "initializer_range": 0.02,
        "intermediate_size": m.mlp_width, "max_position_embeddings": max(m.block_size, m.max_positions),
        "num_attention_heads": m.n_head, "num_hidden_layers": m.n_layer,
        "num_key_value_heads": m.kv_heads, "pad_token_id": None,
        "rms_norm_eps": m.norm_eps, "rope_parameters": rope, "rope_theta": m.rope_theta,
        "rope_scaling": scaling, "tie_word_embeddings": m.tie_embeddings, "use_cache": True,
        "vocab_size": vocab_size,
    }
