"""Where an inference command's model comes from: a training run's newest checkpoint (`load`), or a
Hugging Face directory used as it is, without training a step (`load_hf`), placed on any mesh.

For an HF directory the tokenizer is its tokenizer.json (or the tiktoken encoding a jaxpar export
names); without one, `tokenizer` is None and the command says what it needs.
"""

import sys
from dataclasses import dataclass, field

import jax
from jax.sharding import Mesh

from jaxpar.core.config import Config, MeshConfig, load_config
from jaxpar.core.errors import UserError
from jaxpar.core.execution import ExecutionPlan
from jaxpar.core.sharding import shardings_for
from jaxpar.models.hf import apply_hf_config, check_finite, hf_tokenizer, load_hf_params
from jaxpar.models.transformer import Transformer
from jaxpar.parallel.mesh import build_mesh, force_host_devices, parse_mesh_spec, requested_devices
from jaxpar.training.checkpoints.checkpoint import Checkpoints, abstract_tree, find_checkpoints
from jaxpar.training.checkpoints.resume import saved_vocab
from jaxpar.training.step.build import build_inference


@dataclass
class Model:
    cfg: Config  # the checkpoint's resolved config, with this mesh
    tokenizer: object  # any kind of jaxpar.data.tokenizer, as the checkpoint names it
    net: Transformer  # its vocabulary, end-of-text id and plan on this mesh (jaxpar.training.step.build)
    params: dict  # on `mesh`, split as the rule table says; no ZeRO, no optimizer state
    mesh: Mesh
    step: int  # the training step the checkpoint holds
    source: str = ""  # where it came from, as messages name it
    decoders: dict = field(default_factory=dict, repr=False)  # jitted, by (temperature, top_k)

    @property
    def vocab_size(self) -> int:
        """The model's: model.vocab_size, or the tokenizer's."""
        return self.net.vocab_size

    @property
    def execution(self) -> ExecutionPlan:
        """The decisions this config gets on this mesh (its attention kernel, ...)."""
        return self.net.plan

    @property
    def documents_eot(self) -> int | None:
        """The end-of-text token that opens documents, for a model trained with data.document_mask."""
        return self.net.eot_id


def load(path, mesh: str = "dp=1", devices=None) -> Model:
    """The newest intact checkpoint's params in `path` (a run's --out or its checkpoints folder),
    placed on a `mesh` over `devices` (default: the first devices the mesh needs), each array
    checked against its checksum."""
    ckpt = Checkpoints(find_checkpoints(path))
    built = {}

    def targets_for(meta: dict) -> dict:
        cfg = Config.from_dict(meta["config"])
        built["mesh"] = inference_mesh(cfg, mesh, devices)
        built["cfg"] = cfg
        built["tokenizer"], vocab = saved_vocab(meta)
        net = built["net"] = build_inference(cfg, built["mesh"], vocab, built["tokenizer"])
        shapes = net.shapes()
        return {"params": abstract_tree(shapes, shardings_for(net.axes(), shapes, built["mesh"]))}

    found = ckpt.restore_latest(targets_for)
    if found is None:
        raise UserError(f"no complete checkpoint in '{ckpt.directory}'")
    check_finite(found.items["params"], ckpt.directory / str(found.step))
    cfg, mesh = built["cfg"], built["mesh"]
    return Model(cfg, built["tokenizer"], built["net"], found.items["params"], mesh, found.step,
                 f"the checkpoint in '{ckpt.directory}'")


def set_mesh_spec(mesh_cfg: MeshConfig, mesh: str) -> None:
    """The [mesh] section set to a --mesh spec such as "tp=2" (axes it omits are 1)."""
    for key, value in parse_mesh_spec(mesh).items():
        setattr(mesh_cfg, key.split(".")[1], int(value))


def inference_mesh(cfg: Config, mesh: str, devices=None) -> Mesh:
    """The mesh `mesh` (e.g. "tp=2") over `devices` (default: the first ones it needs), set in
    cfg with ZeRO off: no optimizer here, and the whole params on every data replica."""
    set_mesh_spec(cfg.mesh, mesh)
    cfg.train.zero = 0
    wanted = requested_devices(cfg.mesh)
    chosen = devices if devices is not None else jax.devices()[:wanted or len(jax.devices())]
    # Sampling replicates its batch over 'data': the training batch does not bind the mesh.
    cfg.train.batch_size, cfg.train.grad_accum = len(chosen), 1
    return build_mesh(cfg, chosen)


DEFAULT_BLOCK = 1024  # the window when neither --block-size nor a smaller max_position_embeddings says


def load_hf(hf_dir, mesh: str = "dp=1", devices=None, block_size: int | None = None) -> Model:
    """The model in hf_dir, each device reading its own slices, with a window of block_size
    tokens (default: max_position_embeddings, at most DEFAULT_BLOCK)."""
    cfg = Config()
    cfg.model.block_size = block_size or DEFAULT_BLOCK
    set_mesh_spec(cfg.mesh, mesh)  # the heads are checked against tp
    vocab = apply_hf_config(cfg, hf_dir, {"model.block_size": str(block_size)} if block_size else {})
    mesh_obj = inference_mesh(cfg, mesh, devices)
    tokenizer = hf_tokenizer(hf_dir)
    net = build_inference(cfg, mesh_obj, vocab, tokenizer)
    shapes = net.shapes()
    params = load_hf_params(hf_dir, cfg.model, vocab, shardings_for(net.axes(), shapes, mesh_obj))  # checked finite
    return Model(cfg, tokenizer, net, params, mesh_obj, 0, f"--hf '{hf_dir}'")


def load_source(args, command: str) -> Model:
    """The model --ckpt or --hf names, on --mesh."""
    mesh = load_config(None, parse_mesh_spec(args.mesh)).mesh
    force_host_devices(mesh)
    if mesh.cp > 1:  # evaluation and decoding leave the context axis unsplit
        print(f"{command}: note: cp={mesh.cp}: sequences are not split here; each device of a ring "
              "computes them whole (no ring attention in this command)", file=sys.stderr)
    if args.ckpt is not None:
        if args.block_size is not None:
            raise UserError("--block-size is for --hf; a checkpoint keeps the block size it was trained with")
        return load(args.ckpt, args.mesh)
    if args.block_size is not None and args.block_size < 1:
        raise UserError(f"--block-size must be at least 1, got {args.block_size}")
    return load_hf(args.hf, args.mesh, block_size=args.block_size)


def source_name(args, model: Model) -> str:
    return f"step {model.step} of {args.ckpt}" if args.ckpt else args.hf
