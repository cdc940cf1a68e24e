"""DeepSeek-V3 (and Kimi K2, Moonlight, which reuse it): Llama's block with multi-head latent
attention and a mixture of experts routed within groups, with shared experts (model.py); its own
[model] keys (config.py); Hugging Face's DeepseekV3ForCausalLM in and out (hf.py)."""

from jaxpar.models.deepseek import hf
from jaxpar.models.deepseek.config import DeepseekConfig
from jaxpar.models.deepseek.model import Deepseek
from jaxpar.models.family import Registered

FAMILY = Registered(Deepseek, DeepseekConfig, hf_formats=(hf,), exported_as=lambda m: hf)
