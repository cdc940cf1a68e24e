"""Hugging Face's DeepseekV3ForCausalLM and jaxpar's DeepSeek family: config.json's fields and the
weights' names, both ways; also the configs of Moonlight (model_type deepseek_v3) and Kimi K2
(kimi_k2), which reuse the architecture. Used through jaxpar.models.hf.

jaxpar lays MLA's weights out as HF does (model.py): `kv_a` is kv_a_proj_with_mqa (the latent, then
the rotated key), `kv_b` is kv_b_proj (each head's unrotated key, then its value), and with
rope_interleave the rotated dims stay in DeepSeek's pairs. So every weight maps with a transpose
and a reshape, as Llama's do; the router's e_score_correction_bias is the balance bias, and each
expert's and the shared experts' gate, up and down projections are Mixtral's kind of tensors.
Multi-token prediction modules are written where DeepSeek's checkpoints keep them, as layers past
num_hidden_layers (their block's weights, enorm, hnorm, eh_proj, shared_head.norm, and copies of
the embedding and the head), and config.json's num_nextn_predict_layers counts them. jaxpar reads
them back where a checkpoint holds them (DeepSeek's own do; the copies of the embedding and the
head are not read, since the modules share the main model's); transformers builds and saves none,
so its checkpoints give mtp_layers 0.
"""

import json
from pathlib import Path

import numpy as np

from jaxpar.core.config import ModelConfig
from jaxpar.core.errors import UserError
from jaxpar.formats.hf_files import EXPECTED, is_a, open_weights, slice_reader
from jaxpar.formats.hf_mapping import Mapping, Weight, host_arrays
from jaxpar.models.llama import hf as hf_llama

LOADS = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM"}  # model_type: architecture
MODEL_TYPES = tuple(LOADS)
EXPERT = "mlp.experts.{e}."
MAPPING = Mapping(layer="model.layers.{i}.", out_first=True, blocks={
    ("attn_norm", "scale"): Weight("input_layernorm.weight"),
    ("q_a", "kernel"): Weight("self_attn.q_a_proj.weight"),
    ("q_a_norm", "scale"): Weight("self_attn.q_a_layernorm.weight"),
    ("q_b", "kernel"): Weight("self_attn.q_b_proj.weight", (1, 2)),  # (latent, heads, head_dim)
    ("q", "kernel"): Weight("self_attn.q_proj.weight", (1, 2)),  # without a query bottleneck
    ("kv_a", "kernel"): Weight("self_attn.kv_a_proj_with_mqa.weight"),
    ("kv_a_norm", "scale"): Weight("self_attn.kv_a_layernorm.weight"),
    ("kv_b", "kernel"): Weight("self_attn.kv_b_proj.weight", (1, 2)),
    ("attn_out", "kernel"): Weight("self_attn.o_proj.weight", (2, 1)),  # (heads, head_dim, embed)
    ("mlp_norm", "scale"): Weight("post_attention_layernorm.weight"),
    ("gate_up", "kernel"): Weight(("mlp.gate_proj.weight", "mlp.up_proj.weight")),  # the dense first layers
    ("mlp_out", "kernel"): Weight("mlp.down_proj.weight"),
    ("router", "kernel"): Weight("mlp.gate.weight"),
    ("router", "balance"): Weight("mlp.gate.e_score_correction_bias"),
    ("experts_gate_up", "kernel"): Weight((f"{EXPERT}gate_proj.weight", f"{EXPERT}up_proj.weight")),
    ("experts_out", "kernel"): Weight(f"{EXPERT}down_proj.weight"),
    ("shared_gate_up", "kernel"): Weight(("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")),
    ("shared_out", "kernel"): Weight("mlp.shared_experts.down_proj.weight"),
}, top=hf_llama.MAPPING.top)
MTP_MAPPING = Mapping(layer="model.layers.{i}.", out_first=True, top={}, blocks={
    ("enorm", "scale"): Weight("enorm.weight"), ("hnorm", "scale"): Weight("hnorm.weight"),
    ("eh_proj", "kernel"): Weight("eh_proj.weight"), ("norm", "scale"): Weight("shared_head.norm.weight")})
