"""The equivalence suite's cases, drawn from the registries: each family's tiny config on each
layout, under each pipeline schedule (jaxpar.parallel.schedules.SCHEDULES) and each context
strategy (jaxpar.nn.context.STRATEGIES), trains as it does on one device. A schedule or strategy is
tested by being registered: one that the tables of default cases below do not name runs its
contract's cases (SCHEDULE_CONTRACT, STRATEGY_CONTRACT) by default, as DualPipeV and Ulysses do,
and every other case of the product with -m slow.

Tolerances (tests/helpers.py's): per-step losses, val losses where evaluated, and every logged
auxiliary loss (the router's, MTP's) within rtol 1e-5; each final param within 1e-5 of that
tensor's largest magnitude. tests/test_layouts.py holds the control that fails them.
"""

import dataclasses
from functools import partial

import numpy as np
import pytest
from conftest import mesh_overrides, tiny_config
from helpers import LOSS_RTOL, assert_same_training, losses, train

from jaxpar.core.axes import batch_ways, pipeline_microbatches
from jaxpar.core.errors import UserError
from jaxpar.nn.context import STRATEGIES
from jaxpar.parallel.schedules import DEFAULT as DEFAULT_SCHEDULE
from jaxpar.parallel.schedules import SCHEDULES

GPT2, LLAMA, MOE, DEEPSEEK = "tiny", "tiny_llama", "tiny_moe", "tiny_deepseek"
CONFIGS = (GPT2, LLAMA, MOE, DEEPSEEK)  # a tiny config per family; tiny_moe is Llama's with experts
EXPERTS = (MOE, DEEPSEEK)
ZERO0, SP = {"train.zero": 0}, {"model.sequence_parallel": "true"}


@dataclasses.dataclass(frozen=True)
class Layout:
    """A mesh and how a run uses it: `layout` overrides change how the same model trains, `model`
    ones the model, which the one-device reference shares. It applies to `configs`; `odd`: a
    pipeline's M that is not a multiple of pp."""
    spec: str
    layout: dict = dataclasses.field(default_factory=dict)
    model: dict = dataclasses.field(default_factory=dict)
    evaluate: bool = True
    configs: tuple = CONFIGS
    odd: bool = False


@dataclasses.dataclass(frozen=True)
class Case:
    config: str
    spec: str
    layout: dict
    model: dict
    evaluate: bool


