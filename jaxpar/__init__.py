"""jaxpar: pre-train GPT-2, Llama, MoE and DeepSeek-V3 models in JAX under a named (data, tensor, pipe, context, expert) mesh."""

from jaxpar.core.platform import skip_absent_tpu

__version__ = "0.1.0"

skip_absent_tpu()

# The families' configs register with jaxpar.core here, before any config is read.
import jaxpar.models.registry  # noqa: F401
