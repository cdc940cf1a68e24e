"""Force 8 host CPU devices before JAX initialises, so every mesh layout can run on one machine."""

import jax

jax.config.update("jax_num_cpu_devices", 8)

from jaxpar.config import load_config  # noqa: E402
from jaxpar.mesh import parse_mesh_spec  # noqa: E402


def tiny_config(**overrides):
    """configs/tiny.toml with `section.field` overrides (values as strings or numbers)."""
    return load_config("tiny", {k: str(v) for k, v in overrides.items()})


def mesh_overrides(spec: str) -> dict:
    return parse_mesh_spec(spec)
