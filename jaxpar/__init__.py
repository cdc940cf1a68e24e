"""jaxpar: pre-train GPT models in JAX under a named (data, tensor, pipe) device mesh."""

__version__ = "0.1.0"
