"""The data order is a function of (seed, step) only: the same global batch on every mesh."""

import jax
import numpy as np
from conftest import mesh_overrides, tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import rule_table
from jaxpar.core.config import Config, DataConfig, load_config
from jaxpar.data.loader import BatchLoader, CharTokenizer, batch_offsets, load_dataset
from jaxpar.parallel.mesh import build_mesh


def global_batch(spec: str, step: int, grad_accum: int = 1):
    cfg = tiny_config(**mesh_overrides(spec))
    n = cfg.mesh.dp * cfg.mesh.tp * cfg.mesh.pp
    mesh = build_mesh(cfg, jax.devices()[:n])
    data = load_dataset(cfg.data, cfg.model.block_size)
    loader = BatchLoader(data, "train", 7, 8, grad_accum, cfg.model.block_size, mesh)
    return [np.asarray(a) for a in loader(step)], loader


def test_batch_is_the_same_on_every_mesh():
    (x1, y1), _ = global_batch("dp=1", step=3)
    for spec in ("dp=2", "dp=4,tp=2", "dp=8"):
        (x, y), loader = global_batch(spec, step=3)
        np.testing.assert_array_equal(x, x1)
        np.testing.assert_array_equal(y, y1)
    assert tuple(loader.sharding.spec)[1] == rule_table()["batch"] == ("data", "expert")  # rows split as 'batch'
    assert loader.sharding.is_equivalent_to(NamedSharding(loader.sharding.mesh, P(None, "data", None)), 3)  # ep=1


def test_targets_are_inputs_shifted_by_one():
    (x, y), _ = global_batch("dp=2", step=0)
    np.testing.assert_array_equal(x[..., 1:], y[..., :-1])


def test_grad_accumulation_splits_the_same_rows():
    (x1, _), _ = global_batch("dp=1", step=5)
    (x2, _), _ = global_batch("dp=2", step=5, grad_accum=2)
    np.testing.assert_array_equal(x2.reshape(x1.shape), x1)


def test_offsets_depend_on_seed_split_and_step():
    a = batch_offsets(1, "train", 0, 16, 10_000, 32)
    np.testing.assert_array_equal(a, batch_offsets(1, "train", 0, 16, 10_000, 32))
    for other in (batch_offsets(2, "train", 0, 16, 10_000, 32),
                  batch_offsets(1, "val", 0, 16, 10_000, 32),
                  batch_offsets(1, "train", 1, 16, 10_000, 32)):
        assert not np.array_equal(a, other)


def test_builtin_corpus_and_split():
    data = load_dataset(DataConfig(), block_size=64)
    assert data.tokenizer.vocab_size == 65
    assert len(data.train) + len(data.val) == 1_115_394
    assert len(data.val) == 111_539  # 10%


def test_tokenizer_round_trip():
    tok = CharTokenizer.from_text("hello world")
    assert tok.decode(tok.encode("low hold")) == "low hold"


def test_default_config_file_equals_builtin_defaults():
    assert load_config("shakespeare_char_cpu", {}) == load_config(None, {})
    assert load_config(None, {}).optimizer.decay_steps == Config().train.steps


def test_micro_batch_caps_rows_per_device():
    from jaxpar.core.strategies import passes_within
    t = tiny_config(**{"train.batch_size": 12, "train.micro_batch": 6}).train
    assert [passes_within(t, dp) for dp in (1, 2, 4)] == [2, 1, 1]
    t = tiny_config(**{"train.batch_size": 12, "train.micro_batch": 5}).train
    assert passes_within(t, 1) == 3  # 12 rows: 3 passes of 4, the fewest that fit in 5
    t = tiny_config(**{"train.batch_size": 12, "train.micro_batch": 0, "train.grad_accum": 2}).train
    assert passes_within(t, 1) == 2
