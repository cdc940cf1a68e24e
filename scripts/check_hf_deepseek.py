"""Check jaxpar's Hugging Face DeepSeek-V3 in/out end to end against real transformers, on Tiny Shakespeare:
scripts/check_hf_llama.py's three checks on a random DeepseekV3ForCausalLM.

Needs torch and transformers 5.x, which jaxpar itself never does: run it in a separate venv, and point
--jaxpar-python at a Python that has jaxpar:

    /tmp/hf-venv/bin/python scripts/check_hf_deepseek.py --arch lora [--jaxpar-python .venv/bin/python]
    /tmp/hf-venv/bin/python scripts/check_hf_deepseek.py --arch bf16

The model: hidden 64, 3 layers (the first dense, intermediate 192), 4 heads of MLA (a key-value latent of 32,
query-key heads of 16 + 8 rotated dims in DeepSeek's interleaved pairs, values of 16), routed experts of width
48 beside one shared expert, a non-zero e_score_correction_bias, a character-level tokenizer, every RMSNorm
weight moved off 1. `lora`: a query bottleneck of 32, 8 routed experts in 4 groups (top-2 within the best 2),
routed_scaling_factor 2.5, float32. `bf16`: no query bottleneck (q_proj), 4 experts in 2 groups (top-2 within
the best 1), saved in bfloat16. The checks, each printing its numbers and PASS/FAIL:

  1. `jaxpar.eval --hf` gives transformers' loss over every 256-token block of val, within 1e-4 relative;
  2. `jaxpar.sample --hf --temperature 0`, on one device and on ep=2,tp=2, gives transformers' greedy text;
  3. after 20 steps of `jaxpar.train --init-from` on ep=2,tp=2, `jaxpar.export` loads in transformers, which
     gives the greedy text of `jaxpar.sample --ckpt` and jaxpar's logits (max abs diff <= 1e-3).

It exits 1 if any check fails. CPU only, a few minutes. WORK defaults to /tmp/check_hf_deepseek_ARCH.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_hf_llama as check

ARCHS = ("lora", "bf16")
DEEPSEEK = {key: check.LLAMA[key] for key in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
                                              "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                                              "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id",
                                              "initializer_range")} | {
    "num_hidden_layers": 3, "num_key_value_heads": check.LLAMA["num_attention_heads"], "first_k_dense_replace": 1,
    "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "moe_intermediate_size": 48,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
VARIANTS = {"lora": {"q_lora_rank": 32, "n_routed_experts": 8, "n_group": 4, "topk_group": 2,
                     "routed_scaling_factor": 2.5},
            "bf16": {"q_lora_rank": None, "n_routed_experts": 4, "n_group": 2, "topk_group": 1,
                     "routed_scaling_factor": 1.0}}


def build_deepseek(arch: str):
    """The random DeepSeek-V3 as the fixtures make theirs (eager attention, every RMSNorm weight moved
    off 1, the routers' correction biases drawn); in bfloat16 for `bf16`."""
    from make_hf_deepseek_fixtures import build
    from transformers import DeepseekV3Config
    model = build(DeepseekV3Config(**DEEPSEEK, **VARIANTS[arch], attn_implementation="eager"), check.SEED)
    return (model.to(torch.bfloat16) if arch == "bf16" else model).eval()


if __name__ == "__main__":
    arch = sys.argv[sys.argv.index("--arch") + 1] if "--arch" in sys.argv else "lora"
    if arch not in ARCHS:
        sys.exit(f"--arch must be one of {', '.join(ARCHS)}")
    sys.argv = [a for i, a in enumerate(sys.argv) if a != "--arch" and sys.argv[i - 1] != "--arch"]
    check.main(lambda: build_deepseek(arch), ("dp=1", "ep=2,tp=2"), "ep=2,tp=2", f"/tmp/check_hf_deepseek_{arch}",
               __doc__)
