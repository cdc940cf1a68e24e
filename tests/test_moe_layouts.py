"""Mixture of experts beyond its layouts (tests/test_layouts.py: ep=2 alone and with dp, tp, cp,
ZeRO-3 with gradient accumulation) against one device, losses, val losses and the router's
losses at rtol 1e-5: a 1F1B pipeline whose stages have dense layers between the sparse ones, two
processes, the Megablox kernels (interpreted) and a capacity factor; the router's losses as
logged and weighted. Apart from tests/test_moe.py so that the two run on both workers."""

import jax
import numpy as np
from conftest import tiny_config
from helpers import LOSS_RTOL, STEPS, assert_same_training, launch, logged_losses, losses, train

from jaxpar.models.transformer import build_model
from jaxpar.training.step.passes import make_loss_fn

MOE = "tiny_moe"


def test_a_capacity_factor_drops_the_same_on_every_layout():
    """Capacity 1.0 drops assignments (counted) and trains as one device on ep=2, whose dispatch
    then sends only the kept ones, in buffers of half the dropless room (2 rows x 2 experts x
    capacity 16 against 128 assignments): a row that did not fit would be lost, and the losses
    would differ."""
    capped = {"model.moe_capacity_factor": 1.0}
    one, split = train(config=MOE, **capped), train("dp=2,ep=2", config=MOE, **capped)
    dropped = [one.aux[s]["moe_dropped"] for s in sorted(one.aux)]
    assert min(dropped) > 0.01 and not np.allclose(losses(one), losses(reference()), rtol=LOSS_RTOL)
    np.testing.assert_allclose(losses(split), losses(one), rtol=LOSS_RTOL)
    np.testing.assert_allclose([split.aux[s]["moe_dropped"] for s in sorted(split.aux)], dropped, rtol=LOSS_RTOL)


def aux_of(result) -> np.ndarray:
    return np.array([[result.aux[s][name] for name in ("moe_balance", "moe_z", "moe_load")]
                     for s in sorted(result.aux)])


def reference():
    return train(config=MOE, evaluate=True)


def test_megablox_kernels_on_an_expert_parallel_layout_equal_one_device():
    """The Megablox grouped GEMM (TPU's default; interpreted here) behind the dense all-to-all,
    whose buffers hold rows past the groups, against the CPU's blocked GEMM on one device."""
    result = train("dp=2,ep=2", config=MOE, **{"model.moe_gemm": "megablox"})
    np.testing.assert_allclose(losses(result), losses(reference()), rtol=LOSS_RTOL)


def test_dense_layers_between_sparse_ones_on_a_pipeline_equal_one_device():
    """ep=2,pp=2 (1F1B) with every second layer sparse (HF's decoder_sparse_step=2): each stage
    runs its two layers, one dense and one with experts, as one device runs all four."""
    mixed = {"model.n_layer": 4, "model.moe_every": 2}
    one = train(config=MOE, evaluate=True, **mixed)
    result = train("ep=2,pp=2", config=MOE, evaluate=True, **{"pipeline.schedule": "1f1b"}, **mixed)
    assert_same_training(result, one)
    np.testing.assert_allclose(aux_of(result), aux_of(one), rtol=LOSS_RTOL)
    assert not np.allclose(losses(one), losses(reference()), rtol=LOSS_RTOL)


def test_expert_parallel_in_two_processes_matches_one_device(tmp_path):
    out = tmp_path / "run"
    launch(out, "--config", MOE, "--mesh", "dp=2,ep=2", "--steps", str(STEPS))
    got = logged_losses(out)
    assert sorted(got) == list(range(STEPS))
    np.testing.assert_allclose([got[s] for s in range(STEPS)], losses(reference()), rtol=LOSS_RTOL)


def test_router_losses_are_logged_and_weighted():
    balance, z, load = aux_of(reference()).T
    assert np.all(balance > 0) and np.all(z > 0) and np.all(load >= 1)
    cfg = tiny_config(MOE)
    model = build_model(cfg, 65)
    params, tokens = model.init(0), jax.random.randint(jax.random.key(0), (2, 32), 0, 65)
    total, metrics = make_loss_fn(model)(params, tokens, tokens)
    m = cfg.model
    expected = metrics["loss"] + m.router_aux_coef * metrics["moe_balance"] + m.router_z_coef * metrics["moe_z"]
    np.testing.assert_allclose(total, expected, rtol=1e-6)
    assert total - metrics["loss"] > 1e-3  # the router's losses are really in it
