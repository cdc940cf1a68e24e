"""Compare harness against the PyTorch reference: losses step by step, or speed in alternating blocks.

Losses: copies jaxpar's initial weights into ../shared/bench/torch_ref.py's model, trains both on
the batches jaxpar draws for (seed, step), and prints how far apart their train losses and final
val losses are. Speed (--speed ROUNDS): alternates blocks of --block steps of jaxpar's train step
and of torch_ref's own loop body, in one process, so that both see the same load on a shared host.
It needs torch installed beside jaxpar; the project itself never imports torch.

    python scripts/experiments/compare_torch_ref.py [--torch-ref PATH] [--steps N] [--speed ROUNDS [--block K]]
                                        [--mesh dp=2] [--dtype bfloat16 [--torch-dtype float32]]
                                        [--section.field=value ...]
"""

import argparse
import importlib.util
import itertools
import math
import statistics
import time
from pathlib import Path

import jax
import numpy as np
import torch

from jaxpar.core.config import load_config, parse_overrides
from jaxpar.core.errors import UserError, exit_on_user_error
from jaxpar.data.loader import BatchLoader, load_dataset
from jaxpar.models.flops import flops_per_token, measure_matmul_peak
from jaxpar.parallel.mesh import build_mesh, force_host_devices, parse_mesh_spec, resolve_mesh_shape
from jaxpar.training.step.build import build

