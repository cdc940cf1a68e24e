"""The optimizer comes from a registry, configured by the [optimizer] section, with the older
[train] names kept as aliases; its parameter groups come from the params' declared roles, and the
state it keeps is what --dry-run counts."""

import functools

import jax
import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import LOSS_RTOL, PARAM_TOL, assert_same_training, fails_with, losses, train
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.config import load_config
from jaxpar.models.transformer import build_model
from jaxpar.nn.params import BIAS, EMBEDDING, MATRIX, NORM, in_order
from jaxpar.parallel.mesh import build_mesh
from jaxpar.train import main as train_main
from jaxpar.train import run
from jaxpar.training.optimizers import registry as optimizers
from jaxpar.training.optimizers.registry import optimizer_for
from jaxpar.training.step.build import build


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
    (["--optimizer.name=sgd"], ["optimizer.name must be one of adamw, lion, adafactor, muon, got 'sgd'"]),
    (["--optimizer.lr=-1"], ["optimizer.lr must be >= 0, got -1.0"]),
    (["--train.grad_clip=-1"], ["train.grad_clip must be >= 0, got -1.0"]),
    (["--optimizer.beta1=x"], ["optimizer.beta1 expects float, got 'x'"]),
    (["--optimizer.decay_rate=0.5"], ["optimizer.decay_rate is a setting of adafactor", "optimizer.name=adamw"]),
    (["--optimizer.name=lion", "--train.adam_eps=1e-6"], ["train.adam_eps is a setting of adamw"]),
    (["--optimizer.schedule=step"], ["optimizer.schedule must be one of cosine, wsd, constant"]),
    (["--optimizer.schedule=wsd", "--optimizer.decay_steps=50", "--steps=20"],
     ["decays from step 40 to optimizer.decay_steps=50", "the run's end (train.steps=20)"]),
    (["--optimizer.schedule=wsd", "--optimizer.decay_from=1", "--optimizer.warmup_steps=2"],
     ["decays from step 1 to"]),
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
    tx = optimizer_for(cfg.optimizer, model)
    shapes = model.shapes()
    state = jax.eval_shape(tx.init, shapes)
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    one = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    paths = [path for path, _ in in_order(model.declared)]
    counted = optimizers.state_bytes_by_param(state, jax.tree.map(lambda _: one, state), paths)
    for path, param in in_order(model.declared):
        assert counted[path] == 2 * 4 * np.prod(param.shape), path


def lr_at(steps, **overrides):
    o = tiny_config(**{"train.steps": 100, "optimizer.warmup_steps": 10, "optimizer.lr": 1.0,
                       "optimizer.min_lr": 0.1, **overrides}).optimizer
    return np.array([float(optimizers.learning_rate(s, o, xp=np)) for s in steps])


def test_the_schedules():
    """cosine (nanoGPT's formula), WSD with its three decays, from a fraction or a step, and constant."""
    steps = [0, 9, 10, 50, 79, 80, 90, 99, 100]
    progress = np.clip((np.array(steps) - 10) / 90, 0, 1)
    nanogpt = np.where(np.array(steps) < 10, (np.array(steps) + 1) / 11, 0.1 + 0.45 * (1 + np.cos(np.pi * progress)))
    np.testing.assert_allclose(lr_at(steps), nanogpt, rtol=1e-12)
    decay = np.clip((np.array(steps) - 80) / 20, 0, 1)  # the default: the last 20% of 100 steps
    for shape, remaining in (("linear", 1 - decay), ("cosine", 0.5 * (1 + np.cos(np.pi * decay))),
                             ("1-sqrt", 1 - np.sqrt(decay))):
        expected = np.where(np.array(steps) < 10, (np.array(steps) + 1) / 11, 0.1 + 0.9 * remaining)
        np.testing.assert_allclose(lr_at(steps, **{"optimizer.schedule": "wsd", "optimizer.decay_shape": shape}),
                                   expected, rtol=1e-12)
    branch = lr_at([49, 50, 75, 100], **{"optimizer.schedule": "wsd", "optimizer.decay_from": 50})
    np.testing.assert_allclose(branch, [1.0, 1.0, 0.55, 0.1], rtol=1e-12)
    np.testing.assert_allclose(lr_at([10, 99], **{"optimizer.schedule": "constant"}), [1.0, 1.0])