FIELDS = [  # (jaxpar's model field, config.json's key, its type)
    ("n_layer", "num_hidden_layers", int), ("n_head", "num_attention_heads", int), ("n_embd", "hidden_size", int),
    ("mlp_dim", "intermediate_size", int), ("kv_lora_rank", "kv_lora_rank", int),
    ("qk_nope_head_dim", "qk_nope_head_dim", int), ("qk_rope_head_dim", "qk_rope_head_dim", int),
    ("v_head_dim", "v_head_dim", int), ("n_experts", "n_routed_experts", int),
    ("experts_per_token", "num_experts_per_tok", int), ("moe_mlp_dim", "moe_intermediate_size", int),
    ("n_shared_experts", "n_shared_experts", int), ("n_group", "n_group", int), ("topk_group", "topk_group", int),
    ("routed_scaling_factor", "routed_scaling_factor", float)]
# The type of each config.json field read here beyond every format's (jaxpar.formats.hf_files checks
# those), checked by jaxpar.models.hf before any is read; a null only where MAY_BE_NULL says it
# stands for unset, as transformers reads it (no query bottleneck, no prediction modules, false).
FIELD_TYPES = {key: kind for _, key, kind in FIELDS} | {
    "first_k_dense_replace": int, "q_lora_rank": int, "num_nextn_predict_layers": int, "rope_interleave": bool,
    "topk_method": str}
MAY_BE_NULL = {"q_lora_rank", "num_nextn_predict_layers", "rope_interleave"}


def check_supported(config: dict, path: Path) -> None:
    """What jaxpar's DeepSeek does not compute, refused by name."""
    why = {"quantization_config": "quantized weights (quantization_config): pass a bf16 or f32 checkpoint",
           "attention_bias": "biases in attention (attention_bias=true)"}
    for key, what in why.items():
        if config.get(key):
            hf_llama.refuse(path, what, "jaxpar's DeepSeek computes DeepseekV3ForCausalLM's math")
    if config.get("scoring_func", "sigmoid") != "sigmoid" or config.get("topk_method", "noaux_tc") != "noaux_tc":
        hf_llama.refuse(path, f"{config.get('scoring_func')} routing by {config.get('topk_method')}",
                        "jaxpar routes as DeepSeek-V3 does: sigmoid scores, noaux_tc")
    heads = config.get("num_key_value_heads") or config.get("num_attention_heads")
    if heads != config.get("num_attention_heads"):
        hf_llama.refuse(path, f"num_key_value_heads={heads} unlike num_attention_heads",
                        "MLA gives every head its own key and value")
    if config.get("hidden_act", "silu") != "silu":
        hf_llama.refuse(path, f"hidden_act '{config['hidden_act']}'", "its SwiGLU uses silu")


def model_fields(config: dict, path: Path) -> tuple[list[tuple[str, object, str]], int, int]:
    """([(model field, value, where config.json says so)], vocab_size, positions it can see)."""
    check_supported(config, path)
    try:
        fields = [(field, kind(config[key]), f"{key}={config[key]}") for field, key, kind in FIELDS]
        vocab_size, positions = int(config["vocab_size"]), int(config.get("max_position_embeddings", 4096))
        dense = int(config["first_k_dense_replace"])
    except KeyError as e:  # the types are checked first: only a missing field gets here
        raise UserError(f"'{path}' has no {e.args[0]}; pass a complete DeepSeek-V3 config.json") from None
    q_rank, eps = int(config.get("q_lora_rank") or 0), float(config.get("rms_norm_eps", 1e-6))
    tied, interleave = bool(config.get("tie_word_embeddings", False)), bool(config.get("rope_interleave", True))
    fields += [("family", "deepseek", f"model_type={config.get('model_type')}"),
               ("q_lora_rank", q_rank, f"q_lora_rank={config.get('q_lora_rank')}"),
               ("rope_interleave", interleave, f"rope_interleave={config.get('rope_interleave', True)}"),
               ("moe_renormalize", bool(config.get("norm_topk_prob", True)),
                f"norm_topk_prob={config.get('norm_topk_prob', True)}"),
               ("dense_layers", ",".join(map(str, range(dense))), f"first_k_dense_replace={dense}"),
               ("moe_every", 1, "first_k_dense_replace"), ("norm_eps", eps, f"rms_norm_eps={eps}"),
               ("mtp_layers", *mtp_held(config, path)),
               ("tie_embeddings", tied, f"tie_word_embeddings={str(tied).lower()}"),
               ("max_positions", positions, f"max_position_embeddings={positions}")]
    return fields + rope_fields(config, path, positions), vocab_size, positions


