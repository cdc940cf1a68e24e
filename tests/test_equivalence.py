"""What GPT-2 trains with beyond its layout trains as one device does: attention in query blocks,
an auxiliary loss on a pipeline and on passes summed locally, bf16 compute; and a learning rate of
0 leaves the weights as they were. The layouts themselves, every family's: tests/test_layouts.py.

Tolerances: losses within rtol 1e-5; each final param within 1e-5 of that tensor's largest magnitude.
"""


import jax
import numpy as np
import pytest
from conftest import tiny_config
from helpers import assert_same_training, losses, train

from jaxpar.models.transformer import build_model
from jaxpar.nn import attention


@pytest.fixture(scope="module")
def one_device():
    return train()


def test_attention_in_query_blocks_matches_one_block(one_device, monkeypatch):
    """Queries in blocks of 8 (4 blocks at block 32) that skip the masked keys, on a mesh, train
    as attention over the whole square on one device (block 32 is one block by default)."""
    monkeypatch.setattr(attention, "QUERY_BLOCK", 8)
    assert attention.query_blocks(32) == [(0, 8), (8, 16), (16, 24), (24, 32)]
    assert_same_training(train("dp=2,tp=2"), one_device)


def test_bfloat16_compute_tracks_float32(one_device):
    """bf16 matmuls with f32 master weights stay close to the f32 loss curve (not equal)."""
    bf16 = train(**{"model.dtype": "bfloat16"})
    np.testing.assert_allclose(losses(bf16), losses(one_device), rtol=2e-2)
    assert all(p.dtype == np.float32 for p in jax.tree.leaves(bf16.params))


AUX = {"model.test_activation_l2": 0.05}  # an auxiliary loss on every block's output (tests only)


@pytest.fixture(scope="module")
def one_device_with_aux():
    return train(**AUX)


@pytest.mark.parametrize("spec, overrides", [("dp=2,tp=2", {}), ("pp=2", {}), ("dp=2", {"train.micro_batch": 2})],
                         ids=["dp=2,tp=2", "pp=2", "dp=2,accumulated"])
def test_an_auxiliary_loss_trains_the_same_on_every_layout(one_device_with_aux, spec, overrides):
    """A block's auxiliary loss reaches the loss with its weight and is logged, on one pass, a
    pipeline's stages, and passes summed locally: the same losses, auxiliary values and params."""
    result = train(spec, **AUX, **overrides)
    assert_same_training(result, one_device_with_aux)
    logged = [result.aux[s]["activation_l2"] for s in range(len(result.aux))]
    reference = [one_device_with_aux.aux[s]["activation_l2"] for s in range(len(result.aux))]
    np.testing.assert_allclose(logged, reference, rtol=1e-5)
    assert min(logged) > 0


def test_the_auxiliary_loss_changes_training(one_device_with_aux):
    """The control: without it (or with another weight) the same run trains otherwise."""
    plain = losses(train())
    assert losses(one_device_with_aux)[0] == plain[0]  # the same params see the same batch first
    assert np.abs(losses(one_device_with_aux)[1:] - plain[1:]).max() > 1e-4
    assert not train().aux


def test_a_learning_rate_of_0_leaves_the_weights_as_they_were():
    """A frozen run (lr = min_lr = 0: weights into a checkpoint, or a step timed) is allowed and
    changes no weight, bit for bit, weight decay included."""
    result = train(**{"train.lr": 0, "train.min_lr": 0, "train.steps": 2})
    cfg = tiny_config(**{"train.lr": 0, "train.min_lr": 0})
    # Drawn under jit, as the trainer draws them (eager draws differ in the last bit).
    initial = jax.jit(lambda: build_model(cfg, result.info["vocab_size"]).init(cfg.train.seed))()
    jax.tree.map(np.testing.assert_array_equal, result.params, initial)


def test_bfloat16_matches_across_meshes():
    """bf16 compute on dp=2,tp=2 against bf16 on one device: losses within rtol 1e-4 (bf16 rounds
    tensor parallelism's partial dots on their own; 2.3e-6 apart at the tests' seed), and a
    learning rate 1% higher is not."""
    bf16 = {"model.dtype": "bfloat16"}
    reference = losses(train(**bf16))
    np.testing.assert_allclose(losses(train("dp=2,tp=2", **bf16)), reference, rtol=1e-4)
    with pytest.raises(AssertionError):
        np.testing.assert_allclose(losses(train(**bf16, **{"train.lr": 0.003 * 1.01})), reference, rtol=1e-4)