@pytest.mark.parametrize("name", ["lion", "adafactor"])
def test_each_optimizer_is_optax_own(name):
    """One update of the registry's entry equals optax's optimizer built by hand, with weight decay
    on the matrices and embeddings alone."""
    import optax
    cfg = tiny_config(**{"optimizer.name": name, "optimizer.weight_decay": 0.5, "optimizer.warmup_steps": 0})
    model = build_model(cfg, 65)
    params = jax.jit(model.init, static_argnums=0)(0)
    grads = jax.tree.map(lambda p: 0.01 * jax.random.normal(jax.random.key(1), p.shape), params)
    decay = optimizers.decayed(model.roles())
    lr = float(optimizers.learning_rate(0, cfg.optimizer, xp=np))
    by_hand = {"lion": lambda: optax.lion(lr, b1=0.9, b2=0.99, weight_decay=0.5, mask=decay),
               "adafactor": lambda: optax.adafactor(lr, multiply_by_parameter_scale=False, weight_decay_rate=0.5,
                                                    weight_decay_mask=decay)}[name]()
    updates = [jax.jit(lambda p, g, tx=tx: tx.update(g, tx.init(p), p)[0])(params, grads)
               for tx in (optimizer_for(cfg.optimizer, model), by_hand)]
    for a, b in zip(jax.tree.leaves(updates[0]), jax.tree.leaves(updates[1])):
        np.testing.assert_allclose(a, b, rtol=1e-6)


# Newton-Schulz's quintic, a*x + b*x**3 + c*x**5 with optax's a = 3.4445, has slope a at zero:
# its five steps multiply a perturbation along a matrix's small singular directions by up to a**5
# (about 485). The reduction order's float32 rounding in a gradient reaches Muon's matrices up to
# that much larger than it reaches the params AdamW updates; the losses still agree at LOSS_RTOL.
NEWTON_SCHULZ_GAIN = 3.4445 ** 5


def muon_param_tol():
    """PARAM_TOL for the params AdamW updates, PARAM_TOL * NEWTON_SCHULZ_GAIN for Muon's matrices."""
    roles = build_model(tiny_config(), 65).roles()
    matrices = {jax.tree_util.keystr(path) for path, role in jax.tree_util.tree_leaves_with_path(roles)
                if role == MATRIX}
    return lambda path: PARAM_TOL * NEWTON_SCHULZ_GAIN if path in matrices else PARAM_TOL


# Lion's state is param-shaped, split as AdamW's moments are (tests/test_zero.py): marked slow.
# Muon's split over 'context' is its split over 'data' and 'tensor' (dp=2,tp=2,pp=2) on another
# axis: marked slow.
@pytest.mark.parametrize("name, lr, spec", [pytest.param("lion", 3e-4, "dp=2,tp=2,pp=2", marks=pytest.mark.slow),
                                            ("adafactor", 3e-3, "dp=2,tp=2,pp=2"), ("muon", 0.02, "dp=2,tp=2,pp=2"),
                                            pytest.param("muon", 0.02, "dp=4,cp=2", marks=pytest.mark.slow)])
def test_each_optimizer_trains_as_one_device_on_data_tensor_and_pipeline(name, lr, spec):
    """ZeRO 2 (the state split over 'data', Adafactor's factored rows and columns replicated,
    Muon's two groups each holding its own params' state, its Newton-Schulz work split over the
    stage's devices) against one device; none is AdamW (the control)."""
    chosen = {"optimizer.name": name, "optimizer.lr": lr} | ({"optimizer.adam_lr": 3e-3} if name == "muon" else {})
    one = train(**chosen)
    assert_same_training(train(spec, **chosen, **{"train.zero": 2}), one,
                         param_tol=muon_param_tol() if name == "muon" else lambda path: PARAM_TOL)
    assert not np.allclose(losses(one), losses(train()), rtol=LOSS_RTOL)


# The split's expert-sharded matrices, one step: test_one_muon_step_is_optax_muon_on_each_matrix.
@pytest.mark.slow
def test_muon_on_experts_trains_as_one_device():
    """A mixture of experts on ep=2,pp=2 with Muon: the losses and val losses at rtol 1e-5. Its
    params differ from one device's by up to 2e-5 of their largest magnitude (attn_out, in the
    split form and in optax's alike), above the suite's 1e-5: Newton-Schulz normalises each
    matrix's update, so the reduction order's rounding in a small gradient reaches the weights
    at the update's full size."""
    chosen = {"optimizer.name": "muon", "optimizer.lr": 0.02, "optimizer.adam_lr": 3e-3, "train.zero": 2}
    one, got = train(config="tiny_moe", evaluate=True, **chosen), train("ep=2,pp=2", evaluate=True, config="tiny_moe", **chosen)
    np.testing.assert_allclose(losses(got), losses(one), rtol=LOSS_RTOL)
    np.testing.assert_allclose(list(got.val_losses.values()), list(one.val_losses.values()), rtol=LOSS_RTOL)