DEFAULT_REF = Path(__file__).resolve().parents[3] / "shared" / "bench" / "torch_ref.py"
DTYPES = ("float32", "bfloat16")
REPORT_AT = (0, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 1500, 2000)


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location("torch_ref", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_weights(model, params: dict, vocab: int):
    """jaxpar's param tree into torch_ref's CharGPT. torch's Linear stores (out, in)."""
    t = lambda a: torch.tensor(np.asarray(a))  # noqa: E731
    blocks = params["blocks"]
    with torch.no_grad():
        model.tok_emb.weight.copy_(t(params["wte"][:vocab]))  # the tied head: one tensor
        model.pos_emb.weight.copy_(t(params["wpe"]))
        for i, block in enumerate(model.blocks):
            pairs = [(block.norm_attn, blocks["ln_1"]), (block.attn.qkv, blocks["qkv"]),
                     (block.attn.out, blocks["attn_out"]), (block.norm_mlp, blocks["ln_2"]),
                     (block.mlp.up, blocks["mlp_in"]), (block.mlp.down, blocks["mlp_out"])]
            for layer, p in pairs:
                if "kernel" in p:  # (*in, *out) after the layer axis; mlp_out's is (out, in) already
                    fan_out, fan_in = layer.weight.shape
                    kernel = np.asarray(p["kernel"][i])
                    layer.weight.copy_(t(kernel if p is blocks["mlp_out"]
                                         else kernel.reshape(fan_in, fan_out).T))
                else:
                    layer.weight.copy_(t(p["scale"][i]))
                if "bias" in p:
                    layer.bias.copy_(t(np.asarray(p["bias"][i]).reshape(-1)))
        model.norm_out.weight.copy_(t(params["ln_f"]["scale"]))
        if "bias" in params["ln_f"]:
            model.norm_out.bias.copy_(t(params["ln_f"]["bias"]))


def as_rows(batch) -> tuple[torch.Tensor, torch.Tensor]:
    """(microbatches, rows, seq) device arrays -> (batch, seq) int64 tensors, the same rows in order."""
    return tuple(torch.tensor(np.asarray(a).reshape(-1, a.shape[-1]), dtype=torch.long) for a in batch)


def read_args():
    """(the flags, the config, whether torch_ref autocasts to bfloat16), checked."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-ref", type=Path, default=DEFAULT_REF)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--config", default=None)
    ap.add_argument("--speed", type=int, default=0, metavar="ROUNDS",
                    help="time ROUNDS pairs of blocks instead of comparing losses")
    ap.add_argument("--block", type=int, default=20, metavar="K", help="steps per timed block")
    ap.add_argument("--mesh", default=None, help="jaxpar's layout for --speed, e.g. dp=2 (forced host devices)")
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="compute dtype of both: jaxpar's model.dtype, torch_ref's CPU autocast")
    ap.add_argument("--torch-dtype", choices=DTYPES, default=None, help="torch_ref's alone, where it differs")
    args, rest = ap.parse_known_args()
    overrides = parse_overrides(rest)
    if args.dtype:
        overrides["model.dtype"] = args.dtype
    autocast = (args.torch_dtype or args.dtype) == "bfloat16"  # as torch_ref.py --dtype bfloat16
    if args.mesh:
        if not args.speed:
            raise UserError("--mesh times a layout: pass it with --speed (the loss comparison runs on one device)")
        overrides.update(parse_mesh_spec(args.mesh))
    overrides["train.steps"] = str(args.steps)
    cfg = load_config(args.config, overrides)
    if cfg.model.dropout:
        raise UserError("torch_ref has no dropout: pass --model.dropout=0")
    if args.speed < 0 or args.block <= 0:
        raise UserError(f"--speed must be >= 0 and --block positive, got {args.speed} and {args.block}")
    if not args.torch_ref.is_file():
        raise UserError(f"'{args.torch_ref}' not found: pass the path of torch_ref.py with --torch-ref")
    return args, cfg, autocast


def main():
    args, cfg, autocast = read_args()
    m, t, o = cfg.model, cfg.train, cfg.optimizer
    ref = load_module(args.torch_ref)
    torch.set_num_threads(2)

    force_host_devices(cfg.mesh)
    dataset = load_dataset(cfg.data, m.block_size)
    vocab = dataset.tokenizer.vocab_size  # torch_ref's; jaxpar's wte may pad past it (model.vocab_size)
    sizes = resolve_mesh_shape(cfg, len(jax.devices()))
    mesh = build_mesh(cfg, jax.devices()[:math.prod(sizes.values())])
    # each framework's own matmul peak, outside the mesh context (it runs on one device)
    peaks = (measure_matmul_peak(jax.devices()[0], "float32"), torch_matmul_peak()) if args.speed else None
    built = build(cfg, mesh, dataset.tokenizer)  # jaxpar.train's step, its execution plan included
    with jax.set_mesh(mesh):
        state = built.init_state()
        microbatches = built.plan.passes
        train = BatchLoader(dataset, "train", t.seed, t.batch_size, microbatches, m.block_size, mesh)
        val = BatchLoader(dataset, "val", t.seed, t.batch_size, microbatches, m.block_size, mesh)
        train_step, eval_step = built.train_step(train.sharding), built.eval_step(val.sharding)

        model = ref.CharGPT(vocab, m.block_size, m.n_layer, m.n_head, m.n_embd, bias=m.bias)
        copy_weights(model, jax.device_get(state.params), vocab)
        opt = ref.build_optimizer(model, o.lr, o.weight_decay, (o.beta1, o.beta2))
        for group in opt.param_groups:
            group["eps"] = o.eps

        def torch_step(s: int, rows) -> float:
            """torch_ref's loop body at step s on (inputs, targets) rows; returns the loss."""
            for group in opt.param_groups:
                group["lr"] = ref.lr_at(s, o.lr, o.min_lr, o.warmup_steps, o.decay_steps)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                _, loss = model(*rows)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
            opt.step()
            return loss.item()

        if args.speed:
            compare_speed(args.speed, args.block, state, train, train_step, torch_step, ref,
                          torch.from_numpy(dataset.train.astype(np.int64)), flops_per_token(m, vocab), peaks)
            return
        compare_losses(t, state, train, val, train_step, eval_step, torch_step, model)


def compare_losses(t, state, train, val, train_step, eval_step, torch_step, model):
    """Both sides on the same batches: the train losses side by side, then the val losses."""
    print("| step | jaxpar loss | torch loss | rel. diff | max rel. diff so far |\n|---|---|---|---|---|")
    worst = 0.0
    for s in range(t.steps):
        batch = train(s)
        state, metrics = train_step(state, batch)
        ours, theirs = float(metrics["loss"]), torch_step(s, as_rows(batch))
        worst = max(worst, abs(ours - theirs) / abs(theirs))
        if s in REPORT_AT or s == t.steps - 1:
            print(f"| {s} | {ours:.5f} | {theirs:.5f} | {abs(ours - theirs) / abs(theirs):.1e} "
                  f"| {worst:.1e} |", flush=True)
    batches = [val(i) for i in range(t.eval_batches)]
    ours = np.mean([float(eval_step(state.params, b)) for b in batches])
    with torch.no_grad():
        theirs = np.mean([model(*as_rows(b))[1].item() for b in batches])
    print(f"\nval loss after {t.steps} steps on the same {t.eval_batches} batches: "
          f"jaxpar {ours:.4f}, torch_ref {theirs:.4f}")


def torch_matmul_peak(size: int = 2048, repeats: int = 5) -> float:
    """Best FLOP/s of a size^3 float32 torch.mm, as flops.measure_matmul_peak times XLA's."""
    a = torch.ones(size, size)
    torch.mm(a, a)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def compare_speed(rounds: int, block: int, state, train, train_step, torch_step, ref,
                  train_tokens: torch.Tensor, model_flops_per_token: int, peaks: tuple[float, float]):
    """Alternate `block` steps of each side, `rounds` times (who goes first alternates too).

    Each side runs its own training loop as it runs alone: jaxpar draws its batches and fetches
    its metrics every 10 steps, as jaxpar.train does; torch_ref samples its own batches from the
    same train split and syncs on its loss every step, as torch_ref.py does. Each first runs 10
    untimed steps (jaxpar's compile among them). Each side's model FLOP/s is then put against
    its own framework's 2048^3 matmul (`peaks`: XLA's, torch's), measured once before the rounds.
    """
    rng = torch.Generator().manual_seed(0)
    rows, seq = train.batch_size, train.block_size
    jaxpar_steps, torch_steps = itertools.count(), itertools.count()

    def jaxpar_block(n: int):
        nonlocal state
        for _ in range(n):
            s = next(jaxpar_steps)
            state, metrics = train_step(state, train(s))
            if s % 10 == 9:
                float(metrics["loss"])
        jax.block_until_ready(state)

    def torch_block(n: int):
        for _ in range(n):
            torch_step(next(torch_steps), ref.sample_batch(train_tokens, rows, seq, rng))

    def tokens_per_s(run, n: int) -> float:
        start = time.perf_counter()
        run(n)
        return n * rows * seq / (time.perf_counter() - start)

    jaxpar_block(10)
    torch_block(10)
    ours, theirs = [], []
    print("| round | jaxpar tok/s | torch_ref tok/s | ratio |\n|---|---|---|---|")
    for r in range(rounds):
        order = [(jaxpar_block, ours), (torch_block, theirs)]
        for run, figures in order if r % 2 == 0 else order[::-1]:
            figures.append(tokens_per_s(run, block))
        print(f"| {r} | {ours[-1]:,.0f} | {theirs[-1]:,.0f} | {ours[-1] / theirs[-1]:.3f} |", flush=True)
    ratios = [a / b for a, b in zip(ours, theirs)]
    print(f"\nmedians over {rounds} rounds of {block} steps: jaxpar {statistics.median(ours):,.0f} "
          f"tok/s, torch_ref {statistics.median(theirs):,.0f} tok/s; ratio median "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f}); "
          f"jaxpar faster in {sum(x > 1 for x in ratios)} of {rounds}")
    for name, figures, peak in zip(("jaxpar", "torch_ref"), (ours, theirs), peaks):
        rate = statistics.median(figures) * model_flops_per_token
        print(f"{name}: {rate / 1e9:.0f} GFLOP/s of model FLOPs, {100 * rate / peak:.0f}% of its own "
              f"float32 2048^3 matmul ({peak / 1e9:.0f} GFLOP/s, measured before the rounds)")


if __name__ == "__main__":
    with exit_on_user_error("compare_torch_ref"):
        main()
