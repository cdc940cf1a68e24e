"""The family registry: each family's `Registered` entry (jaxpar.models.family), by name. The
configs register with jaxpar.core here, which reads the [model] section before any model is built;
the Hugging Face layer (jaxpar.models.hf) reads the entries' formats. A new family is one entry.
"""

from jaxpar.core.config import ModelConfig
from jaxpar.core.model_config import FAMILY_CONFIGS
from jaxpar.models import deepseek, gpt2, llama
from jaxpar.models.family import Family, Registered

# The families, each a folder of jaxpar/models; their configs are registered with jaxpar.core,
# which reads the [model] section before any model is built.
FAMILIES: dict[str, Registered] = {entry.config.family: entry for entry in (gpt2.FAMILY, llama.FAMILY,
                                                                             deepseek.FAMILY)}
for entry in FAMILIES.values():
    FAMILY_CONFIGS[entry.config.family] = entry.config


def family_of(cfg: ModelConfig) -> Family:
    return FAMILIES[cfg.family].model(cfg)
