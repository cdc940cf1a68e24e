"""Run configuration: plain dataclasses, TOML files in configs/, and `--section.field=value` overrides.

The dataclass defaults are nanoGPT's shakespeare_char CPU recipe, so no config file is needed.
"""

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from jaxpar.core.axes import AXES, Run
from jaxpar.core.config_files import CONFIG_DIR, coerce, read_toml, resolve_config_path  # noqa: F401
from jaxpar.core.data_config import DataConfig, mix_text, validate_data
from jaxpar.core.errors import UserError
from jaxpar.core.model_config import (  # noqa: F401
    REMAT_KINDS,
    ModelConfig,
    field_names,
    model_config,
    model_keys,
    not_this_family,
    validate_model,
    with_family,
)
from jaxpar.core.optimizer_config import (
    ALIASES,
    OptimizerConfig,
    check_aliases,
    check_optimizer_keys,
    check_wsd,
    validate_optimizer,
)
from jaxpar.core.paths import checked
from jaxpar.core.registry import check_registered, one_of
from jaxpar.core.xla_options import parse as parse_xla_options

DEFAULT_CONFIG_NAME = "shakespeare_char_cpu"
MICRO_BATCH_AUTO = "auto"  # train.micro_batch: the device decides (jaxpar.training.step.micro_batch)
# numpy's generators (the data order) refuse a negative seed, and JAX's keys without x64 keep the
# low 32 bits (seed 2**32 would init as seed 0, and past 2**63 they overflow).
SEED_MAX = 2**32 - 1


OFFLOADS = ("none", "optimizer")  # train.offload


@dataclass
class TrainConfig:
    steps: int = 2000
    batch_size: int = 12  # global batch, in sequences, over all devices and microbatches
    grad_accum: int = 1  # microbatches per step on every layout (nanoGPT's gradient_accumulation_steps)
    # Most sequences one device runs through one forward/backward (Megatron's micro-batch-size);
    # a device with more rows splits them into further microbatches. 0: no limit. On a 2-core CPU,
    # 6 rows of 64 tokens keep activations in cache: 1.3x the speed of 12 rows at once. "auto":
    # on a GPU or TPU the most rows whose compiled step fits the device (XLA's memory analysis),
    # on a CPU 6 (jaxpar.training.step.micro_batch).
    micro_batch: int = 6
    # The learning rate, its schedule, clipping and AdamW's settings are the [optimizer] section's
    # (jaxpar.core.optimizer_config); their older names here (train.lr, ...) still work.
    # ZeRO over the data axis: 1 shards the optimizer's moments, 2 also the gradients, 3 also the params
    # (FSDP); 0 is plain data parallelism. 1 is the default: it saves memory at no extra
    # communication (an all-reduce is a reduce-scatter plus an all-gather).
    zero: int = 1
    # "optimizer": the optimizer's state kept in host memory (pinned_host), sharded as ZeRO says,
    # moved to the device for the update and back. "none": in device memory.
    offload: str = "none"
    eval_every: int = 250  # 0 disables evaluation
    eval_batches: int = 20
    log_every: int = 1
    seed: int = 1337
    # A Hugging Face GPT-2 or Llama directory (config.json + safetensors) to start from instead of a
    # random init: the model shape comes from its config.json (see jaxpar.models.hf). Empty: random init.
    init_from: str = ""
    # On a GPU, kernels tuned at plan time are kept here (jaxpar.nn.kernel_tuning); empty: the user's
    # cache folder ($XDG_CACHE_HOME/jaxpar, else ~/.cache/jaxpar). choose_gemm_legs: measure each leg
    # of the experts' grouped GEMM (forward, dlhs, drhs) on the GPU and run the fastest kernel of each.
    kernel_cache: str = ""
    choose_gemm_legs: bool = False
    xla_options: str = ""  # the steps' XLA options, NAME=VALUE,... over the platform's (jaxpar.core.xla_options)


# One field per mesh axis (jaxpar.core.axes), named by its --mesh key: dp, tp, pp, cp. Each is the
# axis's size; one may be -1 (inferred from the device count).
MeshConfig = dataclasses.make_dataclass("MeshConfig", [(axis.key, int, field(default=1)) for axis in AXES])


@dataclass
class PipelineConfig:
    schedule: str = ""  # one of jaxpar.parallel.schedules by name; empty: the default (see python -m jaxpar.schedule -h)
    virtual: int = 1  # interleaved: layer chunks per stage (stage s holds chunks s, s+pp, ...)
    microbatches: int = 0  # per step and grad_accum round; 0: the largest multiple of pp up to 4*pp that fits


@dataclass
class DistConfig:
    # jax.distributed over several processes. Left empty, a SLURM or Open MPI launch is detected.
    coordinator: str = ""  # HOST:PORT of process 0's coordination service
    num_processes: int = 1
    process_id: int = 0
    init_timeout: int = 60  # seconds the processes wait for each other to join at start-up


