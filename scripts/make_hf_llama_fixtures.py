"""Make the Hugging Face Llama test fixtures with real transformers, and self-check HF's Llama conventions.

Needs torch and transformers 5.x, which jaxpar itself never does: run it in a separate venv, e.g.

    python -m venv /tmp/hfvenv && /tmp/hfvenv/bin/pip install torch "transformers==5.23.*" safetensors numpy
    /tmp/hfvenv/bin/python scripts/make_hf_llama_fixtures.py      # writes tests/fixtures/hf_llama_*

It writes three tiny random LlamaForCausalLM checkpoints (vocab 101, not a multiple of 64), each with
save_pretrained, its input_ids.npy (int32, random in [0, vocab) from numpy's default_rng(1234)) and the
float32 logits.npy of transformers (eager attention, eval, no grad) on that input, so tests need no torch:

    hf_llama_tied            hidden 32, 4 query / 2 kv heads, tied embeddings, default rope; 2 x 16 input
    hf_llama_untied_llama3   hidden 64, untied lm_head, llama3 rope scaling, saved in 3 shards; 2 x 24 input
    hf_llama_bf16            hf_llama_tied's shape, another seed, saved in bfloat16; its logits are of the
                             bf16 weights upcast to float32 (what a loader into float32 weights should match)

Every RMSNorm weight is perturbed off 1 so the norm mapping is tested. Before writing, the script checks
and prints the conventions a port relies on (GQA head grouping, rotate_half's halves, RMSNorm's dtypes,
the llama3 rope bands), and after writing, each file's size and each config.json as transformers wrote it.
"""

import argparse
import inspect
import math
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
INPUT_SEED = 1234

TINY = {"vocab_size": 101, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}, "tie_word_embeddings": True}
# head_dim 16, theta 1e4: the wavelengths 2 pi 1e4^(2i/16) are 6.3, 19.9, 62.8, 199, 628, ... and the llama3
# bands of original_max_position_embeddings 64 are: < 64/4 = 16 kept, > 64/1 = 64 divided by 8, between them
# smoothed; so 6.3 is kept, 19.9 and 62.8 are smoothed, 199 on are divided (llama3_bands computes and checks it).
LLAMA3 = TINY | {"hidden_size": 64, "intermediate_size": 96, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
                 "tie_word_embeddings": False,
                 "rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}}
COMMON = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "bos_token_id": 0, "eos_token_id": 0,
          "initializer_range": 0.2,  # 0.02 gives logits near 0: a weaker test
          "attn_implementation": "eager"}  # plain math, no sdpa kernel
FIXTURE_SPECS = {  # name: (config, torch seed, input shape, saved dtype, max_shard_size)
    "hf_llama_tied": (TINY, 1234, (2, 16), torch.float32, None),
    "hf_llama_untied_llama3": (LLAMA3, 1234, (2, 24), torch.float32, "120KB"),
    "hf_llama_bf16": (TINY, 1235, (2, 16), torch.bfloat16, None),
}