def test_resuming_with_another_optimizer_is_refused_unless_the_state_is_reset(capsys, tmp_path):
    """AdamW's checkpoint: Lion refuses it in one line; with reset_state, Lion goes on from its
    weights with a new state, and the step count goes on."""
    out = tmp_path / "run"
    run(tiny_config(**{"train.steps": 2, "train.eval_every": 0}), out, jax.devices()[:1], progress=False)
    argv = ["--config", "tiny", "--out", str(out), "--steps", "3", "--optimizer.name=lion", "--train.eval_every=0",
            "--mesh", "dp=8"]
    with pytest.raises(SystemExit):
        train_main(argv)
    err = capsys.readouterr().err.strip()
    assert "trained with optimizer.name=adamw, not lion" in err and "--optimizer.reset_state=true" in err
    assert len(err.splitlines()) == 1
    cfg = tiny_config(**{"train.steps": 3, "train.eval_every": 0, "optimizer.name": "lion",
                         "optimizer.reset_state": True})
    result = run(cfg, out, jax.devices()[:1], progress=False)
    assert result.info["resumed_from"] == 2 and sorted(result.losses) == [2]


def as_matrices(array: np.ndarray, view: tuple) -> np.ndarray:
    """(batch, reduction, output) of a stacked param under its matrix view (Param.matrix)."""
    reduction, output = view
    batch = [d for d in range(array.ndim) if d not in reduction + output]
    moved = np.transpose(array, batch + list(reduction) + list(output))
    size = lambda dims: int(np.prod([array.shape[d] for d in dims]))
    return moved.reshape(size(batch), size(reduction), size(output))


@pytest.mark.parametrize("spec", [None, "dp=2,tp=2,ep=2"])
def test_one_muon_step_is_optax_muon_on_each_matrix(spec):
    """Every block matrix's update (each layer's q, k and v, dense gate and up, down stored out
    first, the router, each expert's gate, up and down: a Llama whose layer 0 is dense and layer 1
    sparse, so each has its own q, k, v and out, jaxpar.models.lead) equals optax.contrib.muon's on that 2-D matrix alone (rtol 1e-5, float32
    Newton-Schulz); the embeddings and norms take AdamW. On a mesh the work is split (the matrices
    of a shape in one batch over its 8 devices, jaxpar.training.optimizers.muon). The control: k and v as one
    matrix differ."""
    import optax
    cfg = tiny_config("tiny_moe", **{"optimizer.name": "muon", "optimizer.lr": 0.02, "optimizer.warmup_steps": 0,
                                     "optimizer.weight_decay": 0.0, "model.moe_every": 2},
                      **(mesh_overrides(spec) if spec else {}))
    model = build_model(cfg, 65)
    params = jax.jit(model.init, static_argnums=0)(0)
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(1), p.shape), params)
    mesh = build_mesh(cfg) if spec else None
    tx = build(cfg, mesh, vocab=65).tx if mesh is not None else optimizer_for(cfg.optimizer, model)
    if mesh is not None:
        params, grads = jax.device_put((params, grads), NamedSharding(mesh, P()))
    updates = jax.jit(lambda p, g: tx.update(g, tx.init(p), p)[0])(params, grads)
    lr = float(optimizers.learning_rate(0, cfg.optimizer, xp=np))
    one_matrix = optax.contrib.muon(lr, weight_decay=0.0)
    on_2d = jax.jit(jax.vmap(lambda g: one_matrix.update({"w": g}, one_matrix.init({"w": g}), {"w": g})[0]["w"]))
    checked, eps = 0, cfg.optimizer.eps
    for path, param in in_order(model.declared):
        leaf = lambda tree: np.asarray(functools.reduce(lambda node, key: node[key], path, tree))
        got, g = leaf(updates), leaf(grads)
        if param.role == MATRIX:
            expected = on_2d(as_matrices(g, param.matrix))
            np.testing.assert_allclose(as_matrices(got, param.matrix), expected, rtol=1e-5, atol=1e-7)
            checked += 1
        else:  # AdamW's first step: -lr g / (|g| + eps)
            np.testing.assert_allclose(got, -lr * g / (np.abs(g) + eps), rtol=1e-5)
    assert checked == sum(param.role == MATRIX for _, param in in_order(model.declared)) == 11
    kv = np.asarray(grads["blocks"]["kv"]["kernel"])
    fused = on_2d(as_matrices(kv, ((1,), (2, 3, 4))))
    assert not np.allclose(as_matrices(np.asarray(updates["blocks"]["kv"]["kernel"]), ((1,), (2, 3, 4))), fused,
                           rtol=1e-2)
