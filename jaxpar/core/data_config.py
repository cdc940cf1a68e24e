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

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.core.paths import checked

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
    if not math.isfinite(sum(s.weight for s in sources)):  # each share is weight / sum
        raise UserError(f"data.mix's weights (up to {max(s.weight for s in sources):g}) add up past the largest float; "
                        "divide them all by one factor: only their ratios count")
    return tuple(sources)


def block_counts(weights, block: int) -> np.ndarray:
    """Rows per block of each source: weight x block / the sum, rounded by largest remainders."""
    weights = np.asarray(weights, np.float64)
    exact = weights / weights.sum() * block
    counts = np.floor(exact).astype(np.int64)
    short = block - counts.sum()
    # Largest remainder first; ties go to the earlier source (stable sort).
    counts[np.argsort(-(exact - counts), kind="stable")[:short]] += 1
    return counts


def check_shares(sources: tuple[Source, ...], block: int) -> None:
    """Every source gets a row of each block: one that gets none is never trained on."""
    weights = [s.weight for s in sources]
    counts = block_counts(weights, block)
    if len(sources) < 2 or counts.min() > 0:
        return
    i = int(counts.argmin())
    if len(sources) > block:
        raise UserError(f"data.mix_block={block} rows a block cannot hold a row of each of data.mix's {len(sources)} "
                        f"sources, so source '{sources[i].name}' is never sampled; raise data.mix_block (default 1000)")
    raise UserError(f"data.mix source '{sources[i].name}' has weight {weights[i]:g}, too small for one row in each "
                    f"block of data.mix_block={block}, so it would never be sampled; give it at least "
                    f"{least_weight(weights, i, block):g}, or leave it out")


def least_weight(weights: list[float], i: int, block: int) -> float:
    """The smallest weight, in 3 significant digits, that gives source i a row of each block
    (the others' weights kept)."""
    gets_row = lambda w: block_counts(weights[:i] + [w] + weights[i + 1:], block)[i] > 0
    low, high = weights[i], (sum(weights) - weights[i]) / (block - 1) * 1.01  # at high its exact share is >= 1 row
    for _ in range(64):  # the rounding by largest remainders gives a row to a little less
        middle = math.sqrt(low) * math.sqrt(high)  # no overflow of the product
        low, high = (low, middle) if gets_row(middle) else (middle, high)
    step = 10.0 ** (math.floor(math.log10(high)) - 2)
    least = math.ceil(high / step) * step
    return least if gets_row(least) else least + step


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
    sources = parse_mix(d.mix)
    check_shares(sources, d.mix_block)
    for source in sources:
        checked(source.path, f"data.mix source '{source.name}'")
    if d.path:
        checked(d.path, "data.path")
