"""Hugging Face's mixtures of experts and jaxpar's Llama with experts (jaxpar.models.moe): Mixtral
(MixtralForCausalLM) and Qwen3-MoE (Qwen3MoeForCausalLM). Everything but the experts and the router
is Llama's (or Qwen3's, with q_norm and k_norm) and goes through jaxpar.interop.hf_llama.

HF saves each expert's SwiGLU as three Linear weights (out, in) under its own index; jaxpar stacks
the experts on an 'experts' axis and fuses gate and up: (layers, experts, embed, 2, mlp) and
(layers, experts, mlp, embed). Reading goes through lazy views, so a device of 'expert' reads only
its own experts' tensors. Variants whose math jaxpar does not compute are refused by name.
"""

from pathlib import Path

import jax
import numpy as np

from jaxpar.core.config import Config
from jaxpar.core.errors import UserError
from jaxpar.interop import hf_llama
from jaxpar.interop.hf_files import Stacked, find_tensor, slice_reader

# Each dialect's names: the router (E, C), and expert e's gate, up and down Linear weights.
DIALECTS = {
    "mixtral": {"router": "block_sparse_moe.gate.weight", "expert": "block_sparse_moe.experts.{e}.",
                "gate": "w1", "up": "w3", "down": "w2", "architecture": "MixtralForCausalLM"},
    "qwen3_moe": {"router": "mlp.gate.weight", "expert": "mlp.experts.{e}.",
                  "gate": "gate_proj", "up": "up_proj", "down": "down_proj", "architecture": "Qwen3MoeForCausalLM"},
}
EXPERT_PARAMS = ("router", "experts_gate_up", "experts_out")


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


def model_type(cfg: Config) -> str:
    """The HF architecture this model is (a key of DIALECTS): Qwen3-MoE with per-head QK-norm,
    else Mixtral."""
    m = cfg.model
    if m.qk_norm == "head":
        return "qwen3_moe"
    if m.qk_norm == "none" and m.moe_renormalize and not m.mixed_layers:
        return "mixtral"
    dense = f", moe_every={m.moe_every}, dense_layers='{m.dense_layers}'" if m.mixed_layers else ""
    raise UserError(f"no Hugging Face architecture jaxpar writes computes this mixture of experts (model.qk_norm="
                    f"{m.qk_norm}, moe_renormalize={m.moe_renormalize}{dense}): Mixtral renormalises, has no "
                    "QK-norm and experts in every layer; Qwen3-MoE has per-head QK-norm (qk_norm=head)")


def names_of(dialect: dict, key: str, i: int, e: int) -> list[str]:
    """The HF tensors of layer i's expert e that make jaxpar's `key`, in jaxpar's order."""
    prefix = hf_llama.LAYER.format(i=i) + dialect["expert"].format(e=e)
    parts = ("gate", "up") if key == "experts_gate_up" else ("down",)
    return [prefix + dialect[part] + ".weight" for part in parts]


def expert_views(tensors: dict, key: str, dialect: dict, i: int, shape: tuple, path: Path) -> Stacked:
    """Layer i's (experts, ...) param as a lazy stack of each expert's HF tensors."""
    hf_shape = (shape[-1], shape[1])  # (mlp, embed) of gate and up, (embed, mlp) of down: (out, in)
    per_expert = [[find_tensor(tensors, name, hf_shape, path).T for name in names_of(dialect, key, i, e)]
                  for e in range(shape[0])]
    return Stacked([Stacked(parts, axis=1) if len(parts) > 1 else parts[0] for parts in per_expert], axis=0)


def readers(tensors: dict, cfg: Config, vocab_size: int, declared: dict, path: Path) -> dict:
    """Llama's readers, and the router's and experts' (each layer's experts a lazy stack)."""
    dialect, layers = DIALECTS[model_type(cfg)], cfg.model.layers_in(declared[("blocks", "router", "kernel")].axes[0])
    dense = {key: param for key, param in declared.items() if key[0] != "blocks" or key[1] not in EXPERT_PARAMS}
    out = hf_llama.readers(tensors, cfg, vocab_size, dense, path)
    C, E = cfg.model.n_embd, cfg.model.n_experts
    out[("blocks", "router", "kernel")] = slice_reader(
        [find_tensor(tensors, hf_llama.LAYER.format(i=i) + dialect["router"], (E, C), path).T for i in layers], True)
    for key in ("experts_gate_up", "experts_out"):
        shape = declared[("blocks", key, "kernel")].shape[1:]
        out[("blocks", key, "kernel")] = slice_reader(
            [expert_views(tensors, key, dialect, i, shape, path) for i in layers], True)
    return out


def state_dict(params: dict, declared: dict, cfg: Config, vocab_size: int, dtype=np.float32) -> dict[str, np.ndarray]:
    """Llama's tensors, then the router's and every expert's under the dialect's names."""
    dialect = DIALECTS[model_type(cfg)]
    blocks = params["blocks"]
    dense = {**params, "blocks": {k: v for k, v in blocks.items() if k not in EXPERT_PARAMS}}
    out = hf_llama.state_dict(dense, declared, cfg, vocab_size, dtype)
    router, gate_up, down = (np.asarray(jax.device_get(blocks[k]["kernel"]), np.float32) for k in EXPERT_PARAMS)
    for at, i in enumerate(cfg.model.layers_in(declared[("blocks", "router", "kernel")].axes[0])):
        out[hf_llama.LAYER.format(i=i) + dialect["router"]] = np.ascontiguousarray(router[at].T, dtype)
        for e in range(cfg.model.n_experts):
            gate, up = names_of(dialect, "experts_gate_up", i, e)
            out[gate] = np.ascontiguousarray(gate_up[at, e, :, 0].T, dtype)
            out[up] = np.ascontiguousarray(gate_up[at, e, :, 1].T, dtype)
            out[names_of(dialect, "experts_out", i, e)[0]] = np.ascontiguousarray(down[at, e].T, dtype)
    return out


def hf_config(cfg: Config, vocab_size: int, eot_id: int | None, dtype: str = "float32") -> dict:
    """config.json of MixtralForCausalLM or Qwen3MoeForCausalLM, as transformers 5 writes it."""
    m, kind = cfg.model, model_type(cfg)
    config = hf_llama.hf_config(cfg, vocab_size, eot_id, dtype)
    for key in ("mlp_bias", "pretraining_tp", "max_window_layers"):
        config.pop(key, None)
    config |= {"architectures": [DIALECTS[kind]["architecture"]], "model_type": kind,
               "num_experts_per_tok": m.experts_per_token, "router_aux_loss_coef": m.router_aux_coef,
               "output_router_logits": False}
    if kind == "mixtral":
        return config | {"num_local_experts": m.n_experts, "intermediate_size": m.expert_width,
                         "router_jitter_noise": 0.0, "sliding_window": None}
    return config | {"num_experts": m.n_experts, "num_local_experts": m.n_experts,
                     "moe_intermediate_size": m.expert_width, "intermediate_size": m.mlp_width,
                     "norm_topk_prob": m.moe_renormalize, "decoder_sparse_step": m.moe_every,
                     "mlp_only_layers": list(m.dense_layer_ids)}
