"""Which source each row of a batch comes from, for a weighted mixture of prepared sources.

The rows of a split are numbered globally (step x batch_size + row). Rows fall into fixed blocks of
`data.mix_block`; each block holds each source's exact share (the largest remainders of
weight x block), shuffled by a permutation that is a pure function of (seed, split, block), as in
Levanter's block-deterministic MixtureDataset. So the order is the same for any mesh or process
count, a resume at any step continues it exactly, and the shares are exact per block, not only in
expectation. Within its source a row starts at an offset drawn from (seed, split, step).
"""

from dataclasses import dataclass

import numpy as np

from jaxpar.core.data_config import Source, block_counts, parse_mix
from jaxpar.core.errors import UserError

MIX_STREAM = 2  # the row-to-source permutations' own stream, apart from the offsets' (seed, split, step)


@dataclass(frozen=True)
class Mixture:
    sources: tuple[Source, ...]
    block: int  # rows per block

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sources]

    def counts(self) -> np.ndarray:
        """Rows per block of each source: weight x block, rounded by largest remainders."""
        return block_counts([s.weight for s in self.sources], self.block)

    def block_order(self, seed: int, split_id: int, block: int) -> np.ndarray:
        """The source of each row of one block."""
        rng = np.random.default_rng([seed, split_id, MIX_STREAM, block])
        return rng.permutation(np.repeat(np.arange(len(self.sources)), self.counts()))

    def row_sources(self, seed: int, split_id: int, first_row: int, n_rows: int) -> np.ndarray:
        """The source index of global rows first_row .. first_row + n_rows - 1."""
        first, last = first_row // self.block, (first_row + n_rows - 1) // self.block
        rows = np.concatenate([self.block_order(seed, split_id, b) for b in range(first, last + 1)])
        start = first_row - first * self.block
        return rows[start:start + n_rows]


def mixture_rows(mixture: Mixture, seed: int, split_id: int, step: int, batch_size: int,
                 sizes: list[int], block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(source index, start offset) of each row of the global batch at `step`."""
    which = mixture.row_sources(seed, split_id, step * batch_size, batch_size)
    highs = np.asarray(sizes, np.int64)[which] - block_size
    offsets = np.random.default_rng([seed, split_id, step]).integers(0, highs)
    return which, offsets


def mix_change(saved: dict, now, step: int) -> dict | None:
    """How data.mix differs from the checkpoint's (its config's data section, `saved`): None if
    alike; else {step, before, after} for run.json. A source removed, moved or given another path
    is refused unless data.mix_sources_changed; new weights and added sources are not."""
    before_text = saved.get("mix", "")
    if before_text == now.mix:
        return None
    before, after = parse_mix(before_text), parse_mix(now.mix)
    old = [(s.name, s.path) for s in before] or [("data.path", saved.get("path", ""))]
    new = [(s.name, s.path) for s in after] or [("data.path", now.path)]
    kept = [source for source in new if source in old]
    if (len(kept) < len(old) or kept != [source for source in old if source in new]) \
            and not now.mix_sources_changed:
        gone = [name for name, path in old if (name, path) not in new]
        what = f"drops or changes source '{gone[0]}'" if gone else "reorders its sources"
        raise UserError(f"this data.mix {what} against the checkpoint's ({before_text or 'none'}); "
                        "resume with the checkpoint's sources (weights may change), pass "
                        "--data.mix_sources_changed=true to go on anyway, or start over with --fresh")
    return {"step": step, "before": before_text, "after": now.mix}
