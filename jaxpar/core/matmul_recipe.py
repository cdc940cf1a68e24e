"""What the execution plan and its readers see of a matmul recipe: the recipes themselves, how the
projections and the grouped GEMM compute, are jaxpar.nn.recipes (a layer above this one)."""

from typing import Protocol


class MatmulRecipe(Protocol):
    """A recipe as the plan holds it (jaxpar.nn.recipes.base.MatmulRecipe implements it)."""

    @property
    def name(self) -> str:
        """Its name in the registry."""

    @property
    def mfu_dtype(self) -> str:
        """The dtype whose peak FLOP/s MFU divides by (jaxpar.models.flops.peak_flops)."""

    def describe(self) -> dict:
        """What run.json and --dry-run print of it."""
