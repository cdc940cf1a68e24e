"""jaxpar.plan and a mixture of experts: `--layouts auto` tries its expert-parallel sizes as it tries
dp, tp and pp (issue 73). Analytic: the layouts are enumerated and checked, nothing compiles."""

import pytest

from jaxpar.core.errors import UserError
from jaxpar.plan import parse_args
from jaxpar.planning.plan import enumerate_candidates

EP_AXES = ("dp", "tp", "pp", "ep")


def weighed(tmp_path, *flags: str) -> tuple[set, set]:
    """(the (dp, tp, pp, ep) of every layout weighed, of those the trainer would run) on 8 host devices."""
    cfg, target, args, _ = parse_args([*flags, "--target", "cpu:8", "--zero", "0", "--micro-batch", "1",
                                       "--remat", "none", "--out", str(tmp_path / "plan")])
    found = enumerate_candidates(cfg, target.chips, args.layouts, args.zero, args.micro_batch, args.remat,
                                 args.fixed)
    meshes = lambda cs: {tuple(c.layout[key] for key in EP_AXES) for c in cs}
    return meshes(found), meshes(c for c in found if c.status == "pending")


def test_layouts_auto_tries_every_expert_parallel_size_that_divides_the_experts(tmp_path):
    """tiny_moe: 4 experts, 2 layers, 4 heads (2 KV), 8 sequences. Every ep dividing 4 (and the 8
    devices) is weighed beside each split of the rest over dp, tp and pp; ep=8 is not (it would
    split 4 experts 8 ways)."""
    every, runnable = weighed(tmp_path, "--config", "tiny_moe")
    assert {mesh[-1] for mesh in every} == {1, 2, 4}
    assert {mesh[-1] for mesh in runnable} == {1, 2, 4}
    assert {(2, 1, 1, 4), (1, 2, 1, 4), (1, 1, 2, 4), (4, 1, 1, 2), (2, 2, 1, 2), (1, 2, 2, 2)} <= runnable
    for dp, tp, pp, ep in every:
        assert dp * tp * pp * ep == 8
    assert (8, 1, 1, 1) in runnable and (2, 2, 2, 1) in runnable  # the ep=1 layouts stay


def test_ep_stays_one_for_a_dense_model_or_when_asked(tmp_path):
    """Controls: a dense model has no experts to split (ep=1 alone, as before); `--ep 1` and an
    explicit list keep today's meaning; a size that is not a number is one line."""
    assert {mesh[-1] for mesh in weighed(tmp_path, "--config", "tiny")[0]} == {1}
    assert {mesh[-1] for mesh in weighed(tmp_path, "--config", "tiny_moe", "--ep", "1")[0]} == {1}
    assert {mesh[-1] for mesh in weighed(tmp_path, "--config", "tiny_moe", "--ep", "2")[0]} == {2}
    with pytest.raises(UserError, match="--cp takes comma-separated integers, got 'auto'"):
        weighed(tmp_path, "--config", "tiny_moe", "--cp", "auto")
