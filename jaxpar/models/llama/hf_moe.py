"""Hugging Face's mixtures of experts and jaxpar's Llama with experts (jaxpar.nn.moe): Mixtral
(MixtralForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM). Everything but the experts and the router
is Llama's (or Qwen3's, with q_norm and k_norm) and goes through jaxpar.models.llama.hf.

HF saves each expert's SwiGLU as three Linear weights (out, in) under its own index; jaxpar stacks
the experts on an 'experts' axis and fuses gate and up: (layers, experts, embed, 2, mlp) and
(layers, experts, mlp, embed). Reading goes through lazy views, so a device of 'expert' reads only
its own experts' tensors. Variants whose math jaxpar does not compute are refused by name.
"""

from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import jax
import numpy as np

from jaxpar.core.config import ModelConfig
from jaxpar.core.errors import UserError
from jaxpar.formats.hf_mapping import Mapping, Weight
from jaxpar.models.llama import hf as hf_llama

EXPERT_PARAMS = ("router", "experts_gate_up", "experts_out")  # under 'blocks', each a kernel


class Dialect(NamedTuple):
    architecture: str  # config.json's
    mapping: Mapping  # Llama's table with the router's and the experts' names


def dialect(architecture: str, block: str, gate: str, up: str, down: str) -> Dialect:
    """A dialect's names of the router (E, C) and of expert {e}'s gate, up and down Linear weights."""
    expert = f"{block}.experts.{{e}}."
    weights = (Weight(f"{block}.gate.weight"), Weight((f"{expert}{gate}.weight", f"{expert}{up}.weight")),
               Weight(f"{expert}{down}.weight"))
    experts = {(name, "kernel"): weight for name, weight in zip(EXPERT_PARAMS, weights)}
    return Dialect(architecture, replace(hf_llama.MAPPING, blocks=hf_llama.MAPPING.blocks | experts))


DIALECTS = {"mixtral": dialect("MixtralForCausalLM", "block_sparse_moe", "w1", "w3", "w2"),
            "qwen3_moe": dialect("Qwen3MoeForCausalLM", "mlp", "gate_proj", "up_proj", "down_proj")}
LOADS = {kind: d.architecture for kind, d in DIALECTS.items()}  # the model_types computed here
# The MoEs jaxpar does not compute are read too, so that their refusals can say why.
MODEL_TYPES = (*LOADS, "qwen2_moe", "deepseek_v2")  # DeepSeek-V3's: jaxpar.models.deepseek.hf


def refused_variants(config: dict) -> list[str]:
    """What a config.json asks for that jaxpar's top-k softmax router over routed experts is not."""
    found = []
    shared = {key: config[key] for key in ("n_shared_experts", "num_shared_experts", "shared_expert_intermediate_size")
              if config.get(key)}
    found += [f"shared experts ({key}={value})" for key, value in shared.items()]
    if config.get("scoring_func", "softmax") != "softmax":
        found.append(f"{config['scoring_func']} routing (scoring_func={config['scoring_func']})")
    if (config.get("n_group") or 1) > 1 or (config.get("topk_group") or 1) > 1:
        found.append(f"grouped routing (n_group={config.get('n_group')}, topk_group={config.get('topk_group')})")
    if config.get("router_jitter_noise"):
        found.append(f"router jitter (router_jitter_noise={config['router_jitter_noise']})")
    if config.get("first_k_dense_replace"):
        found.append(f"DeepSeek's dense first layers (first_k_dense_replace={config['first_k_dense_replace']})")
    return found


def model_fields(config: dict, path: Path) -> tuple[list[tuple[str, object, str]], int, int]:
    """Llama's fields and the experts': their count, k, width, and whether the k weights renormalise."""
    kind = config.get("model_type")
    refused = refused_variants(config)
    if refused or kind not in DIALECTS:
        what = ", ".join(refused) or f"model_type {kind}"
        hf_llama.refuse(path, what, "jaxpar reads Mixtral and Qwen3-MoE: softmax top-k routing over routed "
                        "experts, no jitter")
    fields, vocab_size, positions = hf_llama.model_fields(config, path)
    fields = [field for field in fields if field[0] != "n_experts"]
    count_key = next((key for key in ("num_local_experts", "num_experts") if config.get(key)), None)
    width_key = "intermediate_size" if kind == "mixtral" else "moe_intermediate_size"
    if count_key is None or not config.get(width_key) or not config.get("num_experts_per_tok"):
        raise UserError(f"'{path}' lacks num_local_experts (or num_experts), num_experts_per_tok or {width_key}; "
                        "pass a complete config.json")
    renormalize = kind == "mixtral" or bool(config.get("norm_topk_prob", False))
    fields += [("n_experts", int(config[count_key]), f"{count_key}={config[count_key]}"),
               ("experts_per_token", int(config["num_experts_per_tok"]),
                f"num_experts_per_tok={config['num_experts_per_tok']}"),
               ("moe_mlp_dim", int(config[width_key]), f"{width_key}={config[width_key]}"),
               ("moe_renormalize", renormalize, "mixtral" if kind == "mixtral" else
                f"norm_topk_prob={config.get('norm_topk_prob', False)}")]
    return fields + sparse_layer_fields(config), vocab_size, positions


