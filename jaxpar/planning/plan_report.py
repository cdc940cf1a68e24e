"""`jaxpar.plan`'s outputs: the ranked table (stdout and plan.md), plan.json and plan.png."""

import json
from collections import defaultdict
from pathlib import Path

from jaxpar.core.axes import PIPE_AXIS
from jaxpar.core.written import FILE, Outputs, replace_text
from jaxpar.planning import roofline

GiB = 2**30
MODEL_TEXT = roofline.__doc__.split("\n", 2)[2].strip()  # the docstring past its title line
LISTED = 20  # layouts past the compile cap shown in plan.md (all are in plan.json)
NOT_COMPILED = {"error": "failed to compile", "skipped": "skipped as the trainer would refuse them"}
SHORT = {"all-reduce": "AR", "all-gather": "AG", "reduce-scatter": "RS",
         "collective-permute": "CP", "all-to-all": "A2A", "ragged-all-to-all": "RA2A"}


def ranked(candidates: list) -> list:
    """Compiled layouts that fit, fastest (estimated) first; at equal speed, less communication,
    then less memory."""
    return sorted((c for c in candidates if c.status == "compiled" and c.fits),
                  key=lambda c: (-round(c.compiled["tokens_per_s"], 6), c.compiled["comm_s"],
                                 c.compiled["peak_memory_bytes"]))


def layout_cell(c) -> str:
    lay = c.layout
    micro = f" mb={lay['micro_batch']}" if lay[PIPE_AXIS.key] == 1 else ""
    remat = f" remat={lay['remat']}" if lay["remat"] != "none" else ""
    offload = f" offload={lay['offload']}" if lay.get("offload", "none") != "none" else ""
    context = f" {lay['context']}" if "context" in lay else ""
    fp8 = f" fp8={lay['fp8']}" if lay.get("fp8", "none") != "none" else ""
    return f"{c.mesh_spec()}{context} z{lay['zero']}{micro}{remat}{offload}{fp8}"


def memory_cell(r: dict) -> str:
    """Device memory, and the host memory beside it where the step keeps state there."""
    host = r.get("host_memory_bytes", 0)
    return f"{r['peak_memory_bytes'] / GiB:,.3f}" + (f" (+{host / GiB:,.3f} host)" if host else "")


def collectives_cell(collectives: dict) -> str:
    return " ".join(f"{SHORT[k]} {v['count']}x {v['bytes'] / 2**20:,.0f}M"
                    for k, v in collectives.items()) or "none"


def mlp_text(m) -> str:
    """The MLP as the model has it: its width, or its experts."""
    if m.n_experts:
        dense = m.n_layer - sum(m.sparse_layers)
        mixed = f" in {m.n_layer - dense} layers, MLP {m.mlp_width} in {dense}" if dense else ""
        return f"{m.n_experts} experts {m.expert_width} wide, top {m.experts_per_token}{mixed}"
    return f"MLP {m.mlp_width}"


