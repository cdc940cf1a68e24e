"""The [data] section: one source (`path`) or a weighted mixture of prepared sources (`mix`), the
val fraction of a text file, and document masking.

A mixture is written `name=path:weight,...` on the command line, or as a TOML table:

    [data.mix]
    web = {path = "data/web", weight = 0.6}
    code = "data/code:0.3"

and kept in the config as the canonical command-line text, so checkpoints and run.json hold it as
written. Weights need not sum to 1: each source gets weight / sum of the rows.
"""

import math
import re
from dataclasses import dataclass

from jaxpar.core.errors import UserError

NAME = re.compile(r"[A-Za-z0-9_.-]+")
FORM = "name=path:weight,... (e.g. web=data/web:0.6,code=data/code:0.4)"


@dataclass
class DataConfig:
    path: str = ""  # empty: the built-in Tiny Shakespeare
    val_fraction: float = 0.1
    # Several jaxpar.prepare directories at once, `name=path:weight,...` (see the module's doc).
    mix: str = ""
    # Rows per mixture block: every block of this many consecutive rows holds each source's exact
    # share (largest remainders of weight x block), in an order shuffled per (seed, split, block).
    mix_block: int = 1000
    # On resume, a source removed from the mix or moved in it is refused unless this is true.
    mix_sources_changed: bool = False
    # Attention stops at each end-of-text token and positions restart after it.
    document_mask: bool = False


@dataclass(frozen=True)
class Source:
    name: str
    path: str
    weight: float


def parse_mix(text: str) -> tuple[Source, ...]:
    """The sources of a `name=path:weight,...` text; each name once, each weight positive."""
    sources = []
    for entry in filter(None, (part.strip() for part in text.split(","))):
        name, eq, rest = entry.partition("=")
        path, colon, weight = rest.rpartition(":")
        if not (eq and colon and path and NAME.fullmatch(name.strip())):
            raise UserError(f"data.mix entry '{entry}' is not name=path:weight; write {FORM}")
        try:
            value = float(weight)
        except ValueError:
            raise UserError(f"data.mix source '{name}' has weight '{weight}', not a number; "
                            f"write {FORM}") from None
        if not (math.isfinite(value) and value > 0):
            raise UserError(f"data.mix source '{name}' has weight {weight}; each weight must be "
                            "positive (leave a source out to stop training on it)")
        sources.append(Source(name.strip(), path.strip(), value))
    names = [s.name for s in sources]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UserError(f"data.mix names source '{repeated[0]}' twice; give each source its own name")
    if text.strip() and not sources:
        raise UserError(f"data.mix is empty; write {FORM}")
    return tuple(sources)


def mix_text(table: dict) -> str:
    """A TOML [data.mix] table as the command-line text: each value 'path:weight' or a table
    {path, weight}."""
    entries = []
    for name, value in table.items():
        if isinstance(value, dict) and set(value) == {"path", "weight"}:
            value = f"{value['path']}:{value['weight']}"
        if not isinstance(value, str):
            raise UserError(f"[data.mix] {name} must be \"path:weight\" or {{path = ..., "
                            f"weight = ...}}, got {value!r}")
        entries.append(f"{name}={value}")
    return ",".join(entries)


def validate_data(d: DataConfig) -> None:
    if not 0 < d.val_fraction < 1:
        raise UserError(f"data.val_fraction must be in (0, 1), got {d.val_fraction}")
    if d.mix and d.path:
        raise UserError("data.path and data.mix are both set; name one source with data.path, or "
                        "several with data.mix")
    if d.mix_block < 1:
        raise UserError(f"data.mix_block must be positive, got {d.mix_block}")
    parse_mix(d.mix)
