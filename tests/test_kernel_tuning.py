"""Kernels tuned once (jaxpar.nn.kernel_tuning) and the grouped GEMM's legs by kernel (jaxpar.nn.grouped_gemm):
the cache's keys, reuse and ignored files with a stand-in tuner; each leg by another kernel
against ragged_dot; the chooser with a stand-in timer, its correctness check's control, and the
plan that names the legs. Tiny shapes, no training."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxpar
from jaxpar.core.config import Config
from jaxpar.core.execution import ExecutionPlan
from jaxpar.core.model_config import model_config
from jaxpar.nn import grouped_gemm, kernel_tuning, moe
from jaxpar.nn.kernel_tuning import Request, TuningCache

REQUESTS = [Request("tokamax", leg, ((96, 16), (4, 16, 32)), ("bfloat16", "bfloat16")) for leg in grouped_gemm.LEGS]


class StandIn:
    """A tuner that counts its calls and reports a fixed cost."""

    def __init__(self, seconds=1.5):
        self.calls, self.seconds = [], seconds

    def __call__(self, request):
        self.calls.append(request)
        return {"block_m": 64, "leg": request.leg}, self.seconds


def test_cache_keys_reuse_and_cost(tmp_path):
    """A miss is tuned, stored and its cost said in one line; a second run tunes nothing."""
    keys = {r.key("nvidia_h200") for r in REQUESTS}
    assert len(keys) == 3 and all(k.startswith("nvidia_h200|tokamax|") and "96x16,4x16x32" in k for k in keys)
    assert REQUESTS[0].key("nvidia_h200") != REQUESTS[0].key("nvidia_h100_80gb_hbm3")
    tuner = StandIn()
    configs, line = kernel_tuning.tune(TuningCache(str(tmp_path)), "nvidia_h200", REQUESTS, tuner)
    assert len(tuner.calls) == 3 and configs[REQUESTS[1]] == {"block_m": 64, "leg": "dlhs"}
    assert "\n" not in line and "tuned 3" in line and "in 4.50 s" in line and "reused 0" in line
    body = json.loads((tmp_path / kernel_tuning.CACHE_FILE).read_text())
    assert body["jaxpar"] == jaxpar.__version__ and body["entries"][REQUESTS[0].key("nvidia_h200")]["cost_s"] == 1.5
    assert not [p for p in tmp_path.iterdir() if p.name != kernel_tuning.CACHE_FILE]  # the temporary file renamed
    again = StandIn()
    configs2, line = kernel_tuning.tune(TuningCache(str(tmp_path)), "nvidia_h200", REQUESTS, again)
    assert not again.calls and configs2 == configs and "reused 3 entries" in line and "tuned nothing" in line


def test_a_tuning_stopped_midway_keeps_what_it_tuned(tmp_path):
    """Each config is stored as it is found: a run stopped at its third request (a time limit, say)
    leaves two, and the next run tunes the third alone."""
    class Stopped(StandIn):
        def __call__(self, request):
            if len(self.calls) == 2:
                raise KeyboardInterrupt
            return super().__call__(request)
    with pytest.raises(KeyboardInterrupt):
        kernel_tuning.tune(TuningCache(str(tmp_path)), "nvidia_h200", REQUESTS, Stopped())
    again = StandIn()
    _, line = kernel_tuning.tune(TuningCache(str(tmp_path)), "nvidia_h200", REQUESTS, again)
    assert again.calls == REQUESTS[2:] and "tuned 1" in line and "reused 2" in line


@pytest.mark.parametrize("body, why", [("{not json", "does not parse"),
                                       (json.dumps({"jaxpar": "0.0.0", "format": 1, "entries": {}}), "jaxpar 0.0.0")])
def test_corrupt_or_foreign_cache_is_ignored_and_rewritten(tmp_path, body, why):
    (tmp_path / kernel_tuning.CACHE_FILE).write_text(body)
    cache = TuningCache(str(tmp_path))
    assert cache.entries == {} and why in cache.note and "\n" not in cache.note
    _, line = kernel_tuning.tune(cache, "nvidia_h200", REQUESTS[:1], StandIn())
    assert why in line and "tuned 1" in line and "\n" not in line
    assert TuningCache(str(tmp_path)).note is None  # rewritten in this version's format


def test_cache_folder_defaults_to_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert kernel_tuning.cache_folder() == tmp_path / "jaxpar"
    assert kernel_tuning.cache_folder("/x/y") == Path("/x/y")


def grads(fn, x, w, gs, dy):
    y, back = jax.vjp(lambda x, w: fn(x, w, gs), x, w)
    return (y, *back(dy))


def test_legs_by_other_kernels_equal_ragged_dot():
    """forward blocks, dlhs ragged_dot, drhs blocks: the
    product and both gradients as ragged_dot's, f32, uneven and empty groups, rows past them."""
    request = Request("grouped_gemm", "forward", ((sum(kernel_tuning.CHECK_GROUPS) + 7, 24), (5, 24, 40)),
                      ("float32", "float32"))
    x, w, gs, dy = kernel_tuning.leg_inputs(request, kernel_tuning.CHECK_GROUPS)
    want = grads(lambda x, w, gs: jax.lax.ragged_dot(x, w, gs, preferred_element_type=jnp.float32), x, w, gs, dy)
    legs = ("blocks", "ragged_dot", "blocks")
    got = jax.jit(lambda x, w, gs, dy: grads(lambda x, w, gs: grouped_gemm.legged_gemm(x, w, gs, legs, True, ""),
                                             x, w, gs, dy))(x, w, gs, dy)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(jnp.max(jnp.abs(b))))