def sparse_layer_fields(config: dict) -> list[tuple[str, object, str]]:
    """Qwen3-MoE's dense layers: every decoder_sparse_step-th layer has experts, but mlp_only_layers."""
    step, dense = int(config.get("decoder_sparse_step") or 1), [int(i) for i in config.get("mlp_only_layers") or []]
    return [("moe_every", step, f"decoder_sparse_step={step}"),
            ("dense_layers", ",".join(map(str, dense)), f"mlp_only_layers={dense}")]


def model_type(m: ModelConfig) -> str:
    """The HF architecture this model is (a key of DIALECTS): Qwen3-MoE with per-head QK-norm,
    else Mixtral."""
    if m.qk_norm == "head":
        return "qwen3_moe"
    if m.qk_norm == "none" and m.moe_renormalize and not m.mixed_layers:
        return "mixtral"
    dense = f", moe_every={m.moe_every}, dense_layers='{m.dense_layers}'" if m.mixed_layers else ""
    raise UserError(f"no Hugging Face architecture jaxpar writes computes this mixture of experts (model.qk_norm="
                    f"{m.qk_norm}, moe_renormalize={m.moe_renormalize}{dense}): Mixtral renormalises, has no "
                    "QK-norm and experts in every layer; Qwen3-MoE has per-head QK-norm (qk_norm=head)")


def readers(tensors: dict, m: ModelConfig, vocab_size: int, declared: dict, path: Path) -> dict:
    """Llama's readers, the router's and the experts' last (each layer's experts a lazy stack)."""
    ordered = sorted(declared.items(), key=lambda item: item[0][0] == "blocks" and item[0][1] in EXPERT_PARAMS)
    return hf_llama.readers(tensors, m, vocab_size, dict(ordered), path, DIALECTS[model_type(m)].mapping)


def state_dict(params: dict, declared: dict, m: ModelConfig, vocab_size: int,
               dtype=np.float32) -> dict[str, np.ndarray]:
    """Llama's tensors, then layer by layer the router's and expert by expert its tensors."""
    mapping, blocks = DIALECTS[model_type(m)].mapping, params["blocks"]
    dense = {**params, "blocks": {k: v for k, v in blocks.items() if k not in EXPERT_PARAMS}}
    out = mapping.state_dict(dense, declared, m, vocab_size, dtype)
    kernels = [(("blocks", name, "kernel"), np.asarray(jax.device_get(blocks[name]["kernel"]), np.float32))
               for name in EXPERT_PARAMS]
    (router, routes), *experts = kernels
    for at, i in enumerate(m.layers_in(declared[router].axes[0])):
        out |= mapping.hf_tensors(router, declared[router], routes[at], dtype, i=i)
        for e in range(m.n_experts):
            for key, array in experts:
                out |= mapping.hf_tensors(key, declared[key], array[at, e], dtype, i=i, e=e)
    return out


def hf_config(m: ModelConfig, vocab_size: int, eot_id: int | None, dtype: str = "float32") -> dict:
    """config.json of MixtralForCausalLM or Qwen3MoeForCausalLM, as transformers 5 writes it."""
    kind = model_type(m)
    config = hf_llama.hf_config(m, vocab_size, eot_id, dtype)
    for key in ("mlp_bias", "pretraining_tp", "max_window_layers"):
        config.pop(key, None)
    config |= {"architectures": [DIALECTS[kind].architecture], "model_type": kind,
               "num_experts_per_tok": m.experts_per_token, "router_aux_loss_coef": m.router_aux_coef,
               "output_router_logits": False}
    if kind == "mixtral":
        return config | {"num_local_experts": m.n_experts, "intermediate_size": m.expert_width,
                         "router_jitter_noise": 0.0, "sliding_window": None}
    return config | {"num_experts": m.n_experts, "num_local_experts": m.n_experts,
                     "moe_intermediate_size": m.expert_width, "intermediate_size": m.mlp_width,
                     "norm_topk_prob": m.moe_renormalize, "decoder_sparse_step": m.moe_every,
                     "mlp_only_layers": list(m.dense_layer_ids)}