def table(rows: list, with_rank: bool = True) -> list[str]:
    head = (["#"] if with_rank else []) + ["layout", "HBM/chip GiB", "TFLOP/chip", "× model FLOPs", "collectives "
            "per step (count, MiB)", "ops ms", "exposed comms ms", "host ms", "bubble", "step ms ≥", "tokens/s ≤",
            "MFU ≤"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rank, c in enumerate(rows, 1):
        r = c.compiled
        cells = ([str(rank)] if with_rank else []) + [
            layout_cell(c), memory_cell(r), f"{r['flops_per_chip'] / 1e12:,.1f}", f"{r['flops_over_model']:.2f}",
            collectives_cell(r["collectives"]), f"{1e3 * r['compute_s']:,.1f}",
            f"{1e3 * r['exposed_comm_s']:,.1f}", f"{1e3 * r['host_s']:,.1f}", f"{r['bubble']:.2f}",
            f"{1e3 * r['step_s']:,.1f}",
            f"{r['tokens_per_s']:,.0f}", f"{100 * r['mfu']:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def skipped_lines(candidates: list) -> list[str]:
    """Skipped layouts grouped by reason (a reason usually covers many ZeRO x micro-batch x remat)."""
    by_reason = defaultdict(set)
    for c in candidates:
        if c.status == "skipped":
            by_reason[c.reason].add(c.mesh_spec())
    return [f"- {', '.join(sorted(meshes))}: {reason}" for reason, meshes in by_reason.items()]


def report_text(target, chip, cfg, candidates: list, command) -> str:
    best = ranked(candidates)
    m = cfg.model
    attention = next((c.compiled["attention"] for c in candidates if "attention" in c.compiled), m.attention)
    out = [f"# Plan for {target.name}" + (f" ({target.topology})" if target.topology else ""),
           "",
           f"Model: {m.family}, {m.n_layer} layers, {m.n_embd} wide, {m.n_head} heads "
           f"({m.kv_heads} KV), {mlp_text(m)}, block {m.block_size}, "
           f"{m.dtype}, attention kernel {attention}; batch {cfg.train.batch_size} sequences. Chip: {chip.kind}, "
           f"{chip.hbm_bytes / GiB:,.1f} GiB, {chip.peak_flops / 1e12:,.0f} TFLOP/s"
           + (f" ({chip.fp8_peak_flops / 1e12:,.0f} in FP8)" if chip.fp8_peak_flops else "") + ", "
           f"{chip.link_bytes_per_s / 1e9:,.0f} GB/s per link and direction"
           + (f", {chip.host_bytes_per_s / 1e9:,.0f} GB/s to its host" if chip.host_bytes_per_s else "")
           + f" ({chip.source}).", "",
           f"## Ranked: {len(best)} compiled layouts that fit", ""] + table(best)
    too_big = [c for c in candidates if c.status == "compiled" and not c.fits]
    refused = [c for c in candidates if c.status == "out of memory"]
    if too_big or refused:
        out += ["", f"## Do not fit in {chip.hbm_bytes / GiB:,.2f} GiB", ""]
        out += table(sorted(too_big, key=lambda c: c.compiled["peak_memory_bytes"]), with_rank=False)
        out += [""] + [f"- {layout_cell(c)}: needs {c.compiled['needs_bytes'] / GiB:,.2f} GiB of "
                       f"temporaries alone (XLA: {c.reason})"
                       for c in sorted(refused, key=lambda c: c.compiled["needs_bytes"])]
    errors = [c for c in candidates if c.status == "error"]
    if errors:
        out += ["", "## Compile errors", ""] + [f"- {layout_cell(c)}: {c.reason}" for c in errors]
    later = sorted((c for c in candidates if c.status == "not compiled"),
                   key=lambda c: -c.guess["tokens_per_s"])
    if later:
        out += ["", f"## Not compiled ({len(later)}, past --max-compiles), by the cheap guess", ""]
        out += [f"- {layout_cell(c)}: ~{c.guess['memory_bytes'] / GiB:,.1f} GiB, "
                f"~{c.guess['tokens_per_s']:,.0f} tokens/s" for c in later[:LISTED]]
        if len(later) > LISTED:
            out.append(f"- and {len(later) - LISTED} more, in plan.json")
    if any(c.status == "skipped" for c in candidates):
        out += ["", "## Skipped (the trainer would refuse them)", ""] + skipped_lines(candidates)
    out += ["", "## How the estimate is made", "", "HBM per chip is XLA's memory_analysis of the "
            "compiled step (arguments + outputs - donated + temporaries), host memory (pinned_host) "
            "apart. TFLOP per chip are the model's (jaxpar.models.flops, plus what model.remat's "
            "policy and a pipeline rerun: × model FLOPs); MFU divides the model's FLOPs by the "
            "estimated step. Collectives and their replica groups come from the compiled HLO, each "
            "loop's body counted once per iteration. The step time is a roofline of the compiled "
            "step (jaxpar.planning.roofline), so tokens/s and MFU are upper bounds:", "", MODEL_TEXT]
    out += routing_note(candidates) + host_note(candidates) + fp8_note(chip, m.dtype, candidates)
    if best:
        out += ["", "## Run the best layout", "", "```", command(best[0]), "```"]
    return "\n".join(out) + "\n"


def routing_note(candidates: list) -> list[str]:
    """One line where the experts' grouped GEMMs were charged at their routed rows."""
    factors = sorted({c.compiled["dispatch_rows_factor"] for c in candidates
                      if c.compiled.get("dispatch_rows_factor", 1) > 1})
    if not factors:
        return []
    return ["", ("The experts' grouped GEMMs are charged at the routed rows (tokens x k), assuming balanced "
                 f"routing: the dispatch buffers hold {' or '.join(f'{f:g}' for f in factors)} times as many "
                 "rows, which the memory figures count and the kernels skip.")]


def fp8_note(chip, dtype: str, candidates: list) -> list[str]:
    """One line where a layout runs model.fp8: its GEMMs' peak, and MFU's (model.dtype's)."""
    if all(c.layout.get("fp8", "none") == "none" for c in candidates):
        return []
    where = (f"at the chip's FP8 peak, {chip.fp8_peak_flops / 1e12:,.0f} TFLOP/s" if chip.fp8_peak_flops else
             f"at {dtype}'s peak: {chip.kind} has no FP8 peak on its data sheet")
    return ["", (f"model.fp8: the FP8 GEMMs are timed {where}; MFU still divides by {dtype}'s peak, "
                 f"{chip.peak_flops / 1e12:,.0f} TFLOP/s. plan.json lists each layout's GEMMs a step by "
                 "operand dtype (compiled.gemms).")]


def host_note(candidates: list) -> list[str]:
    """One line where a layout moves state to and from host memory."""
    if not any(c.compiled.get("host_s") for c in candidates):
        return []
    return ["", ("host ms: the offloaded state's transfers over the host link (optimizer state in and out, "
                 "full_offloaded's layer inputs out and back), added whole to the step as if nothing "
                 "overlapped them: where XLA hides them the step can beat this bound.")]


def candidate_json(c, command) -> dict:
    return {"layout": c.layout, "status": c.status, "reason": c.reason, "fits": c.fits,
            "guess": c.guess, "compiled": c.compiled,
            "command": command(c) if c.status == "compiled" else None}


def memory_of(c) -> float:
    return c.compiled.get("peak_memory_bytes", c.compiled.get("needs_bytes", 0))


def time_of(c) -> float:
    return c.compiled.get("step_s", c.guess.get("step_s", 0))


def plot(path: Path, candidates: list, capacity: float, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    groups = [("fits", "tab:blue", "o", [c for c in candidates if c.status == "compiled" and c.fits]),
              ("compiled, does not fit", "tab:red", "o",
               [c for c in candidates if c.status == "compiled" and not c.fits]),
              ("refused by XLA (bytes it asked for; guessed time)", "tab:red", "x",
               [c for c in candidates if c.status == "out of memory"])]
    for label, color, marker, group in groups:
        if group:
            ax.scatter([memory_of(c) / GiB for c in group], [1e3 * time_of(c) for c in group],
                       c=color, marker=marker, label=label, s=18)
    best = ranked(candidates)
    if best:
        ax.scatter([memory_of(best[0]) / GiB], [1e3 * time_of(best[0])], marker="*", s=160,
                   c="gold", edgecolors="black", zorder=3, label=f"best: {layout_cell(best[0])}")
    ax.axvline(capacity / GiB, color="black", linestyle="--", label=f"capacity {capacity / GiB:,.2f} GiB")
    ax.set_xlabel("HBM per chip (GiB, XLA memory_analysis)")
    ax.set_ylabel("estimated step time, a lower bound (ms)")
    if any(c.status in ("compiled", "out of memory") for c in candidates):
        ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plan_outputs(out: Path) -> Outputs:
    """plan.md, plan.json and plan.png in --out, which jaxpar writes and rewrites, and nothing else
    (jaxpar.core.written); a plan from before the record is known by its plan.json."""
    return Outputs(out, {name: FILE for name in ("plan.md", "plan.json", "plan.png")},
                   legacy=("plan.json", is_plan_json))


def is_plan_json(path: Path) -> bool:
    try:
        return {"target", "layouts", "model"} <= json.loads(path.read_text()).keys()
    except (OSError, ValueError, AttributeError):
        return False


def write_report(out: Path, target, chip, cfg, candidates: list, command, top: int) -> None:
    text = report_text(target, chip, cfg, candidates, command)
    outputs = plan_outputs(out)
    outputs.check()  # again, now: the compiles took minutes, in which a file may have come
    outputs.claim(*outputs.names)
    replace_text(out / "plan.md", text)  # each file whole or not at all: Ctrl-C may come at any moment
    meta = {"target": target.name, "topology": target.topology, "chip": chip.__dict__,
            "config": cfg.to_dict(), "model": MODEL_TEXT}
    replace_text(out / "plan.json", json.dumps(
        {**meta, "layouts": [candidate_json(c, command) for c in candidates]}, indent=1))
    plot(out / "plan.png", candidates, chip.hbm_bytes, f"{target.name}: one point per compiled layout")
    best = ranked(candidates)
    print("\n".join(table(best[:top])))
    counts = defaultdict(int)
    for c in candidates:
        counts["fit" if c.fits else "do not fit" if c.status == "compiled" else c.status] += 1
    print(f"\n{len(candidates)} layouts: " + ", ".join(f"{n} {k}" for k, n in counts.items())
          + f"; wrote {out}/plan.md, plan.json and plan.png")
    print(f"best: {command(best[0])}" if best else no_best(candidates))


def no_best(candidates: list) -> str:
    """Why no layout is ranked: none that compiled fits, or none compiled at all, and why not."""
    if any(c.status in ("compiled", "out of memory") for c in candidates):
        return "no compiled layout fits: see plan.md for what each needs"
    counts = defaultdict(int)
    for c in candidates:
        counts[c.status] += 1
    reasons: dict = {}  # each reason's first layout
    for c in candidates:
        reasons.setdefault(c.reason, c)
    first = next(iter(reasons.values()))
    more = f" (and {len(reasons) - 1} other reason{'s' * (len(reasons) > 2)})" if len(reasons) > 1 else ""
    n = len(candidates)
    return (f"none of the {n} layout{'s' * (n != 1)} compiled: "
            + ", ".join(f"{k} {NOT_COMPILED.get(status, status)}" for status, k in counts.items())
            + f"; {layout_cell(first)}: {first.reason}{more}; see plan.md for each")
