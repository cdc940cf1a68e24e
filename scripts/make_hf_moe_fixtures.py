"""Make the Hugging Face mixture-of-experts (and Qwen3) test fixtures with real transformers.

Needs torch and transformers 5.x, which jaxpar itself never does: run it in a separate venv, e.g.

    bash ../shared/bench/setup_torch_ref.sh && /tmp/torchref-venv/bin/pip install "transformers==5.24.*" safetensors
    /tmp/torchref-venv/bin/python scripts/make_hf_moe_fixtures.py      # writes tests/fixtures/hf_moe_*

It writes tiny random checkpoints (vocab 101), each with save_pretrained, its input_ids.npy (int32, from
numpy's default_rng(1234)) and transformers' float32 logits.npy on it (eager attention, eval, no grad):

    hf_moe_mixtral   MixtralForCausalLM: 4 experts, top-2 (renormalised), GQA 4/2, untied, in 2 shards
    hf_moe_qwen3     Qwen3MoeForCausalLM: 6 experts, top-2 without renormalisation (norm_topk_prob false),
                     head_dim 16 with hidden 32 and 4 heads, per-head q_norm/k_norm, tied embeddings;
                     saved in bfloat16, its logits those of the bf16 weights upcast to float32
    hf_moe_qwen3_mixed  Qwen3MoeForCausalLM with dense layers between the sparse ones: 4 layers,
                     decoder_sparse_step 2 and mlp_only_layers [3], so only layer 1 has its 4 experts
                     (renormalised); the others a dense MLP 40 wide
    hf_qwen3_dense   Qwen3ForCausalLM: the dense Qwen3 (head_dim 16, per-head q_norm/k_norm, untied)

Every RMSNorm weight (q_norm and k_norm too) is moved off 1. The script prints how many tokens each
expert receives, so that a fixture is known to route to every expert, and each config.json.
"""

import argparse
from pathlib import Path

import numpy as np
import torch
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
INPUT_SEED = 1234
COMMON = {"vocab_size": 101, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "num_experts_per_tok": 2,
          "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "bos_token_id": 0, "eos_token_id": 0,
          "initializer_range": 0.2,  # 0.02 gives logits near 0 and a near-uniform router: a weaker test
          "attn_implementation": "eager"}
FIXTURE_SPECS = {  # name: (model class, config, torch seed, input shape, saved dtype, max_shard_size)
    "hf_moe_mixtral": (MixtralForCausalLM, MixtralConfig(
        **COMMON, intermediate_size=24, num_local_experts=4, tie_word_embeddings=False), 1234, (2, 16),
        torch.float32, "40KB"),
    "hf_moe_qwen3": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **COMMON, intermediate_size=40, moe_intermediate_size=16, num_experts=6, head_dim=16, norm_topk_prob=False,
        tie_word_embeddings=True), 1235, (2, 16), torch.bfloat16, None),
    "hf_moe_qwen3_mixed": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
        **(COMMON | {"num_hidden_layers": 4}), intermediate_size=40, moe_intermediate_size=16, num_experts=4,
        head_dim=16, norm_topk_prob=True, decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=False),
        1237, (2, 16), torch.float32, None),
    "hf_qwen3_dense": (Qwen3ForCausalLM, Qwen3Config(
        **{k: v for k, v in COMMON.items() if k != "num_experts_per_tok"}, intermediate_size=40, head_dim=16,
        tie_word_embeddings=False), 1236, (2, 16), torch.float32, None),
}


def build(model_class, config, seed: int):
    """A random model in float32, every RMSNorm weight moved off its init of 1."""
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.1 * torch.randn_like(param))
    return model


def logits_and_load(model, input_ids: np.ndarray) -> tuple[np.ndarray, list]:
    """transformers' float32 logits, and each layer's tokens per expert (from its router's logits)."""
    with torch.no_grad():
        out = model(torch.from_numpy(input_ids.astype(np.int64)), output_router_logits=True)
    k, E = model.config.num_experts_per_tok, out.router_logits[0].shape[-1]
    load = [torch.bincount(torch.topk(r.float(), k, -1).indices.flatten(), minlength=E).tolist()
            for r in out.router_logits]
    return out.logits.float().numpy(), load


def logits_only(model, input_ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(input_ids.astype(np.int64))).logits.float().numpy()


def make_fixture(out: Path, spec: tuple) -> None:
    model_class, config, seed, input_shape, dtype, shard_size = spec
    model = build(model_class, config, seed)
    input_ids = np.random.default_rng(INPUT_SEED).integers(0, config.vocab_size, input_shape).astype(np.int32)
    in_memory, load = logits_and_load(model, input_ids) if hasattr(config, "num_experts_per_tok") else \
        (logits_only(model, input_ids), [])
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out, **({"max_shard_size": shard_size} if shard_size else {}))
    reloaded = model_class.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    save_checked(out, input_ids, logits_only(reloaded, input_ids), in_memory, load, dtype)


def save_checked(out: Path, input_ids: np.ndarray, logits: np.ndarray, in_memory: np.ndarray, load: list,
                 dtype) -> None:
    """input_ids.npy and logits.npy (the saved model's) in `out`, once the saved model gives the
    in-memory one's logits (float32) and every expert receives a token; what it holds printed."""
    if dtype == torch.float32:
        assert np.array_equal(logits, in_memory), f"{out.name}: the saved model's logits differ"
    assert all(min(counts) > 0 for counts in load), f"{out.name}: an expert receives no token: {load}"
    np.save(out / "input_ids.npy", input_ids)
    np.save(out / "logits.npy", logits.astype(np.float32))
    print(f"{out.name}: logits {logits.shape}, largest |logit| {np.abs(logits).max():.3g}"
          + (f"; tokens per expert by sparse layer {load}" if load else "") + ("" if dtype == torch.float32 else
                                f"; max |bf16 - f32 model| {np.abs(logits - in_memory).max():.3g}"))
    files = sorted(p.name for p in out.iterdir())
    print(f"  files {files}, {sum(p.stat().st_size for p in out.iterdir()):,} B\n  config.json:\n"
          + (out / "config.json").read_text())


def main(doc: str = __doc__, specs: dict = FIXTURE_SPECS, make=make_fixture) -> None:
    """Each of `specs` made into its folder under --out by `make(folder, spec)`."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES, help=f"the fixtures' parent (default: {FIXTURES})")
    args = parser.parse_args()
    import transformers
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    for name, spec in specs.items():
        make(args.out / name, spec)


if __name__ == "__main__":
    main()
