"""What jaxpar.bench keeps beside each layout's run (bench_layout.json): the settings its row was
measured under, and the row. A later bench into the same --out reuses the row only under the same
settings (the layout's resolved config and --weak), and says why when it measures again."""

import json
from pathlib import Path

RECORD = "bench_layout.json"  # {"settings": ..., "row": ...}
SHOWN = 3  # changed settings named in the one line


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