# Families x layouts, with the default schedule and strategy. name: (layout, its default configs).
# The model's own variants (dropout, no biases, QK-norm, no query bottleneck) are trained without
# evaluation, as are their references.
LAYOUTS = {
    "dp=2": (Layout("dp=2", ZERO0), (GPT2,)),
    "tp=2": (Layout("tp=2", ZERO0), (GPT2,)),  # Llama's inside dp=2,tp=2 (2 KV heads a tensor rank)
    "dp=2,tp=2": (Layout("dp=2,tp=2", ZERO0), (GPT2, LLAMA, DEEPSEEK)),
    "dp=4,tp=2": (Layout("dp=4,tp=2", ZERO0), (GPT2,)),
    "dp=2-accumulated": (Layout("dp=2", {"train.grad_accum": 2}), (GPT2, LLAMA, MOE)),
    "dp=2-micro_batch_2": (Layout("dp=2", {"train.micro_batch": 2}), (GPT2,)),
    "tp=2-rolled": (Layout("tp=2", {"model.unroll_layers": "false"}), (GPT2,)),
    "tp=2-sp": (Layout("tp=2", SP), (LLAMA,)),  # GPT-2's inside dp=2,tp=2-sp
    "dp=2,tp=2-sp": (Layout("dp=2,tp=2", SP | ZERO0), (GPT2,)),
    "dp=2,tp=2-sp-zero3": (Layout("dp=2,tp=2", SP | {"train.zero": 3}), (GPT2,)),
    "tp=2,pp=2-sp": (Layout("tp=2,pp=2", SP | ZERO0), (GPT2,)),
    # GPT-2's ZeRO: tests/test_zero.py's matrix, with each stage's placement.
    "dp=2-zero2": (Layout("dp=2", {"train.zero": 2}, configs=(LLAMA, MOE, DEEPSEEK)), ()),  # as ZeRO 3 splits
    "dp=2-zero3": (Layout("dp=2", {"train.zero": 3}, configs=(LLAMA, MOE, DEEPSEEK)), (LLAMA,)),
    "dp=2,tp=2-dropout": (Layout("dp=2,tp=2", model={"model.dropout": 0.1}, evaluate=False), (GPT2,)),
    "dp=2,tp=2-bias_free": (Layout("dp=2,tp=2", model={"model.bias": "false"}, evaluate=False,
                                   configs=(GPT2,)), ()),  # Llama's layouts hold no biases
    # QK-norm over all heads together (OLMoE's), heads split over 'tensor', head_dim 48 of n_embd 128.
    "tp=2-qk_norm": (Layout("tp=2", model={"model.qk_norm": "full", "model.head_dim": 48}, evaluate=False,
                            configs=(LLAMA, MOE)), (LLAMA,)),
    "ep=2": (Layout("ep=2", configs=EXPERTS), ()),  # inside each of the next three
    "dp=2,ep=2": (Layout("dp=2,ep=2", configs=EXPERTS), (MOE,)),
    "ep=2,tp=2": (Layout("ep=2,tp=2", configs=EXPERTS), (MOE,)),
    "ep=2,cp=2": (Layout("ep=2,cp=2", configs=EXPERTS), (MOE,)),
    "ep=4": (Layout("ep=4", configs=EXPERTS), ()),  # ep=2's path, groups of one expert
    # The router's losses are per sequence: two half batches give the whole batch's values.
    "dp=2,ep=2-zero3-accumulated": (Layout("dp=2,ep=2", {"train.zero": 3, "train.grad_accum": 2},
                                           configs=EXPERTS), (MOE,)),
    "ep=2,pp=2": (Layout("ep=2,pp=2", configs=EXPERTS), ()),  # tests/test_moe_layouts.py's mixed stages
    # The dense first layer ahead of the pipeline, MLA without the query bottleneck, MTP on the last stage.
    "dp=2,ep=2,pp=2-no_q_bottleneck": (Layout("dp=2,ep=2,pp=2", model={"model.q_lora_rank": 0}, evaluate=False,
                                              configs=(DEEPSEEK,)), (DEEPSEEK,)),
}

# Families x pipeline schedules: each case at the fewest layers its schedule takes on pp stages.
PIPELINES = {
    "pp=2": Layout("pp=2", ZERO0, configs=(GPT2, LLAMA)),
    "pp=2-odd_M": Layout("pp=2", evaluate=False, odd=True),
    "pp=4": Layout("pp=4", ZERO0, evaluate=False),
    "pp=4-odd_M": Layout("pp=4", evaluate=False, configs=(GPT2,), odd=True),
    "dp=2,pp=2": Layout("dp=2,pp=2", ZERO0, configs=(GPT2,)),
    **{f"dp=2,pp=2-zero{z}": Layout("dp=2,pp=2", {"train.zero": z}, evaluate=False, configs=(GPT2,)) for z in (1, 2, 3)},
    "tp=2,pp=2": Layout("tp=2,pp=2", ZERO0, configs=(GPT2,)),
    "dp=2,tp=2,pp=2": Layout("dp=2,tp=2,pp=2", ZERO0, configs=(GPT2,)),  # its rows split by hand, as dp=2,pp=2's
}
# The default cases of the schedules that were here before the contract; each one's others are
# held by these (GPipe's and ZB-H1's pp=2 by four stages, 1F1B's pp=2 and dp=2,pp=2 by dp=2,tp=2,pp=2).
SCHEDULE_DEFAULTS = {
    "1f1b": {"pp=2": (LLAMA,), "pp=4": (GPT2,), "dp=2,pp=2-zero1": (GPT2,), "dp=2,pp=2-zero2": (GPT2,),
             "dp=2,tp=2,pp=2": (GPT2,)},
    "gpipe": {"pp=4": (GPT2,)},
    "zb-h1": {"pp=4": (GPT2,), "dp=2,pp=2-zero1": (GPT2,)},
    "interleaved": {"pp=4": (GPT2,), "dp=2,tp=2,pp=2": (GPT2,)},
}
# A schedule not named above: M not a multiple of pp on every family, four stages, ZeRO 1 and 3.
SCHEDULE_CONTRACT = {"pp=2-odd_M": CONFIGS, "pp=4": (GPT2,), "dp=2,pp=2-zero1": (GPT2,), "dp=2,pp=2-zero3": (GPT2,)}

