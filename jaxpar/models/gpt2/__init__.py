"""GPT-2: learned positions, LayerNorm, GELU, tied embeddings (model.py), its own [model] keys
(config.py), and Hugging Face's GPT2LMHeadModel in and out (hf.py)."""

from jaxpar.models.family import Registered
from jaxpar.models.gpt2 import hf
from jaxpar.models.gpt2.config import GPT2Config
from jaxpar.models.gpt2.model import GPT2

FAMILY = Registered(GPT2, GPT2Config, hf_formats=(hf,), exported_as=lambda m: hf)
