"""The kernels that each [model] kernel key names: its entries, as the modules that implement them
define them (jaxpar.nn.kernel_entry says what an entry is), and the config's checks of them.

Each key's entries are a jaxpar.core.registry.Registry, which the config's checks ask as the
config loads (the names, and what the config alone rules out); the mesh's and the platform's
needs are asked where the execution plan is made (jaxpar.training.step.execution).
"""

from jaxpar.core.model_config import field_names
from jaxpar.nn import kernels, moe
from jaxpar.nn.grouped_gemm import GEMM_KERNELS
from jaxpar.nn.kernel_entry import ATTENTION, MOE_DISPATCH, MOE_GEMM

KERNELS = {ATTENTION: kernels.ATTENTION_KERNELS, MOE_GEMM: GEMM_KERNELS, MOE_DISPATCH: moe.DISPATCH_KERNELS}


def names(key: str) -> tuple[str, ...]:
    """The values model.<key> takes: auto, then its kernels."""
    return KERNELS[key].names


def check_model(m, documents: bool) -> None:
    """Refuse what model config m's kernel keys name where the config alone rules it out, each in
    one line with the choices or the fix: the attention kernel (with `documents`,
    data.document_mask, one that cannot keep them apart too), then a mixture's dispatch and GEMM
    (the keys of the families that have them)."""
    kernels.check_attention(m, documents)
    for key in (MOE_DISPATCH, MOE_GEMM):
        if key in field_names(m):
            KERNELS[key].check(getattr(m, key))
