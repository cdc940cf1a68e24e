"""Context-parallel strategies, one file each, and their registry: `--model.context_strategy=NAME`
picks how attention runs when the sequence is split over 'context' (jaxpar.nn.context.base)."""

from jaxpar.core.registry import Registry
from jaxpar.nn.context.base import ContextStrategy
from jaxpar.nn.context.ring import Ring
from jaxpar.nn.context.ulysses import Ulysses

# model.context_strategy's entries; `STRATEGIES.named(name)` resolves one ("": the default)
STRATEGIES = Registry("model.context_strategy", {s.name: s for s in (Ring(), Ulysses())}, default=Ring.name)
DEFAULT = STRATEGIES[Ring.name]


def of(plan) -> ContextStrategy:
    """The plan's strategy (the default where a plan made by hand names none)."""
    return plan.context or DEFAULT
