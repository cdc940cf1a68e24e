"""Reading a UTF-8 corpus in bounded pieces, and mapping a function over the pieces on all cores.

Memory stays bounded whatever the corpus: a file is read CHUNK_BYTES at a time, and at most a few
pieces per worker are in flight. A piece ends where a tokenizer splits words anyway, so
tokenizing piece by piece gives the tokens of the whole text:
  - after a newline between two visible ASCII characters ("x\\nY": exact for the GPT-2, cl100k
    and o200k pre-tokenizers, which put that newline in a token of its own);
  - else after any newline, else after a space or tab (these may merge whitespace differently);
  - else, in a long run without whitespace, before the last UTF-8 character.
"""

import contextlib
import glob
import os
import re
import signal
import sys
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpar.core.errors import UserError
from jaxpar.data import records
from jaxpar.data.records import RecordOptions

EOT = "<|endoftext|>"  # the end-of-text token of GPT-2 and of the byte and BPE tokenizers
CHUNK_BYTES = 1 << 20
SAFE_NEWLINE = {bytes: re.compile(rb"[!-~]\n(?=[!-~])"), str: re.compile(r"[!-~]\n(?=[!-~])")}
NEAR_END = 1 << 16  # the last safe newline is looked for in this many final bytes, then further


@dataclass(frozen=True)
class Piece:
    path: str
    offset: int  # of data's first byte in the file
    data: bytes
    last: bool  # the end of its file (one document)

    @property
    def size(self) -> int:
        """The input bytes it stands for (a RecordPiece has the same)."""
        return len(self.data)


def expand_inputs(patterns: list[str]) -> list[Path]:
    """Each argument as a file, or as a glob (sorted) when no such file exists; order kept."""
    paths = []
    for pattern in patterns:
        if Path(pattern).exists() or not any(c in pattern for c in "*?["):
            paths.append(Path(pattern))
            continue
        matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True))
        files = [p for p in matches if not p.is_dir()]
        if not files:
            what = "only directories" if matches else "no files"
            raise UserError(f"input glob '{pattern}' matches {what}; pass UTF-8 text files")
        paths += files
    for path in paths:
        check_input(path)
    return paths


def check_input(path: Path) -> None:
    if not path.exists():
        raise UserError(f"input '{path}' not found; pass existing UTF-8 text files or globs")
    if path.is_dir() and records.is_records(path):  # a save_to_disk folder
        return
    if path.is_dir():
        raise UserError(f"input '{path}' is a directory; pass its files, e.g. '{path}/*.txt'")
    if not path.is_file():
        raise UserError(f"input '{path}' is not a regular file (each input is read twice by "
                        "some tokenizers); save it to a file first")
    if not os.access(path, os.R_OK):
        raise UserError(f"input '{path}' is not readable by this user; fix its permissions")


def cut_point(buf):
    """Where the piece of a full buffer (bytes or str) ends; the rest goes to the next piece."""
    half = len(buf) // 2
    safe = SAFE_NEWLINE[type(buf)]
    for start in (max(len(buf) - NEAR_END, half), half):
        last = None
        for last in safe.finditer(buf, start):
            pass
        if last is not None:
            return last.start() + 2
    newline = "\n" if isinstance(buf, str) else b"\n"
    space, tab = (" ", "\t") if isinstance(buf, str) else (b" ", b"\t")
    for found in (buf.rfind(newline, half), max(buf.rfind(space, half), buf.rfind(tab, half))):
        if found >= 0:
            return found + 1
    if isinstance(buf, str):
        return len(buf)
    end = len(buf)
    while end > len(buf) - 4 and end > 1 and buf[end - 1] & 0xC0 == 0x80:  # continuation byte
        end -= 1
    # Cut before the character that starts at end - 1, which may be incomplete.
    return end - 1 if end > 1 and buf[end - 1] >= 0x80 else len(buf)


def split_text(text: str, size: int) -> list[str]:
    """text in pieces of about `size` characters or fewer, cut where cut_point cuts."""
    pieces = []
    while len(text) > size:
        end = cut_point(text[:size])
        pieces.append(text[:end])
        text = text[end:]
    return pieces + [text] if text or not pieces else pieces