YARN = {"rope_factor": ("factor", float), "rope_original_max_position": ("original_max_position_embeddings", int),
        "rope_beta_fast": ("beta_fast", float), "rope_beta_slow": ("beta_slow", float),
        "rope_mscale": ("mscale", float), "rope_mscale_all_dim": ("mscale_all_dim", float)}
YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.0, "mscale_all_dim": 0.0}


def rope_fields(config: dict, path: Path, positions: int) -> list[tuple[str, object, str]]:
    """Llama's rope fields, or YaRN's (DeepSeek-V3's long context), as transformers reads them."""
    rope = {**(config.get("rope_scaling") or {}), **(config.get("rope_parameters") or {})}
    if rope.get("rope_type", rope.get("type")) != "yarn":
        return hf_llama.rope_fields(config, path)
    if rope.get("attention_factor") is not None or rope.get("truncate", True) is False:
        hf_llama.refuse(path, "YaRN with attention_factor or truncate=false", "it computes YaRN's defaults")
    try:
        rope = YARN_DEFAULTS | {k: v for k, v in rope.items() if v is not None}
        check_yarn_fields(rope, config, path)
        rope.setdefault("factor", positions / int(rope["original_max_position_embeddings"]))
        theta = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
        return [("rope_theta", theta, f"rope_theta={theta}"), ("rope_type", "yarn", "rope type yarn"),
                *((name, kind(rope[key]), f"{key}={rope[key]}") for name, (key, kind) in YARN.items())]
    except KeyError as e:
        raise UserError(f"'{path}': yarn rope scaling without {e.args[0]}; pass a complete config.json") from None


def check_yarn_fields(rope: dict, config: dict, path: Path) -> None:
    """YaRN's fields of their types (hf_files checks Llama's), the original context positive."""
    for key, kind in YARN.values():
        if key in rope and not is_a(kind, rope[key]):
            where = "rope_parameters" if key in (config.get("rope_parameters") or {}) else "rope_scaling"
            raise UserError(f"'{path}': {where}.{key} must be {EXPECTED[kind]}, got {json.dumps(rope[key])}; "
                            "correct that field, or save the model again with save_pretrained")
    if rope["original_max_position_embeddings"] < 1:
        raise UserError(f"'{path}': yarn's original_max_position_embeddings must be positive, got "
                        f"{rope['original_max_position_embeddings']}; correct that field")


def mtp_held(config: dict, path: Path) -> tuple[int, str]:
    """(the multi-token prediction modules to read, where that comes from): num_nextn_predict_layers
    where the checkpoint holds their weights, 0 where it holds none."""
    stated, layers = int(config.get("num_nextn_predict_layers") or 0), int(config["num_hidden_layers"])
    if not stated:
        return 0, "num_nextn_predict_layers=0"
    names = open_weights(path.parent)[0]
    held = sum(f"model.layers.{layers + k}.eh_proj.weight" in names for k in range(stated))
    if held == 0:
        return 0, f"num_nextn_predict_layers={stated} with no module's weights (transformers saves none)"
    if held < stated:
        raise UserError(f"'{path}' says num_nextn_predict_layers={stated}, and its weights hold {held} "
                        "modules; pass a complete checkpoint")
    return stated, f"num_nextn_predict_layers={stated}"


def readers(tensors: dict, m: ModelConfig, vocab_size: int, declared: dict, path: Path) -> dict:
    """{param path: make_array_from_callback's reader} for every declared param, all checked;
    module k's from layer n_layer + k."""
    main = {key: param for key, param in declared.items() if key[0] != "mtp"}
    out = hf_llama.readers(tensors, m, vocab_size, main, path, MAPPING)
    for key, param in declared.items():
        if key[0] == "mtp":
            mapping, name = mtp_mapping(key[1:])
            out[key] = slice_reader([mapping.view(tensors, name, param, param.shape[1:], path, "",
                                                  m.n_layer + k) for k in range(m.mtp_layers)], True)
    return out