def build(config_kwargs: dict, seed: int) -> LlamaForCausalLM:
    """A random model in float32, every RMSNorm weight moved off its init of 1."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**config_kwargs, **COMMON)).eval()
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, modeling_llama.LlamaRMSNorm):
                module.weight.add_(0.1 * torch.randn_like(module.weight))
    return model


def logits_of(model: LlamaForCausalLM, input_ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(input_ids.astype(np.int64))).logits.float().numpy()


def make_fixture(out: Path, spec: tuple) -> None:
    """Save the model (transformers 5 writes safetensors only), its input and its float32 logits.

    The logits come from the saved files reloaded in float32: for the bf16 fixture that is the bf16 weights
    upcast, with the rope frequencies computed afresh in float32 (model.float() after model.to(bfloat16)
    would keep inv_freq rounded to bf16, since .to() casts buffers too)."""
    config_kwargs, seed, input_shape, dtype, shard_size = spec
    model = build(config_kwargs, seed)
    input_ids = np.random.default_rng(INPUT_SEED).integers(0, model.config.vocab_size, input_shape).astype(np.int32)
    in_memory = logits_of(model, input_ids)
    out.mkdir(parents=True, exist_ok=True)
    model.to(dtype).save_pretrained(out, **({"max_shard_size": shard_size} if shard_size else {}))
    reloaded = LlamaForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager").eval()
    logits = logits_of(reloaded, input_ids)
    if dtype == torch.float32:
        assert np.array_equal(logits, in_memory), f"{out.name}: the saved model's logits differ"
    np.save(out / "input_ids.npy", input_ids)
    np.save(out / "logits.npy", logits.astype(np.float32))
    print(f"{out.name}: logits {logits.shape}, largest |logit| {np.abs(logits).max():.3g}, std {logits.std():.3g}"
          + ("" if dtype == torch.float32 else f"; max |bf16 - f32 model| {np.abs(logits - in_memory).max():.3g}"))
    if model.config.rope_parameters["rope_type"] == "llama3":
        check_llama3_inv_freq(reloaded)


def llama3_bands(rope: dict, head_dim: int) -> list[str]:
    """Which llama3 band each rotary frequency falls in; checks that all three are used."""
    wavelengths = [2 * math.pi * rope["rope_theta"] ** (i / head_dim) for i in range(0, head_dim, 2)]
    old = rope["original_max_position_embeddings"]
    low, high = old / rope["low_freq_factor"], old / rope["high_freq_factor"]
    bands = ["kept" if w < high else "divided" if w > low else "smoothed" for w in wavelengths]
    print(f"llama3 bands (kept < {high:g} <= smoothed <= {low:g} < divided): "
          + ", ".join(f"{w:.1f} {b}" for w, b in zip(wavelengths, bands)))
    assert set(bands) == {"kept", "smoothed", "divided"}, bands
    return bands


def check_llama3_inv_freq(model: LlamaForCausalLM) -> None:
    """Transformers' llama3 inv_freq against the same formula in float64 numpy (what a JAX port computes)."""
    rope, dim = model.config.rope_parameters, model.config.head_dim
    llama3_bands(rope, dim)
    inv_freq = 1.0 / rope["rope_theta"] ** (np.arange(0, dim, 2) / dim)
    wavelen = 2 * np.pi / inv_freq
    old, factor = rope["original_max_position_embeddings"], rope["factor"]
    lo, hi = rope["low_freq_factor"], rope["high_freq_factor"]
    smooth = (old / wavelen - lo) / (hi - lo)
    smoothed = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    ours = np.where(wavelen < old / hi, inv_freq, np.where(wavelen > old / lo, inv_freq / factor, smoothed))
    theirs = model.model.rotary_emb.inv_freq.double().numpy()
    assert model.model.rotary_emb.attention_scaling == 1.0
    assert np.allclose(theirs, ours, rtol=1e-6, atol=0), (theirs, ours)
    print(f"llama3 inv_freq of transformers matches numpy's: {np.array2string(theirs, precision=5)}")


def check_gqa_layout(config_kwargs: dict) -> None:
    """(a) q_proj.weight is (heads * head_dim, hidden); query head h reads kv head h // (heads / kv_heads)."""
    attention = build(config_kwargs, 0).model.layers[0].self_attn
    c = attention.config
    heads, kv_heads, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    assert attention.q_proj.weight.shape == (heads * d, c.hidden_size)
    assert attention.k_proj.weight.shape == attention.v_proj.weight.shape == (kv_heads * d, c.hidden_size)
    assert attention.o_proj.weight.shape == (c.hidden_size, heads * d)
    assert attention.scaling == d ** -0.5
    n_rep = attention.num_key_value_groups
    kv_index = torch.arange(kv_heads, dtype=torch.float32).reshape(1, kv_heads, 1, 1)
    read = modeling_llama.repeat_kv(kv_index, n_rep).flatten().long().tolist()
    assert n_rep == heads // kv_heads and read == [h // n_rep for h in range(heads)], read
    print(f"(a) q_proj.weight {tuple(attention.q_proj.weight.shape)} = (heads*head_dim, hidden), rows head-major; "
          f"query head h uses kv head h // {n_rep}: {read}; scores scaled by head_dim**-0.5")