def test_experts_run_their_chosen_legs():
    """Experts whose legs are all one kernel run that kernel, not the plan's moe_gemm (tokamax's
    Triton kernels cannot run on this CPU); mixed legs equal the one kernel's output."""
    keys = jax.random.split(jax.random.key(0), 3)
    gate_up, out = jax.random.normal(keys[0], (3, 8, 2, 4)), jax.random.normal(keys[1], (3, 4, 8))
    x, gs = jax.random.normal(keys[2], (12, 8)), jnp.array([5, 0, 4], jnp.int32)

    def run(gemm, legs):
        return jax.jit(lambda x: moe.grouped_swiglu(x, gs, moe.Experts(gate_up, out, jnp.float32, gemm, True, legs)))(x)
    want = run("ragged_dot", ())
    np.testing.assert_allclose(run("tokamax", ("ragged_dot",) * 3), want, rtol=1e-5)
    np.testing.assert_allclose(run("tokamax", ("blocks", "ragged_dot", "blocks")), want, rtol=1e-5, atol=1e-5)


def test_chooser_picks_the_fastest_leg_and_drops_a_wrong_one(tmp_path):
    """A stand-in timer makes blocks the fastest forward and ragged_dot the fastest backward; a
    deliberately wrong candidate (the control) is dropped by the correctness check, with a line."""
    cost = {("blocks", "forward"): 1.0, ("ragged_dot", "forward"): 2.0, ("ragged_dot", "dlhs"): 1.0,
            ("blocks", "dlhs"): 3.0, ("ragged_dot", "drhs"): 2.0, ("blocks", "drhs"): 1.0, ("wrong", "forward"): 0.1,
            ("wrong", "dlhs"): 0.1, ("wrong", "drhs"): 0.1}
    timer = lambda fn, args: cost[fn.kernel, fn.leg]

    def named(kernel, leg, fn):
        wrapped = lambda *args: fn(*args)
        wrapped.kernel, wrapped.leg = kernel, leg
        return wrapped

    def wrong(leg):  # ragged_dot's, 1% off: the control
        right = kernel_tuning.leg_fn("ragged_dot", leg)
        return named("wrong", leg, lambda *args: 1.01 * right(*args))
    cfg = Config(model=model_config("llama", n_experts=4, experts_per_token=2, n_embd=16, block_size=8))
    requests = kernel_tuning.gemm_requests(cfg, "grouped_gemm", rows=32, ep=1)

    def tuner(request):
        fns = {k: named(k, request.leg, kernel_tuning.leg_fn(k, request.leg)) for k in ("ragged_dot", "blocks")}
        return kernel_tuning.leg_tuner(("ragged_dot", "blocks", "wrong"), timer, fns={**fns, "wrong": wrong(request.leg)})(request)

    cache = TuningCache(str(tmp_path))
    legs, lines = kernel_tuning.choose_legs(cache, "cpu_test", requests, tuner)
    assert legs == ("blocks", "ragged_dot", "blocks")
    assert len(lines) == 4 and all("wrong's" in line and "dropped" in line for line in lines[:3])
    assert "tuned 6" in lines[-1]
    plan = ExecutionPlan(experts=True, moe_gemm="blocks", gemm_legs=legs, tuning_note=lines[-1])
    assert plan.describe()["moe"]["grouped_gemm"] == {"forward": "blocks", "dlhs": "ragged_dot", "drhs": "blocks"}
    assert kernel_tuning.choose_legs(TuningCache(str(tmp_path)), "cpu_test", requests, None)[0] == legs  # cached


