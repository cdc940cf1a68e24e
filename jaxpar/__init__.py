"""jaxpar: pre-train GPT-2, Llama, MoE and DeepSeek-V3 models in JAX under a named (data, tensor, pipe, context, expert) mesh."""

from jaxpar.core.platform import skip_absent_tpu

__version__ = "0.1.0"

skip_absent_tpu()

# Every registry (jaxpar.core.registry) is filled here, before any config is read (nn's by the families').
import jaxpar.models.registry  # noqa: F401, E402
import jaxpar.parallel.schedules  # noqa: F401, E402
import jaxpar.training.optimizers.registry  # noqa: F401, E402