def check_rotate_half(head_dim: int = 8) -> None:
    """(b) rotate_half pairs dim i with i + head_dim/2 (halves, not interleaved), and cos/sin repeat per half."""
    x = torch.arange(head_dim, dtype=torch.float32)
    half = head_dim // 2
    assert torch.equal(modeling_llama.rotate_half(x), torch.cat([-x[half:], x[:half]]))
    rotary = modeling_llama.LlamaRotaryEmbedding(LlamaConfig(**TINY))
    cos, sin = rotary(torch.zeros(1, 5, 1), torch.arange(5)[None])
    assert torch.equal(cos[..., :half], cos[..., half:]) and torch.equal(sin[..., :half], sin[..., half:])
    print(f"(b) rotate_half({x.int().tolist()}) = {modeling_llama.rotate_half(x).int().tolist()}: halves; "
          f"cos/sin = cat(freqs, freqs); q*cos + rotate_half(q)*sin")


def check_rms_norm(width: int = 64) -> None:
    """(c) RMSNorm normalizes in float32, casts to the input dtype, then multiplies by the weight."""
    torch.manual_seed(0)
    norm = modeling_llama.LlamaRMSNorm(width, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn_like(norm.weight))
        x = (3 * torch.randn(16, width)).to(torch.bfloat16)
        x32 = x.float()
        normalized = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)
        expected = norm.weight * normalized.to(torch.bfloat16)
        weight_in_f32 = (norm.weight.float() * normalized).to(torch.bfloat16)
        got = norm(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    differ = int((got != weight_in_f32).sum())
    print(f"(c) RMSNorm: (weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)) exactly; "
          f"multiplying by the weight in float32 before the cast would differ in {differ}/{got.numel()} bf16 values")
    assert "self.weight * hidden_states.to(input_dtype)" in inspect.getsource(modeling_llama.LlamaRMSNorm.forward)


def report(out: Path) -> None:
    """Each file's size, the checkpoint's tensors, and config.json as transformers wrote it."""
    from safetensors import safe_open
    for path in sorted(out.iterdir()):
        print(f"  {path.name:42} {path.stat().st_size:>9,} B")
    tensors = {}
    for shard in sorted(out.glob("*.safetensors")):
        with safe_open(shard, "pt") as f:
            names = f.keys()  # safe_open is not iterable
            tensors |= {name: (shard.name, f.get_slice(name).get_dtype()) for name in names}
    print(f"  {len(tensors)} tensors, dtypes {sorted({d for _, d in tensors.values()})}, "
          f"lm_head.weight saved: {'lm_head.weight' in tensors}, in {len({s for s, _ in tensors.values()})} file(s)")
    print(f"  config.json:\n{(out / 'config.json').read_text()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURES, help=f"the fixtures' parent (default: {FIXTURES})")
    parser.add_argument("--only", choices=sorted(FIXTURE_SPECS), nargs="+", help="make only these fixtures")
    args = parser.parse_args()
    import transformers
    transformers.utils.logging.disable_progress_bar()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    check_gqa_layout(TINY)
    check_rotate_half()
    check_rms_norm()
    names = args.only or list(FIXTURE_SPECS)
    for name in names:
        make_fixture(args.out / name, FIXTURE_SPECS[name])
    total = 0
    for name in names:
        print(f"{args.out / name}:")
        report(args.out / name)
        total += sum(p.stat().st_size for p in (args.out / name).iterdir())
    print(f"{len(names)} fixtures, {total:,} B in all")


if __name__ == "__main__":
    main()