def test_cpu_plan_tunes_nothing_and_keeps_the_one_kernel(tmp_path):
    cfg = Config(model=model_config("llama", n_experts=4, experts_per_token=2, moe_gemm="blocks"))
    cfg.train.kernel_cache, cfg.train.choose_gemm_legs = str(tmp_path), True
    assert kernel_tuning.plan_tuning(cfg, "cpu", jax.devices()[0], "blocks", 32, 1, True) == {}
    assert not list(tmp_path.iterdir())
    plan = ExecutionPlan(experts=True, moe_gemm="blocks")
    assert plan.describe()["moe"]["grouped_gemm"] == "blocks" and plan.gemm_legs == ()


class FakeGPU:
    def __init__(self, kind):
        self.device_kind = kind


def test_gpu_plan_path_with_stand_ins(monkeypatch, tmp_path):
    """plan_tuning as on a GPU (the backend and the device stood in for): tokamax tuned where it
    ships nothing for the device kind (an H200), reused on a second plan, nothing on an H100;
    and each leg chosen where train.choose_gemm_legs asks."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    cfg = Config(model=model_config("llama", n_experts=4, experts_per_token=2, n_embd=16, block_size=8))
    cfg.train.kernel_cache = str(tmp_path)
    tuner = StandIn(0.25)
    plan = lambda kind: kernel_tuning.plan_tuning(cfg, "gpu", FakeGPU(kind), "tokamax", 32, 1, False,
                                                  tuner=tuner)
    fields = plan("NVIDIA H200")
    assert len(tuner.calls) == 6 and "nvidia_h200: tuned 6" in fields["tuning_note"] and "in 1.50 s" in fields["tuning_note"]
    assert len(json.loads(fields["gemm_tuning"])) == 6 and "gemm_legs" not in fields
    assert "tuned nothing" in plan("NVIDIA H200")["tuning_note"] and len(tuner.calls) == 6
    assert plan("NVIDIA H100 80GB HBM3") == {} and len(tuner.calls) == 6
    monkeypatch.setattr(kernel_tuning, "candidates", lambda platform: ("ragged_dot",))
    cfg.train.choose_gemm_legs = True
    fields = kernel_tuning.plan_tuning(cfg, "gpu", FakeGPU("NVIDIA H200"), "tokamax", 32, 1, False,
                                       timer=lambda fn, args: 1.0, tuner=tuner)
    assert fields["gemm_legs"] == ("ragged_dot",) * 3 and "gemm_tuning" not in fields  # tokamax runs no leg
