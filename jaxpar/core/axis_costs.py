"""The planner's cost terms of the mesh axes: each entry of jaxpar.core.axes names its own (`costs`),
which say what shares of a chip the axis's size divides and which collectives it adds to a train
step, counted from the model. jaxpar.planning.estimate takes them over every axis, naming none.

`divides` holds terms from: "weights" (every param), "experts" (a mixture's expert params),
"layers" (into pipeline stages), "width" (heads, MLP width and vocabulary), "sequence" (every
activation, along the sequence), "state" (params, gradients and optimizer state, as ZeRO shards
them).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class StepShape:
    """What a layout's collectives are counted from: the model, its ZeRO stage, the passes of a
    step and of a grad_accum round's, the ways the batch's rows and the heads split, the pipeline
    stages, their layer chunks each and the layers each runs, and the bytes of a chip's weights
    and of one pass's activations (already split by the axes that divide them)."""
    model: object  # the [model] section
    grad_accum: int
    virtual: int  # the pipeline schedule's layer chunks a stage
    zero: int
    passes: int
    batch_ways: int
    width: int
    stages: int
    layers: int
    weight_bytes: float
    activation_bytes: float


def collective(kind: str, nbytes: float, group: int, count: int) -> dict:
    """`count` times an op of `kind` on `nbytes` over a group of chips (estimate.collective_seconds)."""
    return {"kind": kind, "bytes": nbytes, "group": group, "count": count}


class AxisCosts:
    """An axis that divides no share and adds no collective."""
    divides: tuple[str, ...] = ()

    def collectives(self, size: int, step: StepShape) -> list[dict]:
        """The collectives the axis adds to a train step at `size`."""
        return []


class DataCosts(AxisCosts):
    divides = ("state",)

    def collectives(self, size, step):
        """The gradients' all-reduce over every axis that splits the batch; under ZeRO-3 each pass
        gathers the weights for the forward and again for the backward."""
        ops = [collective("all-reduce", step.weight_bytes, step.batch_ways, 1)]
        if step.zero >= 3:
            ops.append(collective("all-gather", step.weight_bytes, size, 2 * step.passes))
        return ops


class TensorCosts(AxisCosts):
    divides = ("weights", "width")

    def collectives(self, size, step):
        """Megatron's all-reduce of the activations, twice in a layer's forward and twice in its backward."""
        return [collective("all-reduce", step.activation_bytes, size, 4 * step.layers * step.passes)]


class PipeCosts(AxisCosts):
    divides = ("weights", "layers")

    def collectives(self, size, step):
        """Each pass's activations on to the next stage and their gradients back, per layer chunk;
        interleaved, the layers into chunk order and their gradients back, each round."""
        if size == 1:
            return []
        V = step.virtual
        ops = [collective("collective-permute", step.activation_bytes, size, 2 * V * step.passes)]
        if V > 1:
            ops.append(collective("all-to-all", step.weight_bytes, size, 2 * step.grad_accum))
        return ops


class ContextCosts(AxisCosts):
    """The sequence split: its collectives are the context strategy's (jaxpar.nn.context), which the
    planner adds (jaxpar.planning.estimate.guess_collectives)."""
    divides = ("sequence",)


class ExpertCosts(AxisCosts):
    divides = ("experts",)

    def collectives(self, size, step):
        """Each layer with experts: tokens out and results back, forward and backward; all_to_all's
        buffers hold `size` times the k rows of every token, ragged_all_to_all's the rows alone."""
        if size == 1:
            return []
        m = step.model
        rows = m.experts_per_token * step.activation_bytes * (size if m.moe_dispatch == "all_to_all" else 1)
        return [collective("all-to-all", rows, size, 4 * sum(m.sparse_layers) // step.stages * step.passes)]
