"""Context parallelism (`--mesh cp=N`) trains as one device does, under every strategy of
jaxpar.nn.context's registry (tests/layouts.py's suite: the zigzag ring, Ulysses' all-to-alls) for
GPT-2, Llama (GQA, llama3 RoPE) and DeepSeek (MLA), alone and with data, tensor, sequence and
pipeline parallelism, ZeRO-3 and accumulation; and in two processes. The step's collectives are
each strategy's own; evaluation on a cp mesh says it gathers the sequence; the combinations not
supported yet, and what the ring needs, are one-line errors; a checkpoint from before the axis
resumes on it.

Tolerances, as tests/test_equivalence.py's: losses (and val losses) within rtol 1e-5; each final
param within 1e-5 of that tensor's largest magnitude.
"""

from pathlib import Path

import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import STEPS, fails_with, launch, logged_losses, losses, train
from layouts import check, strategy_cases

from jaxpar.eval import main as eval_main
from jaxpar.parallel.mesh import build_mesh
from jaxpar.training.step.build import build


@pytest.mark.parametrize("case", strategy_cases())
def test_context_strategy_matches_one_device(case):
    """Each registered strategy on the cp layouts it takes, as one device (tests/layouts.py)."""
    check(case)


# GPT-2's ring composes with 'data' as Llama's does: slow, as its plain dp=2,cp=2 above.
@pytest.mark.parametrize("config", [pytest.param("tiny", marks=pytest.mark.slow), "tiny_llama"])
def test_two_processes_with_a_context_ring_match_one(config, tmp_path):
    out = tmp_path / "run"
    launch(out, "--config", config, "--mesh", "dp=2,cp=2", "--steps", str(STEPS))
    reference = losses(train(config=config, evaluate=True))
    got = logged_losses(out)
    np.testing.assert_allclose([got[s] for s in range(STEPS)], reference, rtol=1e-5)


def test_the_compiled_step_passes_kv_blocks_around_the_ring_or_trades_splits_by_all_to_all():
    """The step's HLO has the ring's collective-permutes (none without cp); Ulysses' has all-to-alls
    and no collective-permute."""
    import jax
    texts = {}
    for spec, strategy in (("dp=4", "ring"), ("cp=4", "ring"), ("cp=4", "ulysses")):
        cfg = tiny_config(**mesh_overrides(spec), **{"model.context_strategy": strategy})
        mesh = build_mesh(cfg, jax.devices()[:4])
        texts[spec, strategy] = build(cfg, mesh, vocab=65).compile_abstract().as_text()
    assert "collective-permute" not in texts["dp=4", "ring"] and "collective-permute" in texts["cp=4", "ring"]
    assert "all-to-all" in texts["cp=4", "ulysses"] and "collective-permute" not in texts["cp=4", "ulysses"]


def test_eval_on_a_context_mesh_gathers_the_sequence_and_says_so(tmp_path, capsys):
    import json

    import jax

    from jaxpar.train import run
    run(tiny_config(**{"train.steps": 2, "train.eval_every": 0}), tmp_path, jax.devices()[:1], progress=False)
    losses = []
    for mesh in ("dp=1", "dp=2,cp=2"):
        eval_main(["--ckpt", str(tmp_path), "--mesh", mesh])
        out = capsys.readouterr()
        losses.append(json.loads(out.out)["loss"])
    assert "cp=2: sequences are not split here" in out.err
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)


@pytest.mark.parametrize("argv, expected", [
    (["--mesh", "cp=8", "--model.block_size=24"], ["cp=8 needs model.block_size divisible by 2*cp=16", "got 24"]),
    (["--mesh", "dp=4,cp=2", "--model.dropout=0.1"], ["model.dropout=0.1 with cp=2", "--model.dropout=0"]),
    (["--mesh", "cp=2,tp=4", "--model.sequence_parallel=true", "--model.block_size=36"],
     ["sequence parallelism with cp=2 splits the stream over cp*tp=8", "block_size=36"]),
    (["--mesh", "cp=4,tp=2", "--model.context_strategy=ulysses"],
     ["model.context_strategy=ulysses splits the 4 heads over tp x cp = 8 devices", "--model.context_strategy=ring"]),
    (["--mesh", "cp=2,dp=4", "--model.context_strategy=spiral"], ["model.context_strategy must be one of ring, ulysses"]),
])
def test_what_the_ring_cannot_do_is_one_line(capsys, tmp_path, argv, expected):
    fails_with(capsys, tmp_path, ["--config", "tiny"] + argv, *expected)


OLD_CHECKPOINT = Path(__file__).parent / "fixtures" / "ckpt_before_context_axis"


def test_a_checkpoint_from_before_the_context_axis_resumes_on_it(tmp_path):
    """The fixture: 3 steps of the tiny config on dp=2,tp=2 by jaxpar at fab89a1, whose mesh had
    three axes (`python -m jaxpar.train --config tiny --steps 3 --train.decay_steps=5
    --train.eval_every=0 --mesh dp=2,tp=2`). Resumed to step 5 on dp=2,cp=2, its steps 3 and 4
    train as one device's 5 steps do (rtol 1e-5)."""
    import shutil

    import jax

    from jaxpar.train import run
    out = tmp_path / "run"
    shutil.copytree(OLD_CHECKPOINT, out)
    cfg = tiny_config(**mesh_overrides("dp=2,cp=2"), **{"train.steps": 5, "train.eval_every": 0})
    resumed = run(cfg, out, jax.devices()[:4], progress=False)
    assert sorted(resumed.losses) == [3, 4]  # restored at step 3, not started over
    reference = train(**{"train.steps": 5})
    np.testing.assert_allclose([resumed.losses[s] for s in (3, 4)], [reference.losses[s] for s in (3, 4)], rtol=1e-5)
