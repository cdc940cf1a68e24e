"""Context-parallel strategies, one file each, and their registry: `--model.context_strategy=NAME`
picks how attention runs when the sequence is split over 'context' (jaxpar.nn.context.base)."""

from jaxpar.core.errors import UserError
from jaxpar.nn.context.base import ContextStrategy
from jaxpar.nn.context.ring import Ring
from jaxpar.nn.context.ulysses import Ulysses

STRATEGIES: dict[str, ContextStrategy] = {s.name: s for s in (Ring(), Ulysses())}
DEFAULT = STRATEGIES[Ring.name]


def strategy_named(name: str) -> ContextStrategy:
    """The strategy named `name` ("": the default); a UserError naming the choices otherwise."""
    if not name:
        return DEFAULT
    if name not in STRATEGIES:
        raise UserError(f"model.context_strategy must be one of {', '.join(STRATEGIES)}, got '{name}'")
    return STRATEGIES[name]


def of(plan) -> ContextStrategy:
    """The plan's strategy (the default where a plan made by hand names none)."""
    return plan.context or DEFAULT
