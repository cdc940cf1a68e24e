"""Rotary position embeddings in Hugging Face's convention: each head's dims split in halves
(`rotate_half`), not interleaved pairs, so HF's q/k weights load with a transpose alone; cos and sin
in float32; Llama 3's frequency scaling (rope_type "llama3") and YaRN (rope_type "yarn",
DeepSeek-V3's), each as transformers computes it."""

import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.core.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, head_dim: int) -> np.ndarray:
    """theta^(-2i/d) for i < d/2, with Llama 3's scaling: wavelengths longer than the original
    context / low_freq_factor are divided by `factor`, those shorter than original / high_freq_factor
    kept, and those between interpolated smoothly (transformers' _compute_llama3_parameters)."""
    inv = 1.0 / cfg.rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if cfg.rope_type == "yarn":
        return yarn_frequencies(cfg, head_dim, inv)
    if cfg.rope_type != "llama3":
        return inv.astype(np.float32)
    original, factor = cfg.rope_original_max_position, cfg.rope_factor
    low_wavelen = original / cfg.rope_low_freq_factor
    high_wavelen = original / cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (original / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    between = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return np.where(between, smoothed, scaled).astype(np.float32)


def yarn_frequencies(cfg: ModelConfig, head_dim: int, inv: np.ndarray) -> np.ndarray:
    """YaRN's (transformers' _compute_yarn_parameters, truncated): each frequency blended from
    itself (extrapolated) to itself / factor (interpolated) by a ramp over the dims that turn
    between beta_fast and beta_slow times within the original context."""
    def dim_of(turns: float) -> float:
        original = cfg.rope_original_max_position
        return head_dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
    low = max(math.floor(dim_of(cfg.rope_beta_fast)), 0)
    high = min(math.ceil(dim_of(cfg.rope_beta_slow)), head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / ((high + 0.001 if low == high else high) - low),
                   0, 1)
    inv = inv.astype(np.float32)
    return (inv / cfg.rope_factor * ramp + inv * (1 - ramp)).astype(np.float32)


def mscale(cfg: ModelConfig, m: float) -> float:
    """YaRN's 0.1 m ln(factor) + 1 (1 without scaling)."""
    return 1.0 if cfg.rope_factor <= 1 else 0.1 * m * math.log(cfg.rope_factor) + 1.0


def cos_sin_scale(cfg: ModelConfig) -> float:
    """YaRN's attention factor on cos and sin: mscale(mscale) / mscale(mscale_all_dim) where both
    are set, else mscale(1); 1 for the other rope types."""
    if cfg.rope_type != "yarn":
        return 1.0
    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return mscale(cfg, cfg.rope_mscale) / mscale(cfg, cfg.rope_mscale_all_dim)
    return mscale(cfg, 1.0)


def angles(cfg: ModelConfig, head_dim: int, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(cos, sin), each (seq, head_dim) float32 for positions (seq,), the halves repeated as HF's
    are; for positions (batch, seq), each (batch, 1, seq, head_dim), to rotate (batch, heads, seq,
    head_dim)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inverse_frequencies(cfg, head_dim))
    both = jnp.concatenate([freqs, freqs], axis=-1)
    if both.ndim == 3:
        both = both[:, None]
    if cfg.rope_type == "yarn":
        return jnp.cos(both) * cos_sin_scale(cfg), jnp.sin(both) * cos_sin_scale(cfg)
    return jnp.cos(both), jnp.sin(both)


def rotate_half(x: jax.Array) -> jax.Array:
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([-x2, x1], axis=-1)


def apply(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x (..., seq, head_dim) rotated by position, in float32, returned in x's dtype."""
    x32 = x.astype(jnp.float32)
    return (x32 * cos + rotate_half(x32) * sin).astype(x.dtype)