def state_dict(params: dict, declared: dict, m: ModelConfig, vocab_size: int,
               dtype=np.float32) -> dict[str, np.ndarray]:
    """jaxpar's params as DeepseekV3ForCausalLM.save_pretrained writes them, then the
    multi-token prediction modules as DeepSeek's checkpoints keep them."""
    check_exportable(m)
    out = MAPPING.state_dict({k: v for k, v in params.items() if k != "mtp"}, declared, m, vocab_size, dtype)
    return out | (mtp_tensors(params["mtp"], declared, m, out, dtype) if "mtp" in params else {})


def mtp_tensors(mtp: dict, declared: dict, m: ModelConfig, main: dict, dtype) -> dict[str, np.ndarray]:
    """Module k's tensors as layer n_layer + k - 1's: its block's under the main layers' names."""
    out, L = {}, m.n_layer
    head = main.get("lm_head.weight", main["model.embed_tokens.weight"])
    for key, array in host_arrays(mtp):
        mapping, name = mtp_mapping(key)
        for k in range(m.mtp_layers):
            out |= mapping.hf_tensors(name, declared[("mtp", *key)], array[k], dtype, i=L + k)
    for k in range(m.mtp_layers):
        out |= {f"model.layers.{L + k}.embed_tokens.weight": main["model.embed_tokens.weight"],
                f"model.layers.{L + k}.shared_head.head.weight": head}
    return out


def mtp_mapping(key: tuple) -> tuple[Mapping, tuple]:
    """(the table, the key as a layer's) of a param under 'mtp': its block's are a main layer's."""
    return (MAPPING, ("blocks", *key[1:])) if key[0] == "block" else (MTP_MAPPING, ("blocks", *key))


def check_exportable(m: ModelConfig) -> None:
    if not m.n_experts or m.dense_layer_ids != tuple(range(len(m.dense_layer_ids))) or m.moe_every != 1:
        raise UserError(f"DeepseekV3ForCausalLM has experts in every layer after its first dense ones "
                        f"(first_k_dense_replace), and this model has n_experts={m.n_experts}, dense_layers="
                        f"'{m.dense_layers}', moe_every={m.moe_every}; train one laid out so to export it")


def hf_config(m: ModelConfig, vocab_size: int, eot_id: int | None, dtype: str = "float32") -> dict:
    """config.json of DeepseekV3ForCausalLM, as transformers 5 writes it."""
    check_exportable(m)
    rope = {"rope_theta": m.rope_theta, "rope_type": m.rope_type}
    if m.rope_type == "yarn":
        rope |= {key: getattr(m, name) or None for name, (key, _) in YARN.items()}
    elif m.rope_type == "llama3":
        rope |= {key: getattr(m, name) for name, key in hf_llama.LLAMA3_KEYS.items()}
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "attention_bias": False,
        "attention_dropout": m.dropout, "bos_token_id": eot_id, "eos_token_id": eot_id, "dtype": dtype,
        "first_k_dense_replace": len(m.dense_layer_ids), "head_dim": m.qk_rope_head_dim, "hidden_act": "silu",
        "hidden_size": m.n_embd, "initializer_range": 0.02, "intermediate_size": m.mlp_width,
        "kv_lora_rank": m.kv_lora_rank, "max_position_embeddings": max(m.block_size, m.max_positions),
        "moe_intermediate_size": m.expert_width, "n_group": m.n_group, "n_routed_experts": m.n_experts,
        "n_shared_experts": m.n_shared_experts, "norm_topk_prob": m.moe_renormalize,
        "num_attention_heads": m.n_head, "num_experts_per_tok": m.experts_per_token, "num_hidden_layers": m.n_layer,
        "num_key_value_heads": m.n_head, "num_nextn_predict_layers": m.mtp_layers, "output_router_logits": False,
        "pad_token_id": None, "pretraining_tp": 1,
        "q_lora_rank": m.q_lora_rank or None, "qk_head_dim": m.head_size, "qk_nope_head_dim": m.qk_nope_head_dim,
        "qk_rope_head_dim": m.qk_rope_head_dim, "rms_norm_eps": m.norm_eps, "rope_interleave": m.rope_interleave,
        "rope_parameters": rope, "routed_scaling_factor": m.routed_scaling_factor,
        "tie_word_embeddings": m.tie_embeddings, "topk_group": m.topk_group, "use_cache": True,
        "v_head_dim": m.v_head_dim, "vocab_size": vocab_size,
    }
