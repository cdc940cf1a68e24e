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
from jaxpar.nn import grouped_gemm, kernel_tuning, moe, tuning_cache
from jaxpar.nn.tuning_cache import Request, TuningCache

REQUESTS = [Request("tokamax", leg, ((96, 16), (4, 16, 32)), ("bfloat16", "bfloat16")) for leg in grouped_gemm.LEGS]


class StandIn:
    """A tuner that counts its calls and reports a fixed cost; `text`: its config as JSON text, as
    tokamax's tuner gives it."""

    def __init__(self, seconds=1.5, text=False):
        self.calls, self.seconds, self.text = [], seconds, text

    def __call__(self, request):
        self.calls.append(request)
        config = {"block_m": 64, "leg": request.leg}
        return json.dumps(config) if self.text else config, self.seconds


def test_cache_keys_reuse_and_cost(tmp_path):
    """A miss is tuned, stored and its cost said in one line; a second run tunes nothing."""
    keys = {r.key("nvidia_h200") for r in REQUESTS}
    assert len(keys) == 3 and all(k.startswith("nvidia_h200|tokamax|") and "96x16,4x16x32" in k for k in keys)
    assert REQUESTS[0].key("nvidia_h200") != REQUESTS[0].key("nvidia_h100_80gb_hbm3")
    tuner = StandIn()
    configs, line = tuning_cache.tune(TuningCache(str(tmp_path)), "nvidia_h200", REQUESTS, tuner)
    assert len(tuner.calls) == 3 and configs[REQUESTS[1]] == {"block_m": 64, "leg": "dlhs"}
    assert "\n" not in line and "tuned 3" in line and "in 4.50 s" in line and "reused 0" in line
    body = json.loads((tmp_path / tuning_cache.CACHE_FILE).read_text())
    assert body["jaxpar"] == jaxpar.__version__ and body["entries"][REQUESTS[0].key("nvidia_h200")]["cost_s"] == 1.5
    assert not [p for p in tmp_path.iterdir() if p.name != tuning_cache.CACHE_FILE]  # the temporary file renamed
    again = StandIn()
    configs2, line = tuning_cache.tune(TuningCache(str(tmp_path)), "nvidia_h200", REQUESTS, again)
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
        tuning_cache.tune(TuningCache(str(tmp_path)), "nvidia_h200", REQUESTS, Stopped())
    again = StandIn()
    _, line = tuning_cache.tune(TuningCache(str(tmp_path)), "nvidia_h200", REQUESTS, again)
    assert again.calls == REQUESTS[2:] and "tuned 1" in line and "reused 2" in line


@pytest.mark.parametrize("body, why", [("{not json", "does not parse"),
                                       (json.dumps({"jaxpar": "0.0.0", "format": 1, "entries": {}}), "jaxpar 0.0.0")])
def test_corrupt_or_foreign_cache_is_ignored_and_rewritten(tmp_path, body, why):
    (tmp_path / tuning_cache.CACHE_FILE).write_text(body)
    cache = TuningCache(str(tmp_path))
    assert cache.entries == {} and why in cache.note and "\n" not in cache.note
    _, line = tuning_cache.tune(cache, "nvidia_h200", REQUESTS[:1], StandIn())
    assert why in line and "tuned 1" in line and "\n" not in line
    assert TuningCache(str(tmp_path)).note is None  # rewritten in this version's format


