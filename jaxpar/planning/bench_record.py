"""What jaxpar.bench keeps of its rows: beside each layout's run (bench_layout.json), the settings
its row was measured under, and the row; and the rows compared (bench.json, bench.md, bench.png).

A later bench into the same --out reuses a row only under the same settings (the layout's resolved
config and --weak), and says why when it measures again. Speedup and efficiency are against the
first row, the 1-device baseline: where it failed, no row has them, and the notes say so.
"""

import json
from pathlib import Path

from jaxpar.core.written import FILE, FOLDER, Outputs
from jaxpar.training.run.loss_plots import plot_bench

RECORD = "bench_layout.json"  # {"settings": ..., "row": ...}
SHOWN = 3  # changed settings named in the one line
LOSS_RTOL = 1e-5  # the equivalence tests' tolerance for the same model on any layout
HFU_NOTE = ("HFU = MFU x about 8/6 with pp > 1 (each pipeline backward recomputes its stage's forward; "
            "12/6 with zb-h1, whose B and W each rerun it); "
            "otherwise HFU = MFU: ZeRO-3's remat only re-gathers weights, which is communication, "
            "not FLOPs")


def settings(config: dict, weak: bool) -> dict:
    """What a layout's row depends on (its resolved config, as Config.to_dict gives it, and
    --weak), as JSON gives it back, so that a saved record compares equal."""
    return json.loads(json.dumps({"weak": weak, "config": config}))


def changes(old, new, key: str = "") -> list[str]:
    """The settings that differ, each as 'section.field old -> new'."""
    if isinstance(old, dict) and isinstance(new, dict):
        return [change for k in sorted(old.keys() | new.keys())
                for change in changes(old.get(k), new.get(k), f"{key}.{k}" if key else k)]
    return [] if old == new else [f"{key.removeprefix('config.')} {old} -> {new}"]


def earlier_row(now: dict, run_dir: Path) -> tuple[dict | None, str]:
    """The row measured earlier in run_dir under the settings `now` (settings(...)'s); else None,
    and why it is not reused ('' when run_dir holds no earlier run)."""
    if not run_dir.exists():
        return None, ""
    try:
        record = json.loads((run_dir / RECORD).read_text())
        old, row = record["settings"], record["row"]
        failed = row["error"]
    except (OSError, ValueError, KeyError, TypeError):
        return None, f"holds no record ({RECORD}) of the settings it was measured with"
    if failed:
        return None, f"failed ({failed})"
    changed = changes(old, now)
    if changed:
        more = f" and {len(changed) - SHOWN} more" if len(changed) > SHOWN else ""
        return None, f"was measured with other settings ({'; '.join(changed[:SHOWN])}{more})"
    return row, ""


def add_scaling(rows: list[dict]) -> None:
    """Speedup and efficiency against rows[0], the baseline; None where either run failed."""
    base = rows[0]
    for row in rows:
        ok = row.get("tokens_per_s") and base.get("tokens_per_s")
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"] if ok else None
        row["efficiency"] = (row["speedup"] * base["devices"] / row["devices"]) if ok else None


def loss_spread(rows: list[dict]) -> float | None:
    """Largest relative difference of a final loss from the baseline's, over the rows that ran."""
    losses = [row["final_loss"] for row in rows if row.get("final_loss") is not None]
    if rows[0].get("final_loss") is None or len(losses) < 2:
        return None
    return max(abs(loss - losses[0]) / abs(losses[0]) for loss in losses)


def size(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def collectives_cell(collectives: dict) -> str:
    return "; ".join(f"{kind} {c['count']}× {size(c['bytes'])}" for kind, c in collectives.items()
                     if c["count"]) or "none"


def table(rows: list[dict]) -> str:
    """The Markdown table: one row per layout; a failed layout shows its error, and where the
    baseline failed the others have no speedup or efficiency ('-', said in the notes)."""
    header = ["layout", "devices", "batch", "tokens/s", "step (ms)", "compile (s)", "MFU", "HFU",
              "speedup", "efficiency", "params + opt state / device", "peak memory / device",
              "collectives (count, bytes)", "final loss"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if r["error"]:
            cells = [r["layout"], r["devices"], r["batch_size"], "failed: " + r["error"]]
            lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in cells)
                         + " |" * (len(header) - len(cells) + 1))
            continue
        per_device = r["bytes_per_device"]["params"] + r["bytes_per_device"]["opt_state"]
        cells = [r["layout"], r["devices"], r["batch_size"], f"{r['tokens_per_s']:,.0f}",
                 f"{r['step_time_ms']:.1f}", f"{r['compile_s']:.1f}", f"{100 * r['mfu']:.2f}%",
                 f"{100 * r['hfu']:.2f}%", ratio(r["speedup"]), ratio(r["efficiency"]),
                 size(per_device), size(r["peak_memory_bytes"]), collectives_cell(r["collectives"]),
                 f"{r['final_loss']:.5f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def notes(rows: list[dict], weak: bool) -> list[str]:
    mode = ("weak scaling: the global batch grows with the device count" if weak
            else "strong scaling: the same global batch on every layout")
    against = (f"speedup and efficiency are against the 1-device run ({rows[0]['layout']})" if not rows[0]["error"]
               else f"the 1-device run ({rows[0]['layout']}) failed, so no layout has a speedup or efficiency (-)")
    found = [f"{mode}; {against}.",
             "Step time and tokens/s are medians with compile time excluded (reported apart).",
             HFU_NOTE + "."]
    spread = loss_spread(rows)
    if spread is not None and not weak:
        verdict = "agree" if spread <= LOSS_RTOL else "DIFFER"
        found.append(f"Final losses {verdict}: largest relative difference from the baseline "
                     f"{spread:.1e} (rtol {LOSS_RTOL:g}).")
    if any(r.get("platform") == "cpu" and r["devices"] > 1 for r in rows):
        found.append("On a CPU, forced host devices share the same cores, so speedups measure "
                     "overheads, not a cluster's scaling; and each run measures its own CPU peak "
                     "FLOP/s, so MFU moves with that measurement.")
    return found


REPORT = ("bench.json", "bench.md", "bench.png")


def bench_outputs(out_dir: Path, slugs: list[str]) -> Outputs:
    """What a bench writes in --out (jaxpar.core.written): its report's files and a run folder per
    layout; a bench from before the record is known by its bench.json."""
    return Outputs(out_dir, {**dict.fromkeys(REPORT, FILE), **dict.fromkeys(slugs, FOLDER)},
                   legacy=("bench.json", is_bench_json))


def is_bench_json(path: Path) -> bool:
    try:
        rows = json.loads(path.read_text())
        return isinstance(rows, list) and all({"layout", "run_dir", "error"} <= row.keys() for row in rows)
    except (OSError, ValueError, AttributeError):
        return False


def write_outputs(rows: list[dict], out_dir: Path, weak: bool) -> str:
    """bench.json, bench.md and bench.png; returns the Markdown."""
    Outputs(out_dir, dict.fromkeys(REPORT, FILE), legacy=("bench.json", is_bench_json)).claim(*REPORT)
    (out_dir / "bench.json").write_text(json.dumps(rows, indent=2))
    markdown = table(rows) + "\n\n" + "\n".join(f"- {note}" for note in notes(rows, weak)) + "\n"
    (out_dir / "bench.md").write_text(markdown)
    plot_bench(rows, out_dir / "bench.png")
    return markdown
