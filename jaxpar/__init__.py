"""jaxpar: pre-train GPT models in JAX under a named (data, tensor, pipe) device mesh."""

from jaxpar.core.platform import skip_absent_tpu

__version__ = "0.1.0"

skip_absent_tpu()
