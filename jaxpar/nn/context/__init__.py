"""Context-parallel strategies, one file each, and their registry: `--model.context_strategy=NAME`
picks how attention runs when the sequence is split over 'context' (jaxpar.nn.context.base)."""

from jaxpar.core.registry import Registry
from jaxpar.nn.context.base import ContextStrategy
from jaxpar.nn.context.ring import Ring
from jaxpar.nn.context.ulysses import Ulysses
from jaxpar.nn.moe import check_capacity

# model.context_strategy's entries ("": the default's), checked as the config loads
STRATEGIES = Registry("model.context_strategy", {s.name: s for s in (Ring(), Ulysses())}, default=Ring.name)
DEFAULT = STRATEGIES[Ring.name]


def on_mesh(m, cp: int, tp: int) -> ContextStrategy:
    """The [model] section `m`'s strategy, checked on a mesh of cp and tp where cp > 1 splits the
    sequence: what it needs of the model, and of a mixture's capacity factor; refused in one line.
    Asked where the plan is made (jaxpar.training.step.execution), and of a planner's layout."""
    strategy = STRATEGIES[m.context_strategy]
    if cp > 1:
        strategy.check(m, cp, tp, m.dropout)
        check_capacity(m, cp)
    return strategy


def of(plan) -> ContextStrategy:
    """The plan's strategy (the default where a plan made by hand names none)."""
    return plan.context or DEFAULT