# Families x context strategies.
CONTEXTS = {
    "cp=2": Layout("cp=2", configs=(GPT2, LLAMA, DEEPSEEK)),
    "cp=4": Layout("cp=4", configs=(GPT2, LLAMA)),
    "dp=2,cp=2": Layout("dp=2,cp=2", configs=(GPT2, LLAMA)),
    "cp=2,tp=2": Layout("cp=2,tp=2", configs=(GPT2, LLAMA)),
    "dp=2,cp=2-zero3": Layout("dp=2,cp=2", {"train.zero": 3}, configs=(GPT2, LLAMA)),
    "dp=2,cp=2-accumulated": Layout("dp=2,cp=2", {"train.grad_accum": 2}, configs=(GPT2, LLAMA)),
    "cp=2,tp=2-sp": Layout("cp=2,tp=2", SP, configs=(GPT2, LLAMA)),
    "cp=2,pp=2": Layout("cp=2,pp=2", configs=(GPT2, LLAMA)),
    "dp=2,tp=2,cp=2": Layout("dp=2,tp=2,cp=2", configs=(GPT2,)),
}
# The ring's: where the families differ under it (positions, norms in the split stream) shows on
# cp=2,tp=2-sp; Llama's cp=2 is cp=4's ring with fewer hops, its plain dp=2,cp=2 under ZeRO 3.
STRATEGY_DEFAULTS = {"ring": {"cp=2": (DEEPSEEK,), "cp=4": (LLAMA,), "dp=2,cp=2-zero3": (LLAMA,),
                              "cp=2,tp=2-sp": (GPT2, LLAMA), "cp=2,pp=2": (LLAMA,)}}
# A strategy not named above: Llama's 2 KV heads over cp=4, DeepSeek's latent attention, beside dp and tp.
STRATEGY_CONTRACT = {"cp=4": (LLAMA,), "cp=2": (DEEPSEEK,), "dp=2,tp=2,cp=2": (GPT2,)}


def refused(check, *args) -> bool:
    try:
        check(*args)
    except UserError:
        return True
    return False


def pipelined(case: Case, schedule: str = "", odd: bool = False) -> Case | None:
    """case on its pp stages under `schedule` ("": the default, left unset): a layer a chunk
    (besides the dense first layers, which run ahead), the chunks a stage the schedule holds, and
    the default M where the schedule takes it; odd: the smallest M not a multiple of pp it takes,
    2 rows each a data shard. None where the schedule takes no such M."""
    cls = SCHEDULES[schedule] if schedule else DEFAULT_SCHEDULE
    virtual = next(v for v in (1, 2, 3, 4) if not refused(cls.chunks_per_stage, v))
    V = cls.chunks_per_stage(virtual)
    cfg = tiny_config(case.config, **mesh_overrides(case.spec), **case.model)
    pp, ways = cfg.mesh.pp, batch_ways(cfg.mesh.__dict__)
    model = {"model.n_layer": cfg.model.lead_layers + pp * V}
    layout = {"pipeline.schedule": schedule} if schedule else {}
    if virtual != 1:
        layout["pipeline.virtual"] = virtual
    if odd:
        M = next((m for m in range(pp + 1, 8 * pp) if m % pp and not refused(cls.check, pp, m, V)), None)
        if M is None:
            return None
        model["train.batch_size"], layout["pipeline.microbatches"] = 2 * M * ways, M
    else:
        M = pipeline_microbatches(tiny_config(case.config, **mesh_overrides(case.spec), **model).run, ways, pp)
        if refused(cls.check, pp, M, V):
            M = next(m for m in range(pp, 8 * pp, pp) if not refused(cls.check, pp, m, V))
            model["train.batch_size"], layout["pipeline.microbatches"] = M * ways, M
    default = tiny_config(case.config)
    model = {k: v for k, v in model.items() if getattr(default.model if k.startswith("model.") else default.train,
                                                       k.split(".")[1]) != v}  # a reference shared where unchanged
    return dataclasses.replace(case, layout=case.layout | layout, model=case.model | model)