def read_pieces(path: Path, chunk_bytes: int = CHUNK_BYTES, limit: int | None = None):
    """The file's Pieces in order; an empty file gives one empty last piece. With `limit`, stop
    after the piece that reaches `limit` bytes."""
    offset, carry = 0, b""
    with open(path, "rb") as file:
        while True:
            wanted = chunk_bytes - len(carry)  # > chunk_bytes / 2: pieces end past mid-buffer
            block = file.read(wanted)
            buf = carry + block
            at_end = len(block) < wanted  # a regular file reads short only at its end
            end = len(buf) if at_end else cut_point(buf)
            last = at_end or (limit is not None and offset + end >= limit)
            yield Piece(str(path), offset, buf[:end], last)
            if last:
                return
            offset, carry = offset + end, buf[end:]


def pieces_of(path: Path, options: RecordOptions = RecordOptions(), limit: int | None = None):
    """A text file's Pieces, or a record file's RecordPieces (jaxpar.data.records)."""
    if records.is_records(path):
        return records.read_record_pieces(path, options, limit)
    return read_pieces(path, limit=limit)


def texts_of(piece) -> tuple[list[str], int]:
    """(the piece's texts: its part of one document, or whole records; bad records skipped)."""
    return records.documents(piece) if isinstance(piece, records.RecordPiece) else ([decode_piece(piece)], 0)


def decode_piece(piece: Piece) -> str:
    try:
        return piece.data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"input '{piece.path}' is not UTF-8 text (byte {piece.offset + e.start}); "
                        "convert it to UTF-8 first") from None


def default_workers() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


_worker_fn = None


def _start_worker(make_fn, args):
    import signal
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle: one message
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    global _worker_fn
    _worker_fn = make_fn(*args)


def _run_in_worker(item):
    return _worker_fn(item)


def ordered_map(make_fn, args: tuple, items, workers: int, per_worker: int = 3):
    """fn(item) for each item in order, where fn = make_fn(*args) is built once per process:
    in this process when workers <= 1, else in `workers` fresh processes, with at most
    workers * per_worker items read ahead (multiprocessing's imap would read them all). However it
    ends (an error, Interrupted, or the caller closing it), the workers are stopped and waited for."""
    if workers <= 1:
        yield from map(make_fn(*args), items)
        return
    import multiprocessing
    # spawn: forking a process whose Rust tokenizers or JAX already started threads can hang.
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, _start_worker, (make_fn, args)) as pool:
        pending = deque()
        for item in items:
            pending.append(pool.apply_async(_run_in_worker, (item,)))
            if len(pending) >= workers * per_worker:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised where the main thread is, as Ctrl-C's KeyboardInterrupt is: the
    with-blocks on the way out stop the workers (ordered_map's pool) and remove what was half
    written."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def interrupted_by_signals(prog: str):
    """SIGTERM and SIGINT raise Interrupted in the main thread (SIGTERM's default would end the
    process at once, its workers orphaned and its partial files left). A second signal, while the
    first one's clean-up runs, ends the process at once."""
    if threading.current_thread() is not threading.main_thread():  # handlers only install there
        yield
        return
    raised = []

    def on_signal(signum, frame):
        if raised:
            print(f"{prog}: stopped at once by a second {signal.Signals(signum).name}", file=sys.stderr, flush=True)
            os._exit(128 + signum)
        raised.append(signum)
        raise Interrupted(signum)
    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def progress_bar(total_bytes: int, desc: str, progress: bool | None):
    """A tqdm bar in bytes on stderr; progress=None shows it only when stderr is a terminal.
    It is erased when done: a summary line, or an error's one line, takes its place."""
    from tqdm import tqdm
    return tqdm(total=total_bytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                disable=None if progress is None else not progress, dynamic_ncols=True,
                mininterval=0.5, leave=False)


def code_points(text: str) -> np.ndarray:
    """The text's Unicode code points as uint32, or a UserError for a lone surrogate."""
    try:
        return np.frombuffer(text.encode("utf-32-le"), np.uint32)
    except UnicodeEncodeError as e:  # a lone surrogate, e.g. from undecodable command-line bytes
        raise UserError(f"the text holds {e.object[e.start]!r}, which is not a character") from None
