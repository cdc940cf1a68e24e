"""gpu_check.py's `--sweep`: GPT-2 124M under each candidate for the dense step's elementwise work,
measured against the default, so that jaxpar's GPU defaults are chosen by measurement.

The candidates (CANDIDATES) are XLA options, one at a time (train.xla_options, part of the plan:
jaxpar.core.xla_options), jaxpar's fused residual add + LayerNorm (model.norm_kernel=pallas,
jaxpar.nn.fused_norm) and the lm_head's logits in bfloat16 as nanoGPT's autocast has them
(model.logits_dtype=bfloat16); then the ones that measured faster at the first batch with the loss
within tolerance, together. Each run trains `steps` steps from the same seed and data; a row gives
its median step, tokens/s, speed-up over the default, XLA's peak memory for the compiled step, and
its last loss relative to the default's (within jaxpar.core.xla_options.SWEEP_LOSS_RTOL or not).

Under `--budget` a run that would end past the deadline (judged by the dearest run so far) is
listed as not run, so the sweep always ends in time. The order puts the deciding figures first:
every candidate at the first batch, then together; then the default and together at the other
batches, then the rest of the candidates there.
"""

import time

from jaxpar.core.xla_options import SWEEP_LOSS_RTOL

DEFAULT = "default"
TOGETHER = "together"
CANDIDATES = {  # name: config keys over the default
    DEFAULT: {},
    "cuDNN LayerNorm": {"train.xla_options": "xla_gpu_enable_cudnn_layer_norm=true"},
    "cuBLASLt epilogues": {"train.xla_options": "xla_gpu_enable_cublaslt=true"},
    "block-level fusion rewriter": {"train.xla_options": "xla_gpu_experimental_enable_fusion_block_level_rewriter=true"},
    "Triton multi-output fusion": {"train.xla_options": "xla_gpu_unsupported_enable_triton_multi_output_fusion=true"},
    "no command buffers": {"train.xla_options": "xla_gpu_enable_command_buffer="},
    "fused add + LayerNorm": {"model.norm_kernel": "pallas"},
    "bf16 logits": {"model.logits_dtype": "bfloat16"},
}
TINY_CANDIDATES = (DEFAULT, "bf16 logits")  # the suite's rehearsal: the path, at the least cost
SPEEDUP_MIN = 1.01  # faster than the default by more than a step's run-to-run spread (about 0.5%)


def merged(names: list[str], candidates: dict) -> dict:
    """The keys of several candidates at once; their XLA options joined."""
    keys, options = {}, []
    for name in names:
        for key, value in candidates[name].items():
            if key == "train.xla_options":
                options.append(value)
            else:
                keys[key] = value
    return keys | ({"train.xla_options": ",".join(options)} if options else {})


def measure(run_once, config: str, batch: int, steps: int, keys: dict) -> dict:
    """One candidate's row: run_once(config, steps, **keys) -> a RunResult."""
    result = run_once(config, steps, **{"train.batch_size": batch, "train.micro_batch": batch, **keys})
    summary, compiled = result.info["summary"], result.info.get("compiled", {})
    peak = compiled.get("peak_memory_bytes")
    return {"step_ms": summary["step_time_ms_median"], "tokens_per_s": summary["tokens_per_s_median"],
            "peak_gib": None if peak is None else peak / 2**30, "loss": result.losses[steps - 1]}


def compared(row: dict, default: dict | None) -> dict:
    """The row beside the default's at its batch: speed-up, loss difference, within tolerance."""
    if default is None or "step_ms" not in row or "step_ms" not in default:
        return row
    diff = abs(row["loss"] - default["loss"]) / abs(default["loss"])
    return {**row, "speedup": default["step_ms"] / row["step_ms"], "loss_rel_diff": diff,
            "loss_ok": diff <= SWEEP_LOSS_RTOL}


def winners(rows: list[dict], batch: int) -> list[str]:
    """The candidates faster than the default at `batch` by SPEEDUP_MIN, the loss within tolerance."""
    return [r["candidate"] for r in rows if r["batch"] == batch and r["candidate"] not in (DEFAULT, TOGETHER)
            and r.get("loss_ok") and r.get("speedup", 0) >= SPEEDUP_MIN]


def plan_order(names: list[str], batches: tuple) -> list[tuple[int, str]]:
    """(batch, candidate) in the order that puts the deciding figures first (the docstring)."""
    first, rest = batches[0], batches[1:]
    order = [(first, n) for n in names] + [(first, TOGETHER)]
    order += [(b, n) for b in rest for n in (DEFAULT, TOGETHER)]
    return order + [(b, n) for b in rest for n in names if n != DEFAULT]


def sweep(run_once, config: str, batches: tuple, steps: int, names: list[str], deadline: float) -> dict:
    """Every (batch, candidate) that fits before `deadline` (time.monotonic()); a run that fails
    gives its error's line. -> {"rows": [...], "together": [...], "defaults": [...]}."""
    rows, dearest, together = [], 0.0, None
    defaults: dict[int, dict] = {}
    for batch, name in plan_order(names, batches):
        if name == TOGETHER and together is None:
            together = winners(rows, batches[0])
        if name == TOGETHER and len(together) < 2:  # none or one: nothing new to measure
            continue
        row = {"batch": batch, "candidate": name, "keys": merged(together, CANDIDATES) if name == TOGETHER
               else CANDIDATES[name]}
        if time.monotonic() + dearest > deadline:
            rows.append({**row, "error": "not run: past the budget"})
            continue
        start = time.monotonic()
        try:  # one candidate's failure (an option this XLA lacks) keeps the others' figures
            row |= measure(run_once, config, batch, steps, row["keys"])
        except Exception as error:  # noqa: BLE001
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        dearest = max(dearest, time.monotonic() - start)
        if name == DEFAULT:
            defaults[batch] = row
        rows.append(compared(row, defaults.get(batch)) if name != DEFAULT else row)
    return {"rows": rows, "together": together if together and len(together) >= 2 else [],
            "defaults": winners(rows, batches[0])}


def sweep_table(found: dict) -> list[str]:
    """The sweep as markdown lines."""
    fmt = lambda v, spec: "-" if v is None else format(v, spec)
    lines = ["", "| batch | candidate | step ms | tokens/s | speed-up | peak GiB (XLA) | loss | loss rel. diff |",
             "|---|---|---|---|---|---|---|---|"]
    for r in found["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['candidate']} | {r['error']} | | | | | |")
            continue
        ok = "" if r.get("loss_ok", True) else " (over tolerance)"
        lines.append(f"| {r['batch']} | {r['candidate']} | {r['step_ms']:,.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{fmt(r.get('speedup'), '.3f')} | {fmt(r['peak_gib'], '.2f')} | {r['loss']:.4f} | "
                     f"{fmt(r.get('loss_rel_diff'), '.1e')}{ok} |")
    chosen = ", ".join(found["defaults"]) or "none"
    together = ", ".join(found["together"]) or "-"
    verdict = (f"\nfaster than the default by {SPEEDUP_MIN - 1:.0%} or more, loss within {SWEEP_LOSS_RTOL:.0e}: "
               f"{chosen}; together: {together}")
    return [*lines, verdict]