@dataclass
class CkptConfig:
    every: int = 250  # save every N steps; 0: only at the end and on interruption
    keep: int = 3  # newest checkpoints kept in <out>/checkpoints


@dataclass
class EvalConfig:
    # Multiple-choice tasks scored during training (jaxpar.data.tasks): comma-separated names read
    # from tasks_dir, every tasks_every updates (0: at train.eval_every) and at the end, on each
    # task's first tasks_limit items (0: all).
    tasks: str = ""
    tasks_dir: str = ""
    tasks_every: int = 0
    tasks_limit: int = 0


@dataclass
class LogConfig:
    tensorboard: bool = True  # scalars into <out>/tensorboard (process 0), beside --profile's trace
    wandb: str = ""  # a W&B project name: log the same scalars there too (needs `pip install wandb`)


@dataclass
class Config:
    model: ModelConfig = field(default_factory=model_config)  # the default family's
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    ckpt: CkptConfig = field(default_factory=CkptConfig)
    dist: DistConfig = field(default_factory=DistConfig)
    log: LogConfig = field(default_factory=LogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self):
        # Keys set through an older name (train.lr for optimizer.lr): messages use the user's word.
        self.spelled: dict[str, str] = {}

    @property
    def run(self) -> Run:
        """What the mesh axes' checks read of this config (jaxpar.core.axes.Run)."""
        return Run(self.model, self.train.batch_size // self.train.grad_accum, self.pipeline.microbatches)

    def set(self, key: str, value) -> None:
        """Set `section.field` (or an older name of one) from a string or TOML value; unknown keys
        list the valid ones."""
        canonical = ALIASES.get(key, key)
        if key in ALIASES:
            self.spelled[canonical] = key
        else:
            self.spelled.pop(key, None)
        section, _, name = canonical.partition(".")
        sub = getattr(self, section, None) if section in {f.name for f in dataclasses.fields(self)} else None
        types = {f.name: f.type for f in dataclasses.fields(sub)} if sub is not None else {}
        if name not in types:
            raise (section == "model" and not_this_family(self.model.family, name)
                   or UserError(f"unknown config key '{canonical}'; valid keys: {keys_help()}"))
        if canonical == "model.family":  # the model's keys are its family's
            self.model = with_family(self.model, coerce(key, str, value))
            return
        setattr(sub, name, coerced(canonical, key, types[name], value))

    def key_name(self, key: str) -> str:
        """A canonical key as the user set it: its older name if that is how it came."""
        return self.spelled.get(key, key)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, sections: dict) -> "Config":
        """The inverse of to_dict (e.g. a checkpoint's resolved config); validated. A model key its
        family does not declare is passed over: configs saved before each family had its own
        keys hold every family's."""
        cfg, model = cls(), sections.get("model", {})
        cfg.set("model.family", model.get("family", cfg.model.family))
        declared = field_names(cfg.model)
        for section, table in sections.items():
            for name, value in table.items():
                if section != "model" or name in declared:
                    cfg.set(f"{section}.{name}", value)
        validate(cfg)
        return cfg


def valid_keys() -> list[str]:
    """Every section's keys; the model's of every family."""
    return [f"{s.name}.{name}" for s in dataclasses.fields(Config)
            for name in (model_keys() if s.name == "model" else [f.name for f in dataclasses.fields(s.default_factory)])]


def keys_help() -> str:
    """Every valid key, then the older names that still work."""
    return f"{', '.join(valid_keys())}; older names still accepted: {', '.join(ALIASES)}"


def coerced(canonical: str, spelled: str, kind, value):
    """A key's value from a string or TOML value, in its field's type; the TOML forms some keys
    take besides (a [data.mix] table, a list of layer indices, micro_batch's "auto")."""
    if canonical == "data.mix" and isinstance(value, dict):  # a [data.mix] table
        value = mix_text(value)
    if canonical == "model.dense_layers" and isinstance(value, list):  # a TOML list of layer indices
        value = ",".join(map(str, value))
    if canonical == "train.micro_batch" and value == MICRO_BATCH_AUTO:  # resolved on the mesh, before tracing
        return value
    return coerce(spelled, kind, value)


def read_config_file(file: Path) -> dict[str, dict]:
    """A TOML file's [section] tables (config_files.read_toml), each one a table."""
    data = read_toml(file)
    for section, table in data.items():
        if not isinstance(table, dict):
            raise UserError(f"config file '{file}': '{section}' must be a [section]; "
                            f"valid keys: {keys_help()}")
    return data


