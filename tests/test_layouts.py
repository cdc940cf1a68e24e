"""Every family on every layout trains as one device does (tests/layouts.py's suite): data, tensor,
sequence and expert parallelism, ZeRO, gradient accumulation, micro-batches, a rolled layer scan,
and the model's own variants, each family's tiny config against its one-device run. The pipeline
schedules run in tests/test_pipeline.py, the context strategies in tests/test_context.py, from the
same suite. Here too: the control that the comparison fails, and that the suite covers every
registered family, schedule and strategy.

Tolerances: losses, val losses and auxiliary losses within rtol 1e-5; each final param within
1e-5 of that tensor's largest magnitude.
"""

import numpy as np
import pytest
from conftest import tiny_config
from helpers import STEPS, launch, logged_losses, losses, train
from layouts import (
    CONFIGS,
    CONTEXTS,
    GPT2,
    LAYOUTS,
    LLAMA,
    MOE,
    PIPELINES,
    SCHEDULE_CONTRACT,
    SCHEDULE_DEFAULTS,
    STRATEGY_CONTRACT,
    STRATEGY_DEFAULTS,
    assert_same_run,
    check,
    layout_cases,
)

from jaxpar.models.registry import FAMILIES
from jaxpar.nn.context import STRATEGIES
from jaxpar.parallel.schedules import SCHEDULES


@pytest.mark.parametrize("case", layout_cases())
def test_layout_matches_one_device(case):
    check(case)


@pytest.mark.parametrize("config", [*(GPT2, LLAMA, MOE), *(pytest.param(c, marks=pytest.mark.slow)
                                                          for c in CONFIGS if c not in (GPT2, LLAMA, MOE))])
def test_the_comparison_detects_a_one_percent_larger_learning_rate(config):
    """The control: the tolerances catch a 1% change in learning rate."""
    other = train(config=config, evaluate=True, **{"optimizer.lr": tiny_config(config).optimizer.lr * 1.01})
    with pytest.raises(AssertionError):
        assert_same_run(other, train(config=config, evaluate=True))


def test_the_suite_covers_every_registered_family_schedule_and_strategy():
    """A family needs a tiny config in the suite; the default tables name registered entries and
    rows only (a schedule or strategy they do not name runs the contract)."""
    assert {tiny_config(config).model.family for config in CONFIGS} == set(FAMILIES)
    assert set(SCHEDULE_DEFAULTS) <= set(SCHEDULES) and set(STRATEGY_DEFAULTS) <= set(STRATEGIES)
    assert all(set(default) <= set(row.configs) for row, default in LAYOUTS.values())
    for rows, tables in ((PIPELINES, [SCHEDULE_CONTRACT, *SCHEDULE_DEFAULTS.values()]),
                         (CONTEXTS, [STRATEGY_CONTRACT, *STRATEGY_DEFAULTS.values()])):
        for table in tables:
            assert set(table) <= set(rows)
            assert all(set(configs) <= set(rows[name].configs) for name, configs in table.items())


@pytest.mark.slow  # tests/test_context.py's two processes (dp=2,cp=2) train this config across processes
def test_llama_in_two_processes_matches_one(tmp_path):
    out = tmp_path / "run"
    launch(out, "--config", LLAMA, "--mesh", "dp=2,tp=2", "--steps", str(STEPS))
    got = logged_losses(out)
    assert sorted(got) == list(range(STEPS))
    np.testing.assert_allclose([got[s] for s in range(STEPS)], losses(train(config=LLAMA, evaluate=True)), rtol=1e-5)
