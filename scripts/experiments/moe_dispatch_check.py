"""The expert-parallel dispatch proved by compiling for hardware this machine does not have: a
small MoE's train step at ep=8, with `ragged_all_to_all` and with the dense `all_to_all`, each
compiled for a TPU slice (libtpu's compile-only devices) or an H100 node (jax[cuda12] with
JAX_PLATFORMS=cpu: compile-only GPUs); nothing runs on either.

    python scripts/experiments/moe_dispatch_check.py [--target tpu:v5p-16] [--config tiny_moe]
        [--section.field=value ...]
    JAX_PLATFORMS=cpu python scripts/experiments/moe_dispatch_check.py --target gpu:h100-8  # in a venv with jax[cuda12]

The model is tiny_moe with 8 experts (one a chip), bfloat16, block 256 and 4 rows a chip.

For each dispatch it prints whether the compiled step holds ragged-all-to-all and the grouped GEMM
(the instructions XLA lowers ragged_dot to: on TPU, ragged-dot fusions and their metadata calls; on
GPU, the dot instructions XLA makes of it), the dense all-to-all bytes per step that the HLO moves
against the minimum (tokens x k x d_model x bytes, out and back, forward and backward, per MoE
layer), and the compiled step's HBM per chip. The grouped GEMM is `ragged_dot` (model.moe_gemm;
pass --model.moe_gemm=megablox for TPU's default kernels). Needs the tpu extra, or jax[cuda12].
"""

import argparse
import re

from jaxpar.core.config import load_config, parse_overrides
from jaxpar.data.loader import load_dataset
from jaxpar.parallel import hlo
from jaxpar.parallel.mesh import build_mesh
from jaxpar.planning.hardware import parse_target, target_devices
from jaxpar.training.step.build import build


def minimum_bytes(cfg, ep: int) -> float:
    """Per chip and step: each token's k rows leave and come back, forward and backward, in every
    MoE layer; (ep-1)/ep of them go to another chip."""
    m, t = cfg.model, cfg.train
    tokens = t.batch_size * m.block_size / cfg.mesh.dp / ep
    width = 2 if m.dtype == "bfloat16" else 4
    return 4 * m.n_layer * tokens * m.experts_per_token * m.n_embd * width * (ep - 1) / ep


def check(cfg, devices, tokenizer) -> dict:
    compiled = build(cfg, build_mesh(cfg, devices), tokenizer).compile_abstract()
    text = compiled.as_text()
    ops = hlo.collective_ops(text)
    dense = sum(op["bytes"] * op["count"] for op in ops if op["kind"] == "all-to-all")
    # A ragged op's result is its receive buffer; what it moves depends on the routing.
    # (the array right before the op's name: the async start's tuple ends with it, as XLA:GPU writes it)
    ragged = [hlo.shape_bytes(shape) for shape in
              re.findall(r"(\w+\[[\d,]*\])(?:\{[^}]*\})?\)?\s+ragged-all-to-all(?:-start)?\(", text)]
    return {"ragged_all_to_all": len(ragged), "ragged_buffer_bytes": sum(ragged),
            "all_to_all": len(re.findall(r"\sall-to-all(?:-start)?\(", text)),
            # instructions XLA made of the ragged_dots (on TPU: ragged-dot fusions and their metadata calls;
            # on GPU: the dots whose metadata names ragged_dot_general)
            "grouped_gemm": len(re.findall(r"^\s*(?:ROOT )?%?[\w.-]*ragged[-_]dot[\w.-]* = ", text, re.MULTILINE)),
            "gemm_dots": len(re.findall(r"\sdot\(.*ragged_dot_general", text)),
            "a2a_bytes": dense, "peak_bytes": hlo.memory_summary(compiled)["peak_memory_bytes"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tpu:v5p-16")
    ap.add_argument("--config", default="tiny_moe")
    args, rest = ap.parse_known_args()
    target = parse_target(args.target)
    devices = target_devices(target)
    print("| dispatch | ragged-all-to-all ops (their buffers) | all-to-all ops | ragged-dot instructions (dots) | dense "
          "all-to-all bytes/step (HLO) | minimum | HBM per chip |\n|---|---|---|---|---|---|---|")
    for dispatch in ("ragged", "all_to_all"):
        overrides = {"mesh.ep": "8", "mesh.dp": str(target.chips // 8), "model.moe_dispatch": dispatch,
                     "model.n_experts": "8", "model.moe_gemm": "ragged_dot", "model.dtype": "bfloat16", "train.batch_size": str(4 * target.chips),
                     "model.block_size": "256", **parse_overrides(rest)}
        cfg = load_config(args.config, overrides)
        r = check(cfg, devices, load_dataset(cfg.data, cfg.model.block_size).tokenizer)
        print(f"| {dispatch} | {r['ragged_all_to_all']} ({r['ragged_buffer_bytes'] / 2**20:,.2f} MiB) | "
              f"{r['all_to_all']} | {r['grouped_gemm']} ({r['gemm_dots']}) | "
              f"{r['a2a_bytes'] / 2**20:,.2f} MiB | {minimum_bytes(cfg, 8) / 2**20:,.2f} MiB | "
              f"{r['peak_bytes'] / 2**20:,.1f} MiB |", flush=True)


if __name__ == "__main__":
    main()
