"""A mixture's rows, as the trainer would draw them: each source's share of every block of
data.mix_block rows over the first STEPS steps, and one fingerprint of all the batches' tokens per
mesh (the same on every mesh, or the order is not a pure function of seed, split and step).

    python scripts/tools/mixture_check.py --steps 200 --meshes dp=1 dp=2,tp=2 dp=4 -- \\
        --config tiny --data.mix=a=DIR_A:0.6,b=DIR_B:0.3,c=DIR_C:0.1

The arguments after `--` are jaxpar.train's (the config and its overrides). A process builds only
its own rows; to see the rows of 2 processes agree, train with scripts/tools/launch_local.sh.
"""
import argparse
import hashlib
import sys

import numpy as np

from jaxpar.parallel.mesh import force_host_devices, requested_devices
from jaxpar.train import parse_args


def main(argv: list[str]) -> None:
    ours, theirs = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--meshes", nargs="+", default=["dp=1", "dp=2,tp=2"])
    args = parser.parse_args(ours)
    configs = {spec: parse_args(theirs + ["--mesh", spec, "--dry-run"])[0] for spec in args.meshes}
    base = configs[args.meshes[0]]
    if not base.data.mix:
        sys.exit("mixture_check: give a mixture after `--` (--data.mix=name=DIR:weight,...)")
    force_host_devices(max((c.mesh for c in configs.values()), key=requested_devices))
    shares(base, args.steps)
    for spec, cfg in configs.items():
        print(f"{spec:>12s}: batches' sha256 {fingerprint(cfg, args.steps)}")


def loader_for(cfg):
    import jax

    from jaxpar.data.loader import BatchLoader, load_dataset
    from jaxpar.parallel.mesh import build_mesh
    from jaxpar.training.step.build import build
    mesh = build_mesh(cfg, jax.devices()[:requested_devices(cfg.mesh)])
    dataset = load_dataset(cfg.data, cfg.model.block_size)
    passes = build(cfg, mesh, dataset.tokenizer).plan.passes  # the trainer's passes a step
    return BatchLoader(dataset, "train", cfg.train.seed, cfg.train.batch_size, passes,
                       cfg.model.block_size, mesh), dataset


def shares(cfg, steps: int) -> None:
    loader, dataset = loader_for(cfg)
    names, block = dataset.mixture.names, dataset.mixture.block
    which = np.concatenate([loader.rows(step)[0].ravel() for step in range(steps)])
    counts = [np.bincount(which[i:i + block], minlength=len(names)) for i in range(0, len(which), block)]
    print(f"{steps} steps x {cfg.train.batch_size} rows = {len(which)} rows, blocks of {block} (data.mix_block)")
    print("block  " + "  ".join(f"{n:>8s}" for n in names))
    for i, row in enumerate(counts):
        part = "" if (i + 1) * block <= len(which) else f"   (the first {len(which) - i * block} rows)"
        print(f"{i:5d}  " + "  ".join(f"{c:8d}" for c in row) + part)
    total = np.bincount(which, minlength=len(names)) / len(which)
    print("share  " + "  ".join(f"{s:8.4f}" for s in total))


def fingerprint(cfg, steps: int) -> str:
    loader, _ = loader_for(cfg)
    digest = hashlib.sha256()
    for step in range(steps):
        digest.update(np.ascontiguousarray(loader.local_rows(step)).tobytes())
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    main(sys.argv[1:])