def load_config(path: str | None, overrides: dict[str, str]) -> Config:
    """Defaults, then the TOML file (if any), then command-line overrides; validated."""
    cfg, in_file, data = Config(), set(), {}
    if path is not None:
        file = resolve_config_path(path)
        data = read_config_file(file)
        in_file = {f"{section}.{name}" for section, table in data.items() for name in table}
        check_aliases(in_file, f"in config file '{file}'")
    family = overrides.get("model.family", data.get("model", {}).get("family"))
    if family is not None:  # first: which keys the model has depends on it
        cfg.set("model.family", family)
    if path is not None:
        for section, table in data.items():
            for name, value in table.items():
                cfg.set(f"{section}.{name}", value)
    check_aliases(set(overrides), "on the command line")
    for key, value in overrides.items():
        cfg.set(key, value)
    check_optimizer_keys(cfg.optimizer, set(overrides), in_file)
    validate(cfg)
    if cfg.optimizer.decay_steps == 0:
        cfg.optimizer.decay_steps = cfg.train.steps
    check_wsd(cfg.optimizer, cfg.train.steps)
    return cfg


def validate(cfg: Config) -> None:
    """Reject values that cannot train; every message names the key and what it needs."""
    positive = ["model.n_layer", "model.n_head", "model.n_embd", "model.block_size",
                "train.steps", "train.batch_size", "train.grad_accum", "train.eval_batches",
                "train.log_every", "ckpt.keep", "dist.init_timeout"]
    non_negative = ["model.vocab_size", "train.micro_batch", "train.eval_every", "pipeline.microbatches",
                    "ckpt.every", "eval.tasks_every", "eval.tasks_limit"]
    get = lambda key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])  # noqa: E731
    for key in positive:
        if get(key) <= 0:
            raise UserError(f"{key} must be positive, got {get(key)}")
    for key in non_negative:
        if get(key) != MICRO_BATCH_AUTO and get(key) < 0:
            raise UserError(f"{key} must be >= 0, got {get(key)}")
    m, t = cfg.model, cfg.train
    validate_model(m)
    validate_optimizer(cfg.optimizer, cfg.key_name)
    if t.batch_size % t.grad_accum:
        raise UserError(f"train.batch_size={t.batch_size} must be divisible by "
                        f"train.grad_accum={t.grad_accum}")
    if cfg.eval.tasks and not cfg.eval.tasks_dir:
        raise UserError("eval.tasks needs eval.tasks_dir: the folder holding the tasks (see the guide)")
    for key in ("train.init_from", "train.kernel_cache", "eval.tasks_dir"):  # data's are validate_data's
        if get(key):
            checked(get(key), key)
    validate_data(cfg.data)
    if not 0 <= t.seed <= SEED_MAX:
        raise UserError(f"train.seed (--seed) must be from 0 to {SEED_MAX}, got {t.seed}: numpy's generators take "
                        "no negative seed, and JAX's keys keep 32 bits; choose one in that range")
    if t.zero not in (0, 1, 2, 3):
        raise UserError(f"train.zero (--zero) must be 0, 1, 2 or 3, got {t.zero}")
    one_of("train.offload", t.offload, OFFLOADS)
    parse_xla_options(t.xla_options)
    sizes = [getattr(cfg.mesh, axis.key) for axis in AXES]
    for axis, size in zip(AXES, sizes):
        if size != -1 and size < 1:
            raise UserError(f"mesh.{axis.key} must be a positive integer or -1 (inferred), got {size}")
    d = cfg.dist
    if d.num_processes < 1 or not 0 <= d.process_id < d.num_processes:
        raise UserError(f"dist.process_id must be in [0, dist.num_processes={d.num_processes}), "
                        f"got {d.process_id}")
    host, _, port = d.coordinator.rpartition(":")
    if d.num_processes > 1 and not (host and port.isdigit()):
        raise UserError(f"dist.coordinator must be HOST:PORT when dist.num_processes > 1, "
                        f"got '{d.coordinator}'")
    if sizes.count(-1) > 1:
        raise UserError("at most one mesh axis may be -1 (inferred)")
    check_registered(cfg)  # every name a registry holds, and what its entry needs of the config alone


def parse_overrides(tokens: list[str]) -> dict[str, str]:
    """['--model.n_layer=6', '--train.lr', '3e-4'] -> {'model.n_layer': '6', 'train.lr': '3e-4'}."""
    overrides, i = {}, 0
    while i < len(tokens):
        token = tokens[i]
        key, eq, value = token[2:].partition("=")
        if not token.startswith("--") or "." not in key:
            raise UserError(f"unrecognised argument '{token}'; see --help")
        if not eq:
            if i + 1 >= len(tokens):
                raise UserError(f"{token} needs a value, e.g. {token}=VALUE")
            value, i = tokens[i + 1], i + 1
        overrides[key] = value
        i += 1
    return overrides
