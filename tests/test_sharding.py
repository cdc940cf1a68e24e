"""Every param and optimizer moment is placed exactly as the rule table says, and stays there;
the residual stream is laid out as the table in force says (sequence parallelism); a size-1 mesh
axis splits nothing, so the one table gives every layout the shardings its own table gave."""

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from conftest import mesh_overrides, tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxpar.core.axes import rule_table
from jaxpar.core.errors import UserError
from jaxpar.core.execution import ExecutionPlan
from jaxpar.core.sharding import check_divisible, logical_to_spec
from jaxpar.models.transformer import abstract_model, split_layers
from jaxpar.parallel.mesh import build_mesh, resolve_mesh_shape
from jaxpar.train import run
from jaxpar.training.step.build import build


def test_rule_table_maps_megatron_layout():
    assert logical_to_spec(("layers", "embed", "qkv", "heads", "head_dim")) == \
        P("pipe", None, None, "tensor", None)
    assert logical_to_spec(("layers", "mlp", "embed")) == P("pipe", "tensor", None)
    assert logical_to_spec(("vocab", "embed")) == P("tensor", None)
    assert logical_to_spec(("batch", "seq", "embed")) == P(("data", "expert"), "context", None)
    assert logical_to_spec(("tokens", "embed")) == P(("data", "expert", "context"), None)
    assert logical_to_spec(("layers", "experts", "mlp", "embed")) == P("pipe", "expert", "tensor", None)


# The four tables jaxpar chose between before the mesh's axes became data (jaxpar.core.axes):
# plain, sequence-parallel, context-parallel, and both.
PLAIN = {"batch": "data", "tokens": "data", "vocab": "tensor", "heads": "tensor", "kv_heads": "tensor",
         "mlp": "tensor", "layers": "pipe", "embed": None, "pos": None, "seq": None, "qkv": None,
         "gate_up": None, "head_dim": None, "microbatch": None, "stream_seq": None}
SEQUENCE = {**PLAIN, "stream_seq": "tensor"}
CONTEXT = {**PLAIN, "seq": "context", "stream_seq": "context", "tokens": ("data", "context")}
BOTH = {**CONTEXT, "stream_seq": ("context", "tensor")}


@pytest.mark.parametrize("spec, old, sequence_parallel", [
    ("dp=2,tp=2", PLAIN, False), ("dp=2,tp=2", SEQUENCE, True), ("dp=2,pp=2,tp=2", PLAIN, False),
    ("dp=2,cp=2,tp=2", CONTEXT, False), ("cp=2,tp=2", BOTH, True), ("dp=8", SEQUENCE, True)])
def test_the_one_table_splits_as_each_layout_s_own_table_did(spec, old, sequence_parallel):
    """Size-1 axes are no-ops: where cp (or tp) is 1, every logical axis the new table maps to it
    is split exactly as the old table that left it out split it."""
    cfg = tiny_config(**mesh_overrides(spec), **{"train.batch_size": 16})
    mesh = build_mesh(cfg, jax.devices()[:math.prod(cfg.mesh.__dict__.values())])
    new = rule_table(sequence_parallel)
    # The mixture of experts' (ep=1 here), its stacks where dense layers mix with sparse ones, and
    # MLA's latent, DeepSeek's multi-token prediction modules and dense first layers (replicated).
    assert set(new) - set(old) == {"experts", "routes", "sparse_layers", "dense_layers", "latent", "mtp_layers",
                                   "lead_layers"}
    for name in old:
        assert NamedSharding(mesh, P(new[name])).is_equivalent_to(NamedSharding(mesh, P(old[name])), 1), name
    assert new["sparse_layers"] == new["dense_layers"] == new["layers"]
    for name in ("experts", "routes", "latent", "mtp_layers", "lead_layers"):
        assert NamedSharding(mesh, P(new[name])).is_equivalent_to(NamedSharding(mesh, P()), 1), name


def test_a_context_axis_of_two_does_split_what_the_plain_table_left_whole():
    """The control: with cp=2 the new table's 'seq' and 'tokens' are not the plain table's."""
    mesh = build_mesh(tiny_config(**mesh_overrides("dp=2,cp=2")), jax.devices()[:4])
    new = rule_table()
    differ = [name for name in PLAIN
              if not NamedSharding(mesh, P(new[name])).is_equivalent_to(NamedSharding(mesh, P(PLAIN[name])), 1)]
    assert sorted(differ) == ["seq", "stream_seq", "tokens"]


def test_unknown_logical_axis_raises():
    with pytest.raises(ValueError, match="unknown logical axis 'hidden'"):
        logical_to_spec(("hidden", "embed"))


