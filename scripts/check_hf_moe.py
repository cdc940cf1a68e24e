"""Check jaxpar's Hugging Face mixtures of experts (Mixtral, Qwen3-MoE) in/out end to end against real
transformers, on Tiny Shakespeare: scripts/check_hf_llama.py's three checks on a random MoE.

Needs torch and transformers 5.x, which jaxpar itself never does: run it in a separate venv, and point
--jaxpar-python at a Python that has jaxpar:

    /tmp/torchref-venv/bin/python scripts/check_hf_moe.py --arch mixtral [--jaxpar-python .venv/bin/python]
    /tmp/torchref-venv/bin/python scripts/check_hf_moe.py --arch qwen3_moe
    /tmp/torchref-venv/bin/python scripts/check_hf_moe.py --arch qwen3_moe_mixed

The model: hidden 64, 2 layers, GQA 4/2 heads, 4 experts of width 96, top-2, untied lm_head, a
character-level tokenizer. Mixtral renormalises the top-2 weights; Qwen3-MoE does not (norm_topk_prob
false) and has head_dim 32 (not hidden / heads) and per-head q_norm/k_norm. qwen3_moe_mixed is that
Qwen3-MoE with 4 layers, dense ones between the sparse: decoder_sparse_step 2 and mlp_only_layers [3], so
layer 1 alone has experts and the others a dense MLP of width 192. Every RMSNorm weight is moved off 1.
The checks, each printing its numbers and PASS/FAIL:

  1. `jaxpar.eval --hf` gives transformers' loss over every 256-token block of val, within 1e-4 relative;
  2. `jaxpar.sample --hf --temperature 0`, on one device and on ep=2,tp=2, gives transformers' greedy text;
  3. after 20 steps of `jaxpar.train --init-from` on ep=2,tp=2, `jaxpar.export` loads in transformers, which
     gives the greedy text of `jaxpar.sample --ckpt` and jaxpar's logits (max abs diff <= 1e-3).

It exits 1 if any check fails. CPU only, a few minutes. WORK defaults to /tmp/check_hf_moe_ARCH.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_hf_llama as check  # noqa: E402

ARCHS = ("mixtral", "qwen3_moe", "qwen3_moe_mixed")
MOE = {key: check.LLAMA[key] for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                         "num_key_value_heads", "max_position_embeddings", "rms_norm_eps",
                                         "tie_word_embeddings", "hidden_act", "bos_token_id", "eos_token_id",
                                         "pad_token_id", "initializer_range")} | {
    "num_experts_per_tok": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def build_moe(arch: str):
    """The random Mixtral or Qwen3-MoE in float32, eager attention, every RMSNorm weight moved off 1."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(check.SEED)
    if arch == "mixtral":
        config = MixtralConfig(**MOE, intermediate_size=96, num_local_experts=4, attn_implementation="eager")
        model = MixtralForCausalLM(config)
    else:
        mixed = {"num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
        mixed = mixed if arch.endswith("mixed") else {}
        config = Qwen3MoeConfig(**(MOE | mixed), intermediate_size=192, moe_intermediate_size=96, num_experts=4,
                                head_dim=32, norm_topk_prob=False, attn_implementation="eager")
        model = Qwen3MoeForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model.eval()


if __name__ == "__main__":
    arch = sys.argv[sys.argv.index("--arch") + 1] if "--arch" in sys.argv else "mixtral"
    if arch not in ARCHS:
        sys.exit(f"--arch must be one of {', '.join(ARCHS)}")
    sys.argv = [a for i, a in enumerate(sys.argv) if a != "--arch" and sys.argv[i - 1] != "--arch"]
    check.main(lambda: build_moe(arch), ("dp=1", "ep=2,tp=2"), "ep=2,tp=2", f"/tmp/check_hf_moe_{arch}", __doc__)