def on_strategy(case: Case, row: Layout, strategy: str) -> Case | None:
    """case with the context strategy, and its pipeline's shape; None where the strategy refuses it."""
    cfg = tiny_config(case.config, **mesh_overrides(case.spec), **case.layout, **case.model)
    if refused(STRATEGIES[strategy].check, cfg.model, cfg.mesh.cp, cfg.mesh.tp, cfg.model.dropout):
        return None
    case = dataclasses.replace(case, layout=case.layout | {"model.context_strategy": strategy})
    return pipelined(case) if cfg.mesh.pp > 1 else case


def shaped(case: Case, row: Layout) -> Case:
    return pipelined(case) if "pp=" in case.spec else case


def params(rows: dict[str, Layout], defaults: dict[str, tuple], prefix: str = "", shape=shaped) -> list:
    """A pytest param per row and config it applies to (shape: the row's case made runnable, or
    None), marked slow unless `defaults` names the config for the row."""
    out = []
    for name, row in rows.items():
        for config in row.configs:
            case = shape(Case(config, row.spec, dict(row.layout), dict(row.model), row.evaluate), row)
            if case is not None:
                slow = () if config in defaults.get(name, ()) else (pytest.mark.slow,)
                out.append(pytest.param(case, id=f"{prefix}{config}-{name}", marks=slow))
    return out


def layout_cases() -> list:
    return params({name: row for name, (row, _) in LAYOUTS.items()},
                  {name: default for name, (_, default) in LAYOUTS.items()})


def schedule_cases() -> list:
    return [case for name in SCHEDULES for case in
            params(PIPELINES, SCHEDULE_DEFAULTS.get(name, SCHEDULE_CONTRACT), f"{name}-",
                   lambda case, row, name=name: pipelined(case, name, row.odd))]


def strategy_cases() -> list:
    return [case for name in STRATEGIES for case in
            params(CONTEXTS, STRATEGY_DEFAULTS.get(name, STRATEGY_CONTRACT), f"{name}-", partial(on_strategy, strategy=name))]


def aux_of(result) -> dict[str, np.ndarray]:
    """Each logged auxiliary loss (the router's, MTP's, ...) over the steps."""
    steps = sorted(result.aux)
    return {name: np.array([result.aux[s][name] for s in steps]) for name in (result.aux[steps[0]] if steps else ())}


def assert_same_run(result, reference):
    """assert_same_training, and the same auxiliary losses at LOSS_RTOL."""
    assert_same_training(result, reference)
    got, want = aux_of(result), aux_of(reference)
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=LOSS_RTOL, err_msg=name)


def check(case: Case):
    """The case trains as one device does on the same model."""
    reference = train(config=case.config, evaluate=case.evaluate, **case.model)
    assert losses(reference)[-1] < losses(reference)[0]  # it trains at all
    assert_same_run(train(case.spec, evaluate=case.evaluate, config=case.config, **case.layout, **case.model),
                    reference)