def test_cache_folder_defaults_to_the_users(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tuning_cache.cache_folder() == tmp_path / "jaxpar"
    assert tuning_cache.cache_folder("/x/y") == Path("/x/y")


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
    requests = kernel_tuning.gemm_requests(cfg.model, "grouped_gemm", rows=32, ep=1)

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
    assert kernel_tuning.plan_tuning(cfg.model, str(tmp_path), True, "cpu", jax.devices()[0], "blocks", 32, 1, True) == {}
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
    tuner = StandIn(0.25, text=True)
    plan = lambda kind: kernel_tuning.plan_tuning(cfg.model, str(tmp_path), False, "gpu", FakeGPU(kind), "tokamax",
                                                  32, 1, False, tuner=tuner)
    fields = plan("NVIDIA H200")
    assert len(tuner.calls) == 6 and "nvidia_h200: tuned 6" in fields["tuning_note"] and "in 1.50 s" in fields["tuning_note"]
    assert len(fields["gemm_tuning"]) == 6 and "gemm_legs" not in fields
    assert "tuned nothing" in plan("NVIDIA H200")["tuning_note"] and len(tuner.calls) == 6
    assert plan("NVIDIA H100 80GB HBM3") == {} and len(tuner.calls) == 6
    monkeypatch.setattr(kernel_tuning, "candidates", lambda platform: ("ragged_dot",))
    cfg.train.choose_gemm_legs = True
    fields = kernel_tuning.plan_tuning(cfg.model, str(tmp_path), True, "gpu", FakeGPU("NVIDIA H200"), "tokamax", 32, 1,
                                       False, timer=lambda fn, args: 1.0, tuner=tuner)
    assert fields["gemm_legs"] == ("ragged_dot",) * 3 and "gemm_tuning" not in fields  # tokamax runs no leg


LEG_REQUESTS = [Request("grouped_gemm", leg, ((32, 16), (4, 16, 32)), ("float32", "float32"))
                for leg in grouped_gemm.LEGS]


def leg_stand_in(request):
    """A leg tuner's config without measuring: ragged_dot passed the check and is the fastest."""
    return {"kernel": "ragged_dot", "seconds": {"ragged_dot": 1.0, "blocks": 2.0}, "dropped": []}, 0.5


def cache_with(folder, entry) -> TuningCache:
    """A cache file of this version holding `entry` for each of LEG_REQUESTS."""
    body = {"jaxpar": tuning_cache.VERSION, "format": tuning_cache.FORMAT,
            "entries": {r.key("cpu_test"): entry for r in LEG_REQUESTS}}
    (folder / tuning_cache.CACHE_FILE).write_text(json.dumps(body))
    return TuningCache(str(folder))


@pytest.mark.parametrize("entry, kernels, why", [
    ({"config": {"kernel": "bogus", "seconds": {"bogus": 0.1, "ragged_dot": 1.0}, "dropped": []}, "cost_s": 1},
     None, "it times bogus, which is not a grouped GEMM kernel here"),
    ({"config": {"kernel": "megablox", "seconds": {"megablox": 0.1, "ragged_dot": 1.0}, "dropped": ["megablox"]},
      "cost_s": 1}, None, "it times megablox, which failed the check against ragged_dot"),
    ({"config": {"kernel": "megablox", "seconds": {"megablox": 0.1, "ragged_dot": 1.0}, "dropped": []}, "cost_s": 1},
     ("ragged_dot", "blocks"), "it times megablox, which is not a grouped GEMM kernel here"),  # not a candidate here
    ({"config": {"kernel": "blocks", "seconds": {"blocks": "fast"}, "dropped": []}, "cost_s": 1}, None,
     "its time of blocks is not a number of seconds"),
    ({"config": {"kernel": "blocks"}, "cost_s": 1}, None, "not a leg's timings"),
    ("junk", None, "no config"),
    ({"config": {"kernel": "blocks", "seconds": {"blocks": 0.1}, "dropped": []}}, None, "cost_s None"),
])
def test_a_cached_leg_choice_that_cannot_be_used_is_said_and_tuned_again(tmp_path, entry, kernels, why):
    """A cached choice must time registered candidate kernels that passed the check against
    ragged_dot, in seconds, in a well-formed entry: else the entries are dropped, the one line
    names the file and why, each is tuned again and the file rewritten (before: used as they
    were, or a TypeError)."""
    cache = cache_with(tmp_path, entry)
    calls = []

    def tuner(request):
        calls.append(request)
        return leg_stand_in(request)
    legs, lines = kernel_tuning.choose_legs(cache, "cpu_test", LEG_REQUESTS, tuner, *([kernels] if kernels else []))
    assert legs == ("ragged_dot",) * 3 and len(calls) == 3
    line = lines[-1]
    assert "\n" not in line and f"{tmp_path / tuning_cache.CACHE_FILE}: dropped 3 entries that cannot be used" in line
    assert why in line and "tuned 3" in line, line
    assert kernel_tuning.choose_legs(TuningCache(str(tmp_path)), "cpu_test", LEG_REQUESTS, None)[0] == legs  # rewritten


def test_a_usable_cached_leg_choice_is_reused(tmp_path):
    """The control: a well-formed choice of registered kernels that passed is used, tuning nothing."""
    config, _ = leg_stand_in(None)
    config |= {"kernel": "blocks", "seconds": {"blocks": 0.5, "ragged_dot": 1.0}}
    cache = cache_with(tmp_path, {"config": config, "cost_s": 1})
    legs, lines = kernel_tuning.choose_legs(cache, "cpu_test", LEG_REQUESTS, None)
    assert legs == ("blocks",) * 3 and "tuned nothing" in lines[-1] and "dropped" not in lines[-1]


def folder_for_the_file(tmp_path):
    (tmp_path / tuning_cache.CACHE_FILE).mkdir()
    (tmp_path / tuning_cache.CACHE_FILE / "mine.txt").write_text("a user's")
    users = tmp_path / tuning_cache.CACHE_FILE / "mine.txt"
    return tmp_path, users, f"{users.parent} is a folder"


def file_for_the_folder(tmp_path):
    (tmp_path / "cache").write_text("a user's")
    return tmp_path / "cache", tmp_path / "cache", f"{tmp_path / 'cache'} is a file where the cache's folder"


def file_above_the_folder(tmp_path):
    (tmp_path / "cache").write_text("a user's")
    return tmp_path / "cache" / "jaxpar", tmp_path / "cache", f"{tmp_path / 'cache'} is a file where the cache's folder"


@pytest.mark.parametrize("make", [folder_for_the_file, file_for_the_folder, file_above_the_folder])
def test_a_cache_path_jaxpar_did_not_write_is_left_as_it_is(tmp_path, make):
    """A folder where kernel_tuning.json should be, or a file where its folder should be: one
    line says so, tuning goes on without keeping what it tunes, and what is there stays (before:
    an OSError from the save)."""
    folder, users, why = make(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    tuner = StandIn()
    configs, line = tuning_cache.tune(TuningCache(str(folder)), "nvidia_h200", REQUESTS, tuner)
    assert len(tuner.calls) == 3 and configs[REQUESTS[0]] == {"block_m": 64, "leg": "forward"}
    assert "\n" not in line and why in line and "it is left as it is" in line and line.endswith("not kept")
    assert users.read_text() == "a user's" and sorted(tmp_path.rglob("*")) == before  # nothing written


def test_a_cache_that_cannot_be_written_is_said_and_tuning_goes_on(tmp_path, monkeypatch):
    """A folder this user may not write (as a read-only disk would): one line, nothing kept."""
    def refused(**kwargs):
        raise PermissionError(13, "Permission denied")
    monkeypatch.setattr(tuning_cache.tempfile, "mkstemp", refused)
    tuner = StandIn()
    _, line = tuning_cache.tune(TuningCache(str(tmp_path)), "nvidia_h200", REQUESTS, tuner)
    assert len(tuner.calls) == 3 and "\n" not in line and line.endswith("not kept")
    assert f"{tmp_path / tuning_cache.CACHE_FILE} cannot be written (Permission denied)" in line
    assert not list(tmp_path.iterdir())
