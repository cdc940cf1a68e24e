"""The optimizer comes from a registry, configured by the [optimizer] section, with the older
[train] names kept as aliases; its parameter groups come from the params' declared roles, and the
state it keeps is what --dry-run counts."""

import jax
import numpy as np
import pytest
from conftest import tiny_config
from helpers import fails_with

from jaxpar.core.config import load_config
from jaxpar.models.family import build_model
from jaxpar.models.params import BIAS, EMBEDDING, MATRIX, NORM, in_order
from jaxpar.training import optimizers
from jaxpar.training import step as steps


def test_older_names_set_the_optimizer_section(tmp_path):
    old = tiny_config(**{"train.lr": 3e-4, "train.beta2": 0.95, "train.adam_eps": 1e-6, "train.grad_clip": 0})
    new = tiny_config(**{"optimizer.lr": 3e-4, "optimizer.beta2": 0.95, "optimizer.eps": 1e-6,
                         "optimizer.grad_clip": 0})
    assert old.optimizer == new.optimizer and old.optimizer.lr == 3e-4
    file = tmp_path / "old.toml"
    file.write_text("[train]\nlr = 3e-4\nwarmup_steps = 7\n[optimizer]\nbeta1 = 0.8\n")
    cfg = load_config(str(file), {})
    assert (cfg.optimizer.lr, cfg.optimizer.warmup_steps, cfg.optimizer.beta1) == (3e-4, 7, 0.8)


@pytest.mark.parametrize("argv, expected", [
    (["--optimizer.name=sgd"], ["optimizer.name must be one of adamw, got 'sgd'"]),
    (["--optimizer.lr=-1"], ["optimizer.lr must be >= 0, got -1.0"]),
    (["--train.grad_clip=-1"], ["train.grad_clip must be >= 0, got -1.0"]),
    (["--optimizer.beta1=x"], ["optimizer.beta1 expects float, got 'x'"]),
])
def test_bad_optimizer_settings(capsys, tmp_path, argv, expected):
    fails_with(capsys, tmp_path, ["--config", "tiny"] + argv, *expected)


@pytest.mark.parametrize("config", ["tiny", "tiny_llama"])
def test_every_param_has_a_role_and_the_roles_give_the_decay_groups(config):
    """Matrices and embeddings are decayed, norm scales and biases are not (nanoGPT's rule)."""
    model = build_model(tiny_config(config), 65)
    roles = {path: param.role for path, param in in_order(model.declared)}
    by_name = {"kernel": MATRIX, "scale": NORM, "bias": BIAS, "wte": EMBEDDING, "wpe": EMBEDDING,
               "lm_head": EMBEDDING}
    assert roles == {path: by_name[path[-1]] for path in roles}
    decayed = {tuple(k.key for k in path): leaf
               for path, leaf in jax.tree_util.tree_leaves_with_path(optimizers.decayed(model.roles()))}
    assert decayed == {path: role in (MATRIX, EMBEDDING) for path, role in roles.items()}


def test_the_state_counted_per_param_is_what_the_optimizer_keeps():
    """AdamW keeps two moments of every param: the dry run's per-param bytes are twice the param's."""
    cfg = tiny_config()
    model = build_model(cfg, 65)
    tx = steps.make_optimizer(cfg, model)
    shapes = model.shapes()
    state = jax.eval_shape(tx.init, shapes)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    paths = [path for path, _ in in_order(model.declared)]
    counted = optimizers.state_bytes_by_param(state, jax.tree.map(lambda _: one, state), paths)
    for path, param in in_order(model.declared):
        assert counted[path] == 2 * 4 * np.prod(param.shape), path
