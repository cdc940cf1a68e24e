"""Each leg of the experts' grouped GEMM timed on this GPU, as the plan times them before a step
compiles (jaxpar.nn.kernel_tuning, train.choose_gemm_legs): the kernels of each leg (forward, the
input's gradient, the weights' gradient), their times, the ones dropped by the correctness check,
and the one line of what was tuned. A second run on the same GPU reuses the cache and tunes nothing.

    python scripts/tools/gemm_legs.py [--rows 32768 --embd 768 --width 3072] [--cache DIR]

On a CPU it rehearses the same path with the CPU's kernels standing in for the GPU's (--rows 256
--embd 32 --width 64 take about half a minute).
"""

import argparse

import jax

from jaxpar.core.config import Config
from jaxpar.core.model_config import model_config
from jaxpar.nn import kernel_tuning, tuning_cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768)
    parser.add_argument("--embd", type=int, default=768)
    parser.add_argument("--width", type=int, default=3072, help="each expert's hidden width")
    parser.add_argument("--experts", default="8,64")
    parser.add_argument("--cache", default="/tmp/jaxpar_legs", help="the tuning cache's folder")
    args = parser.parse_args()
    device = jax.devices()[0]
    rehearsal = jax.default_backend() == "cpu"
    if rehearsal:  # the plan's GPU path, with the kernels a CPU runs
        jax.default_backend = lambda: "gpu"
        kernel_tuning.candidates = lambda platform: ("ragged_dot", "blocks", "megablox")
    kind = tuning_cache.device_kind(device)
    for experts in (int(e) for e in args.experts.split(",")):
        cfg = Config(model=model_config("llama", n_experts=experts, n_embd=args.embd, moe_mlp_dim=args.width,
                                        dtype="bfloat16"))
        cfg.train.kernel_cache, cfg.train.choose_gemm_legs = args.cache, True
        fields = kernel_tuning.plan_tuning(cfg.model, args.cache, True, "gpu", device, "tokamax", args.rows, 1, rehearsal)
        print(f"{experts} experts on {kind}: legs {fields.get('gemm_legs')}; {fields.get('tuning_note')}")
        cache = tuning_cache.TuningCache(args.cache)
        for request in kernel_tuning.gemm_requests(cfg.model, "grouped_gemm", args.rows, 1):
            chosen = cache.entries[request.key(kind)]["config"]
            times = ", ".join(f"{name} {1e3 * s:.3f} ms" for name, s in chosen["seconds"].items())
            print(f"  {request.leg} {request.shapes}: {times}; dropped: {chosen['dropped'] or 'none'}")


if __name__ == "__main__":
    main()
