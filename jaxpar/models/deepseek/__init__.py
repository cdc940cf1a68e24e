"""DeepSeek-V3 (and Kimi K2, Moonlight, which reuse it): Llama's block with multi-head latent
attention and a mixture of experts routed within groups, with shared experts (model.py); its own
[model] keys (config.py)."""

from jaxpar.models.deepseek.config import DeepseekConfig
from jaxpar.models.deepseek.model import Deepseek
from jaxpar.models.interface import Registered

FAMILY = Registered(Deepseek, DeepseekConfig, hf_formats=(), exported_as=None)
