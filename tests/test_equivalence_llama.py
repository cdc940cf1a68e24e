"""The Llama family under every layout trains as one device does: configs/tiny_llama.toml (GQA 4/2,
SwiGLU, RMSNorm, llama3 RoPE scaling, an untied lm_head) on data, tensor (with 2 KV heads split over
tp=2) and sequence parallelism, ZeRO-3, gradient accumulation, all four pipeline
schedules (GPipe, 1F1B and ZB-H1 on pp=2, interleaved on pp=4), and two processes.

Tolerances, as tests/test_equivalence.py's: losses within rtol 1e-5; each final param within 1e-5
of that tensor's largest magnitude. A 1%-lr control shows the comparison can fail.
"""

import numpy as np
import pytest
from helpers import STEPS, assert_same_training, launch, logged_losses, losses, train

LLAMA = "tiny_llama"


@pytest.fixture(scope="module")
def one_device():
    return train(config=LLAMA, evaluate=True)


# Marked slow: tp=2 alone (dp=2,tp=2 splits the 2 KV heads one per tensor rank too), ZeRO 2 (the
# family's params split as ZeRO 3 splits them; tests/test_zero.py runs each stage), and the
# GPipe and ZB-H1 tables (the executor is the family's business nowhere: tests/test_pipeline.py).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("spec, overrides", [
    ("dp=2,tp=2", {"train.zero": 0}),
    pytest.param("tp=2", {"train.zero": 0}, marks=SLOW),
    ("tp=2", {"model.sequence_parallel": "true"}),
    pytest.param("dp=2", {"train.zero": 2}, marks=SLOW),
    ("dp=2", {"train.zero": 3}),
    ("dp=2", {"train.grad_accum": 2}),  # ZeRO 1, the default
    ("pp=2", {"pipeline.schedule": "1f1b"}),
    pytest.param("pp=2", {"pipeline.schedule": "gpipe"}, marks=SLOW),
    pytest.param("pp=2", {"pipeline.schedule": "zb-h1"}, marks=SLOW),
])
def test_llama_layout_matches_one_device(one_device, spec, overrides):
    assert_same_training(train(spec, evaluate=True, config=LLAMA, **overrides), one_device)


@pytest.mark.slow  # the executor is the family's business nowhere: tests/test_pipeline.py runs it on GPT-2
def test_llama_interleaved_pipeline_on_four_stages_matches_one_device():
    """pp=4 with 2 layer chunks per stage: 8 layers, a reference of its own."""
    deep = {"model.n_layer": 8}
    assert_same_training(train("pp=4", config=LLAMA, **deep, **{"pipeline.schedule": "interleaved",
                                                                "pipeline.virtual": 2}),
                         train(config=LLAMA, **deep))


def test_qk_norm_and_a_wider_head_split_over_tensor_match_one_device():
    """QK-norm over all heads together (OLMoE's), with heads split over 'tensor', and head_dim 48 of
    n_embd 128 over 4 heads: a reference of its own."""
    qk = {"model.qk_norm": "full", "model.head_dim": 48}
    assert_same_training(train("tp=2", config=LLAMA, **qk), train(config=LLAMA, **qk))


def test_llama_comparison_detects_a_different_run(one_device):
    other = train(config=LLAMA, evaluate=True, **{"train.lr": 0.003 * 1.01})
    with pytest.raises(AssertionError):
        assert_same_training(other, one_device)


@pytest.mark.slow  # tests/test_context.py's two processes (dp=2,cp=2) train this config across processes
def test_llama_in_two_processes_matches_one(one_device, tmp_path):
    out = tmp_path / "run"
    launch(out, "--config", LLAMA, "--mesh", "dp=2,tp=2", "--steps", str(STEPS))
    reference = dict(enumerate(losses(one_device)))
    got = logged_losses(out)
    assert sorted(got) == list(range(STEPS))
    np.testing.assert_allclose([got[s] for s in range(STEPS)], [reference[s] for s in range(STEPS)], rtol=1e-5)
