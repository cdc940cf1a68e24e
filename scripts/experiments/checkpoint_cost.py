"""What a checkpoint's checksums cost: seconds per save and per restore, with and without them.

    python scripts/experiments/checkpoint_cost.py --config shakespeare_char_cpu
    python scripts/experiments/checkpoint_cost.py --config gpt2 --repeats 3

The train state (params and the optimizer's state, as training makes them) is built on one
device, saved with jaxpar's Checkpoints (async, then waited for) and restored, each `--repeats`
times; the checksums are timed alone (after their compile, which a run pays once), and are the
difference a save or a restore pays. Prints one JSON line.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax


def timed(fn, repeats: int) -> float:
    """The median seconds of `fn()` over `repeats` calls, after one call that warms up."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="shakespeare_char_cpu")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from jaxpar.core.config import load_config
    from jaxpar.data.loader import load_dataset
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.checkpoints.checkpoint import Checkpoints, make_meta
    from jaxpar.training.checkpoints.checksums import item_checksums, mismatches
    from jaxpar.training.checkpoints.resume import restore_train_state
    from jaxpar.training.step.build import build

    # The built-in corpus's tokenizer stands in for the preset's data: only its meta is saved, and
    # the model keeps the preset's vocabulary.
    cfg = load_config(args.config, {"train.batch_size": "1", "train.grad_accum": "1", "train.zero": "0",
                                    "data.path": "", "data.mix": "", "data.document_mask": "false"})
    tokenizer = load_dataset(cfg.data, 1).tokenizer
    built = build(cfg, build_mesh(cfg, jax.devices()[:1]), tokenizer)
    with jax.set_mesh(built.mesh), tempfile.TemporaryDirectory() as folder:
        state = built.init_state()
        jax.block_until_ready(state)
        both = {"params": state.params, "opt_state": state.opt_state}
        checksum_s = timed(lambda: item_checksums(both), args.repeats)
        ckpt, step = Checkpoints(Path(folder) / "checkpoints", keep=1), [0]

        def save():
            step[0] += 1
            ckpt.save(step[0], state.params, state.opt_state, make_meta(cfg, tokenizer, step[0]))
            ckpt.wait()
        save_s = timed(save, args.repeats)
        restore_s = timed(lambda: jax.block_until_ready(restore_train_state(ckpt, built, tokenizer)[0]),
                          args.repeats)
        sums = item_checksums(both)
        verify_s = timed(lambda: mismatches(both, sums), args.repeats)
    n_bytes = sum(x.nbytes for x in jax.tree.leaves(both))
    print(json.dumps({"config": args.config, "state_bytes": n_bytes, "devices": str(jax.devices()[0].device_kind),
                      "save_s": round(save_s, 3), "restore_s": round(restore_s, 3),
                      "checksums_on_save_s": round(checksum_s, 3), "checksums_on_restore_s": round(verify_s, 3)}))


if __name__ == "__main__":
    main()
