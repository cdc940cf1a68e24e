"""The dense first layers (DeepSeek's first_k_dense_replace), stacked apart from the rest.

A family declares its layers in stacks by kind (jaxpar.models.family): every layer's
attention on 'layers', the dense MLPs on 'dense_layers' and the experts on 'sparse_layers'. Where
the first k layers are dense and every later one has experts (ModelConfig.lead_layers), the
params hold those k whole, on a stack of their own under "lead_blocks" ('lead_layers'), and the
other layers under "blocks", every one on 'layers'. So the other layers are one kind: one scan,
and a pipeline's stages split them evenly, while the lead runs ahead of them (and of a pipeline,
beside the embedding).

The params are drawn as the family declares them and then split, so a seed gives the same
weights with the split or without it.
"""

import dataclasses

from jaxpar.nn.params import LEAD, is_param

LEAD_STACK = "lead_layers"


def stack_of(node) -> str:
    """A block param's stacked axis (a Param, or a dict of them: kernel, bias, ...)."""
    return node.axes[0] if is_param(node) else stack_of(next(iter(node.values())))


def parts(stack: str, k: int) -> tuple:
    """Where the lead's layers and the rest's lie in a declared stack: (lead slice, rest slice),
    None where the stack holds none of them."""
    return {"layers": (slice(0, k), slice(k, None)), "dense_layers": (slice(0, k), None),
            "sparse_layers": (None, slice(0, None))}[stack]


def split(tree: dict, declared: dict, k: int, cut) -> dict:
    """tree (declared Params, or their values) with its "blocks" split into the lead's k layers
    (LEAD) and the rest's ("blocks"); cut(node, slice, new stack name) takes a part of a node."""
    if not k:
        return tree
    lead, rest = {}, {}
    for name, node in tree["blocks"].items():
        into_lead, into_rest = parts(stack_of(declared["blocks"][name]), k)
        if into_lead is not None:
            lead[name] = cut(node, into_lead, LEAD_STACK)
        if into_rest is not None:
            rest[name] = cut(node, into_rest, "layers")
    return {**{name: node for name, node in tree.items() if name != "blocks"}, LEAD: lead, "blocks": rest}


def cut_param(node, part: slice, stack: str):
    if not is_param(node):
        return {name: cut_param(p, part, stack) for name, p in node.items()}
    n = len(range(node.shape[0])[part])
    return dataclasses.replace(node, shape=(n,) + node.shape[1:], axes=(stack,) + node.axes[1:])


def cut_value(node, part: slice, stack: str):
    if isinstance(node, dict):
        return {name: cut_value(a, part, stack) for name, a in node.items()}
    return node[part]


def split_declared(declared: dict, k: int) -> dict:
    return split(declared, declared, k, cut_param)


def split_params(params: dict, declared: dict, k: int) -> dict:
    """The params drawn from `declared` (the family's own), split as split_declared splits it."""
    return split(params, declared, k, cut_value)
