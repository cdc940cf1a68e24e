"""The fused residual add + LayerNorm (jaxpar/nn/fused_norm.py) timed against XLA's, on the device at hand.

    python scripts/experiments/fused_norm_timing.py [--rows 16384] [--embd 768] [--block-rows 1,2,4,8,16] [--iters 20]
"""

import argparse

import jax

from jaxpar.nn.fused_norm import bench


def main() -> None:
    parser = argparse.ArgumentParser(description="Time the fused add + LayerNorm against XLA's.")
    parser.add_argument("--rows", type=int, default=16 * 1024, help="batch * seq (GPT-2 124M, batch 16)")
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--block-rows", default="1,2,4,8,16", help="comma-separated powers of two")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    print(jax.devices()[0].device_kind, jax.__version__)
    for line in bench(args.rows, args.embd, tuple(int(b) for b in args.block_rows.split(",")), args.iters):
        print(line)


if __name__ == "__main__":
    main()