def test_conflicting_logical_axes_raise():
    with pytest.raises(ValueError, match="same mesh axis twice"):
        logical_to_spec(("heads", "mlp"))  # both map to 'tensor'


def test_uneven_split_raises():
    cfg = tiny_config(**mesh_overrides("tp=4"), **{"train.batch_size": 8})
    mesh = build_mesh(cfg, jax.devices()[:4])
    with pytest.raises(ValueError, match="size 6 does not divide over mesh axis 'tensor' of size 4"):
        check_divisible("blocks.qkv.kernel", (6, 32), P("tensor", None), mesh)


def test_params_and_moments_follow_rules_after_training():
    cfg = tiny_config(**mesh_overrides("dp=2,tp=2"), **{"train.steps": 2, "train.eval_every": 0})
    result = run(cfg, devices=jax.devices()[:4], progress=False)
    _, _, axes = abstract_model(cfg, 65)
    expected = jax.tree.map(logical_to_spec, axes, is_leaf=lambda x: isinstance(x, tuple))

    def spec_of(array):
        return array.sharding.spec
    actual = jax.tree.map(spec_of, result.params)
    normalise = lambda spec: tuple(spec) + (None,) * 8  # noqa: E731  P('a') == P('a', None)
    for (path, want), got in zip(jax.tree_util.tree_leaves_with_path(expected, is_leaf=lambda x: isinstance(x, P)),
                                 jax.tree.leaves(actual, is_leaf=lambda x: isinstance(x, P))):
        assert normalise(got)[:8] == normalise(want)[:8], (jax.tree_util.keystr(path), got, want)
    # The tensor axis really splits the big matrices.
    assert "tensor" in tuple(result.params["blocks"]["qkv"]["kernel"].sharding.spec)
    assert "tensor" in tuple(result.params["wte"].sharding.spec)


def test_adam_moments_share_their_params_sharding_without_zero():
    cfg = tiny_config(**mesh_overrides("dp=2,tp=2"), **{"train.zero": 0})
    mesh = build_mesh(cfg, jax.devices()[:4])
    built = build(cfg, mesh, vocab=65)
    tx = built.tx
    with jax.set_mesh(mesh):
        state = built.init_state()
    moments = optax.tree_map_params(tx, lambda p: p.sharding, state.opt_state,
                                    transform_non_params=lambda _: None)
    found = 0
    for moment_tree in jax.tree.leaves(moments, is_leaf=lambda x: isinstance(x, dict) and "wte" in x):
        if isinstance(moment_tree, dict):
            assert jax.tree.map(lambda s: s.spec, moment_tree) == \
                jax.tree.map(lambda a: a.sharding.spec, state.params)
            found += 1
    assert found == 2  # AdamW's mu and nu


def test_rules_cover_every_model_axis():
    cfg = tiny_config()
    _, _, axes = abstract_model(cfg, 65)
    used = {name for t in jax.tree.leaves(axes, is_leaf=lambda x: isinstance(x, tuple)) for name in t}
    assert used <= set(rule_table())


@pytest.mark.parametrize("rules, stream", [(rule_table(), P("data", None, None)),
                                           (rule_table(sequence_parallel=True), P("data", "tensor", None))],
                         ids=["tensor-parallel", "sequence-parallel"])
def test_the_stream_between_blocks_is_split_along_the_sequence_only_under_sequence_parallelism(
        rules, stream):
    """The blocks' output, the residual stream, as the rule table in force lays it out."""
    cfg = tiny_config(**mesh_overrides("dp=2,tp=2"))
    mesh = build_mesh(cfg, jax.devices()[:4])
    model, shapes, axes = abstract_model(cfg, 65)
    _, _, layers, layer_axes = split_layers(shapes, axes)
    x = jax.ShapeDtypeStruct((8, cfg.model.block_size, cfg.model.n_embd), jnp.float32)
    plan = ExecutionPlan(mesh=mesh, sequence_parallel=stream != P("data", None, None))
    run = lambda p, x: model.on(plan).run_layers(p, layer_axes, x)[0]  # noqa: E731
    with jax.set_mesh(mesh):
        compiled = jax.jit(run).lower(layers, x).compile()
    assert compiled.output_shardings.is_equivalent_to(NamedSharding(mesh, stream), 3)


def test_sequence_parallelism_names_the_block_size_it_cannot_split():
    with pytest.raises(UserError, match="tp=4 does not divide model.block_size=30"):
        resolve_mesh_shape(tiny_config(**mesh_overrides("dp=2,tp=4"), **{
            "model.sequence_parallel": "true", "model.block_size": 30}), 8)
