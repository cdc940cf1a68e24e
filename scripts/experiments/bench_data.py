"""Is building batches off the critical path? Times BatchLoader alone, then trains with the
trainer's Prefetcher and with batches built inline, in alternating rounds, in one process.

    python scripts/experiments/bench_data.py [--data DIR] [--rounds 3] [--steps 300] [overrides ...]

Prints one JSON line per measurement; the docs' table comes from these lines.
"""

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from jaxpar.core.config import load_config, parse_overrides  # noqa: E402
from jaxpar.data.loader import BatchLoader, load_dataset  # noqa: E402
from jaxpar.parallel.mesh import build_mesh  # noqa: E402
from jaxpar.training import trainer  # noqa: E402


class Inline:
    """The Prefetcher's interface, building each batch when it is asked for."""

    def __init__(self, loader, first_step):
        self.loader, self.sharding = loader, loader.sharding

    def __call__(self, step):
        return self.loader(step)

    def close(self):
        pass


def batch_ms(cfg, calls: int = 200) -> float:
    import jax
    dataset = load_dataset(cfg.data, cfg.model.block_size)
    mesh = build_mesh(cfg, jax.devices()[:1])
    loader = BatchLoader(dataset.train, "train", 0, cfg.train.batch_size, 1, cfg.model.block_size,
                         mesh)
    times = []
    for step in range(calls):
        start = time.perf_counter()
        jax.block_until_ready(loader(step))
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", default="")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    args, rest = parser.parse_known_args()
    overrides = {"data.path": args.data, "train.steps": str(args.steps), "train.eval_every": "0",
                 "ckpt.every": "0", **parse_overrides(rest)}
    cfg = load_config(None, overrides)
    print(json.dumps({"batch_build_ms_median": round(batch_ms(cfg), 3),
                      "batch": [cfg.train.batch_size, cfg.model.block_size]}), flush=True)
    for round_ in range(args.rounds):
        for name, builder in (("prefetch", trainer.Prefetcher), ("inline", Inline)):
            trainer.Prefetcher = builder
            result = trainer.run(load_config(None, overrides), None, progress=False)
            summary = result.info["summary"]
            print(json.dumps({"round": round_, "batches": name,
                              "step_ms_median": summary["step_time_ms_median"],
                              "tokens_per_s_median": summary["tokens_per_s_median"]}), flush=True)


if __name__ == "__main__":
    main()
