"""Recompute policies (model.remat, jaxpar.core.remat) and the optimizer's state in host memory
(train.offload=optimizer): each keeps what it says, and none changes a number.

Each policy and the offload train `none`'s losses on the same layout within rtol 1e-6 over 6 steps.
The suite runs each once, each on a different layout of the five the matrix spans; the whole
matrix (every policy and the offload on every layout) is marked slow. A 0.1% learning-rate change
on one of them must fail the same comparison.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import fails_with
from jax._src.ad_checkpoint import saved_residuals

from jaxpar.core import remat
from jaxpar.models.transformer import build_model
from jaxpar.parallel.zero import check_sharded
from jaxpar.train import run

STEPS, RTOL = 6, 1e-6
LAYOUTS = {  # name: (config, mesh, overrides)
    "dp=2,tp=2": ("tiny", "dp=2,tp=2", {}),
    "pp=2 1f1b": ("tiny", "pp=2", {"pipeline.schedule": "1f1b"}),
    "dp=2,ep=2 moe": ("tiny_moe", "dp=2,ep=2", {}),
    "cp=2 llama": ("tiny_llama", "cp=2", {}),
    "dp=2,tp=2 zero3 sp": ("tiny", "dp=2,tp=2", {"train.zero": 3, "model.sequence_parallel": "true"}),
}
VARIANTS = [("model.remat", name) for name in remat.REMAT_KINDS if name != "none"] + [("train.offload", "optimizer")]
IN_SUITE = dict(zip(LAYOUTS, [("train.offload", "optimizer"), ("model.remat", "attention"),
                              ("model.remat", "dots_except_widest"), ("model.remat", "full_offloaded"),
                              ("model.remat", "full")]))  # full under ZeRO 3: the gathered weights rerun too


@functools.cache
def losses(layout: str, *overrides: tuple[str, str]) -> np.ndarray:
    config, spec, fixed = LAYOUTS[layout]
    cfg = tiny_config(config, **mesh_overrides(spec), **fixed, **dict(overrides),
                      **{"train.steps": STEPS, "train.eval_every": 0})
    result = run(cfg, devices=jax.devices()[:math.prod(cfg.mesh.__dict__.values())], progress=False)
    return np.array([result.losses[s] for s in range(STEPS)])


def matrix():
    for layout in LAYOUTS:
        for variant in VARIANTS:
            marks = () if IN_SUITE[layout] == variant else (pytest.mark.slow,)
            yield pytest.param(layout, variant, marks=marks, id=f"{layout}-{variant[1]}")


@pytest.mark.parametrize("layout, variant", list(matrix()))
def test_policy_trains_the_same_losses_as_none(layout, variant):
    np.testing.assert_allclose(losses(layout, variant), losses(layout), rtol=RTOL)


def test_a_slightly_different_run_fails_the_comparison():
    """The control: a 0.1% learning-rate change under the same policy is caught at this rtol."""
    changed = losses("dp=2,tp=2", ("train.offload", "optimizer"), ("optimizer.lr", "0.003003"))
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(changed, losses("dp=2,tp=2"), rtol=RTOL)


def saved_names(config: str, policy: str) -> tuple[set, list]:
    """(the checkpoint names one layer saves for its backward under `policy`, its other saved
    arrays that are neither an argument nor a constant)."""
    cfg = tiny_config(config, **{"model.remat": policy})
    model = build_model(cfg, 65)
    first_layer = jax.tree.map(lambda a: a[0], model.init(0)["blocks"])
    axes = jax.tree.map(lambda names: names[1:], model.axes()["blocks"], is_leaf=lambda n: isinstance(n, tuple))
    step = model.layer_step(axes)
    x = jnp.ones((2, cfg.model.block_size, cfg.model.n_embd))
    saved = saved_residuals(lambda x, p: jnp.sum(step(x, (p, None, None))[0]), x, first_layer)
    named = {text.split("'")[1] for _, text in saved if "named" in text}
    other = [text for _, text in saved if not any(s in text for s in ("named", "argument", "constant", "literal"))]
    return named, other


@pytest.mark.parametrize("config", ["tiny", "tiny_moe"])
def test_each_policy_keeps_what_it_names_and_reruns_the_rest(config):
    """A checkpointed policy saves only names it lists (offloaded ones through a device_put to
    host memory); `none`, the control, saves autodiff's unnamed intermediates."""
    named, other = saved_names(config, "none")
    assert other, "none keeps autodiff's intermediates"
    expected = {"attention": {remat.QKV, remat.CONTEXT, remat.ATTENTION_OUT},
                "dots_except_widest": {remat.QKV, remat.CONTEXT, remat.ATTENTION_OUT, remat.MLP_INPUT}
                | ({remat.ROUTER, remat.EXPERTS_IN, remat.EXPERTS_OUT} if config == "tiny_moe" else set()),
                "full": set(), "full_offloaded": set()}
    for policy, names in expected.items():
        named, other = saved_names(config, policy)
        assert named == names, policy
        assert [text for text in other if "device_put" not in text] == [], policy
        assert any("device_put" in text for text in other) == (policy == "full_offloaded"), policy


def test_a_state_off_its_memory_kind_is_caught():
    """The trainer checks the state against its shardings after init and after training
    (zero.check_state), memory kinds included: the offload matrix runs above keep the optimizer's
    state in pinned_host throughout. The control: an array on the device where the plan says host."""
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    on_device = jax.device_put(jnp.zeros((4,)), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))
    host = on_device.sharding.with_memory_kind(remat.HOST)
    check_sharded("optimizer state", {"m": jax.device_put(on_device, host)}, {"m": host})
    with pytest.raises(RuntimeError, match="not sharded as planned"):
        check_sharded("optimizer state", {"m": on_device}, {"m": host})


@pytest.mark.parametrize("argv, expected", [
    (["--model.remat=selective"], "model.remat must be one of none, full, attention"),
    (["--train.offload=params"], "train.offload must be one of none, optimizer"),
])
def test_unknown_policies_and_offloads_are_one_line(capsys, tmp_path, argv, expected):
    fails_with(capsys, tmp_path, argv, expected)


@pytest.mark.parametrize("argv", [["--train.offload=optimizer"], ["--model.remat=full_offloaded"]])
def test_offload_without_host_memory_is_one_line(capsys, tmp_path, monkeypatch, argv):
    """Devices without a pinned_host memory kind (any CPU here has one: the check is stood in for)."""
    monkeypatch.setattr(remat, "has_host_memory", lambda devices: False)
    fails_with(capsys, tmp_path, argv + ["--mesh", "dp=4,tp=2", "--train.steps=1"], argv[0][2:], "host memory",
               "do not have")
