"""Llama and the models built like it (Qwen3, Mistral, Mixtral, Qwen3-MoE, OLMoE): RoPE (rope.py),
RMSNorm, SwiGLU or a mixture of experts, grouped-query attention (model.py), its own [model] keys (config.py); Hugging Face's dense
(hf.py) and mixture-of-experts (hf_moe.py) formats in and out."""

from jaxpar.models.family import Registered
from jaxpar.models.llama import hf, hf_moe
from jaxpar.models.llama.config import LlamaConfig
from jaxpar.models.llama.model import Llama

FAMILY = Registered(Llama, LlamaConfig, hf_formats=(hf, hf_moe), exported_as=lambda m: hf_moe if m.n_experts else hf)
