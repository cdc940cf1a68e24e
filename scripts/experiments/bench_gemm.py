"""XLA:CPU against PyTorch on one train step's projection matmuls, interleaved in one process.

For n token rows, width c and MLP width f: each projection's forward, input-gradient and
weight-gradient dot in the einsum form jaxpar's step uses. Needs torch beside jaxpar.

    python scripts/experiments/bench_gemm.py [N C F] [--rounds R]     # default: the baby GPT, 1024 384 1536
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
import torch


def dots(n: int, c: int, f: int) -> dict:
    """{label: (einsum, lhs shape, rhs shape)}."""
    return {"forward": ("nc,cf->nf", (n, c), (c, f)),
            "input gradient": ("nf,cf->nc", (n, f), (c, f)),
            "weight gradient": ("nc,nf->cf", (n, c), (n, f)),
            "forward (mlp_out)": ("nf,cf->nc", (n, f), (c, f)),
            "input gradient (mlp_out)": ("nc,cf->nf", (n, c), (c, f)),
            "weight gradient (mlp_out)": ("nc,nf->fc", (n, c), (n, f)),
            "forward, c x c": ("nc,cd->nd", (n, c), (c, c)),
            "weight gradient, c x c": ("nc,nd->cd", (n, c), (n, c))}


def flops(equation: str, *shapes) -> int:
    sizes = {}
    for letters, shape in zip(equation.split("->")[0].split(","), shapes):
        sizes.update(zip(letters, shape))
    return 2 * int(np.prod(list(sizes.values())))


def seconds_per_call(run, calls: int = 10) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        out = run()
    if hasattr(out, "block_until_ready"):
        out.block_until_ready()
    return (time.perf_counter() - start) / calls


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sizes", nargs="*", type=int, default=[1024, 384, 1536], metavar="N C F")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(2)
    print("| dot | einsum | XLA GFLOP/s | torch GFLOP/s | XLA / torch |\n|---|---|---|---|---|")
    for label, (equation, a, b) in dots(*args.sizes).items():
        x, y = np.random.randn(*a).astype(np.float32), np.random.randn(*b).astype(np.float32)
        jitted = jax.jit(lambda x, y, eq=equation: jnp.einsum(eq, x, y))
        jx, jy, tx, ty = jnp.asarray(x), jnp.asarray(y), torch.from_numpy(x), torch.from_numpy(y)
        jitted(jx, jy).block_until_ready()
        ours, theirs = [], []
        for _ in range(args.rounds):
            ours.append(seconds_per_call(lambda: jitted(jx, jy)))
            theirs.append(seconds_per_call(lambda: torch.einsum(equation, tx, ty)))
        work = flops(equation, a, b)
        xla, ref = work / statistics.median(ours) / 1e9, work / statistics.median(theirs) / 1e9
        print(f"| {label} | `{equation}` | {xla:.1f} | {ref:.1f} | {xla / ref:.2f} |", flush=True)


if __name__ == "__main__":
    main()
