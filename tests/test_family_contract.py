"""The model-family contract (jaxpar.models.family.Family): a family that lacks one of its
methods cannot be constructed, and every registered family keeps it, signatures included."""

import inspect

import pytest

from jaxpar.models.family import Family
from jaxpar.models.registry import FAMILIES

CONTRACT = {"declare", "embed", "block", "logits", "matmul_params", "activation_units"}


def test_a_family_without_block_cannot_be_constructed():
    methods = {name: lambda self, *args, **kwargs: None for name in CONTRACT - {"block"}}
    no_block = type("NoBlock", (Family,), methods)
    with pytest.raises(TypeError, match="block"):
        no_block(FAMILIES["gpt2"].config())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_registered_family_keeps_the_contract(name):
    assert Family.__abstractmethods__ == CONTRACT
    entry = FAMILIES[name]
    family = entry.model(entry.config())  # an abstract method left undefined fails here
    for method in CONTRACT:
        expected = list(inspect.signature(getattr(Family, method)).parameters)
        assert list(inspect.signature(getattr(entry.model, method)).parameters) == expected, method
    assert isinstance(family.kv_heads, int) and isinstance(family.head_dim, int)
