"""Make the Hugging Face DeepSeek-V3 test fixtures with real transformers.

Needs torch and transformers 5.x, which jaxpar itself never does: run it in a separate venv, e.g.

    python3 -m venv /tmp/hf-venv && /tmp/hf-venv/bin/pip install torch "transformers==5.24.*" safetensors
    /tmp/hf-venv/bin/python scripts/make_hf_deepseek_fixtures.py      # writes tests/fixtures/hf_deepseek_*

It writes tiny random DeepseekV3ForCausalLM checkpoints (vocab 101), each with save_pretrained, its
input_ids.npy (int32, from numpy's default_rng(1234)) and transformers' float32 logits.npy on it
(eager attention, eval, no grad):

    hf_deepseek_v3        MLA with a query bottleneck (q_lora_rank 16, kv_lora_rank 16, heads of 8 + 4
                          query-key dims and 8 value dims), 3 layers, the first dense
                          (first_k_dense_replace 1), 8 routed experts in 4 groups (top-2 within the best
                          2) beside 1 shared expert, routed_scaling_factor 2.5, a non-zero
                          e_score_correction_bias, interleaved rotary dims (rope_interleave), float32
    hf_deepseek_v3_yarn   YaRN rope scaling (factor 4 over an original 16 positions, mscale and mscale_all_dim 1):
                          cos and sin scaled, the scores by mscale^2; 2 layers, 4 experts in 2 groups, float32
    hf_deepseek_v3_bf16   no query bottleneck (q_proj), 2 layers, the first dense, 4 experts in 2 groups
                          (top-2 within the best 1), tied embeddings, saved in bfloat16: its logits those of
                          the bf16 weights upcast to float32

Every RMSNorm weight is moved off 1. The script prints how many tokens each expert receives, so that
a fixture is known to route to every expert, and each config.json.
"""

import sys
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_hf_moe_fixtures import INPUT_SEED, main, save_checked
from make_hf_moe_fixtures import build as build_moe

COMMON = {"vocab_size": 101, "hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 4,
          "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "num_experts_per_tok": 2, "kv_lora_rank": 16,
          "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "intermediate_size": 40,
          "moe_intermediate_size": 16, "n_shared_experts": 1, "first_k_dense_replace": 1,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "bos_token_id": 0, "eos_token_id": 0,
          "initializer_range": 0.2,  # 0.02 gives logits near 0 and a near-uniform router: a weaker test
          "attn_implementation": "eager"}
FIXTURE_SPECS = {  # name: (config, torch seed, input shape, saved dtype)
    "hf_deepseek_v3": (DeepseekV3Config(
        **COMMON, num_hidden_layers=3, q_lora_rank=16, n_routed_experts=8, n_group=4, topk_group=2,
        routed_scaling_factor=2.5, tie_word_embeddings=False), 1240, (2, 32), torch.float32),
    "hf_deepseek_v3_yarn": (DeepseekV3Config(
        **(COMMON | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                         "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                                         "mscale": 1.0, "mscale_all_dim": 1.0}}),
        num_hidden_layers=2, q_lora_rank=16, n_routed_experts=4, n_group=2, topk_group=1,
        routed_scaling_factor=1.0, tie_word_embeddings=False), 1242, (2, 32), torch.float32),
    "hf_deepseek_v3_bf16": (DeepseekV3Config(
        **COMMON, num_hidden_layers=2, q_lora_rank=None, n_routed_experts=4, n_group=2, topk_group=1,
        routed_scaling_factor=1.0, tie_word_embeddings=True), 1241, (2, 32), torch.bfloat16),
}


def build(config, seed: int):
    """The MoE fixtures' random model (every RMSNorm weight moved off its init of 1), each
    router's correction bias then drawn at about the scores' spread (so it changes some choices)."""
    model = build_moe(DeepseekV3ForCausalLM, config, seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.1 * torch.randn_like(buffer))
    return model


def logits_and_load(model, input_ids: np.ndarray) -> tuple[np.ndarray, list]:
    """transformers' float32 logits, and each sparse layer's tokens per expert (its router's choice)."""
    load, hooks = [], []
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            E = layer.mlp.gate.num_experts
            hooks.append(layer.mlp.gate.register_forward_hook(
                lambda _, __, out, E=E: load.append(torch.bincount(out[2].flatten(), minlength=E).tolist())))
    with torch.no_grad():
        logits = model(torch.from_numpy(input_ids.astype(np.int64))).logits.float().numpy()
    for hook in hooks:
        hook.remove()
    return logits, load


def make_fixture(out: Path, spec: tuple) -> None:
    config, seed, input_shape, dtype = spec
    model = build(config, seed)
    input_ids = np.random.default_rng(INPUT_SEED).integers(0, config.vocab_size, input_shape).astype(np.int32)
    in_memory, load = logits_and_load(model, input_ids)
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out)
    reloaded = DeepseekV3ForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    save_checked(out, input_ids, logits_and_load(reloaded, input_ids)[0], in_memory, load, dtype)


if __name__ == "__main__":
    main(__doc__, FIXTURE_SPECS, make_fixture)
