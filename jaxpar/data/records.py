"""Corpora of records, one document per record: jsonl (`.jsonl`, `.json`, either one `.gz` or
`.zst`), parquet (read by row group) and `datasets` Arrow (`.arrow` files, or a save_to_disk
folder of them), the text taken from one field (`--text-field`, default `text`).

A file is read in pieces of about BATCH_BYTES (whole lines, or a batch of rows), so memory stays
bounded whatever its size; the pieces are parsed and tokenized on the workers. A bad record (no
such field, a value that is not a string, a line that is not JSON) is one line naming the file and
the record, unless `--skip-bad-records` leaves it out and counts it. An unreadable file is one line.
"""

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

from jaxpar.core.errors import UserError

BATCH_BYTES = 1 << 20
JSONL = tuple(s + c for s in (".jsonl", ".json") for c in ("", ".gz", ".zst"))
SUFFIXES = JSONL + (".parquet", ".arrow")


@dataclass(frozen=True)
class RecordOptions:
    field: str = "text"
    skip_bad: bool = False


@dataclass(frozen=True)
class RecordPiece:
    path: str
    first: int  # the index of its first record in the file (a jsonl line number less one)
    lines: bytes | None  # jsonl: whole lines
    values: list | None  # parquet and Arrow: the field's values
    size: int  # the input bytes it stands for
    options: RecordOptions
    last: bool = True  # each record is a whole document


def is_records(path: Path) -> bool:
    """A record file, or a save_to_disk folder (its .arrow files)."""
    return path.name.endswith(SUFFIXES) or path.is_dir() and any(path.glob("*.arrow"))


def input_size(path: Path) -> int:
    return sum(p.stat().st_size for p in sorted(path.glob("*.arrow"))) if path.is_dir() else path.stat().st_size


def read_record_pieces(path: Path, options: RecordOptions, limit: int | None = None):
    """The file's RecordPieces in order; with `limit`, stop after the piece that reaches `limit`
    input bytes."""
    files = sorted(path.glob("*.arrow")) if path.is_dir() else [path]
    done = 0
    for file in files:
        read = read_jsonl if file.name.endswith(JSONL) else read_table
        for piece in read(file, options):
            yield piece
            done += piece.size
            if limit is not None and done >= limit:
                return


def _open_jsonl(path: Path, raw):
    if path.suffix == ".gz":
        return gzip.GzipFile(fileobj=raw)
    if path.suffix == ".zst":
        try:
            import zstandard
        except ImportError:
            raise UserError(f"input '{path}' is zstd-compressed; pip install zstandard, or decompress it") from None
        return zstandard.ZstdDecompressor().stream_reader(raw)
    return raw


def read_jsonl(path: Path, options: RecordOptions):
    with open(path, "rb") as raw:
        stream, carry, first, seen = _open_jsonl(path, raw), b"", 0, 0
        try:
            while True:
                block = stream.read(BATCH_BYTES)
                buf = carry + block
                end = len(buf) if not block else buf.rfind(b"\n") + 1
                if end or not block:
                    lines, carry = buf[:end], buf[end:]
                    size, seen = raw.tell() - seen, raw.tell()
                    yield RecordPiece(str(path), first, lines, None, size, options)
                    first += lines.count(b"\n")
                else:
                    carry = buf
                if not block:
                    return
        except (OSError, EOFError, ValueError) as e:
            raise UserError(f"input '{path}' cannot be read as {path.suffix} ({e}); pass an intact file") from None


def read_table(path: Path, options: RecordOptions):
    """Parquet by row group, or an Arrow IPC file (stream or file format), in batches of rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    try:
        if path.suffix == ".parquet":
            table = pq.ParquetFile(str(path), pre_buffer=False)  # pre-buffering kept ~600 MB per GB read
            schema, rows = table.schema_arrow, table.metadata.num_rows
            batches = table.iter_batches(batch_size=1024, columns=_column(path, schema, options))
        else:
            (schema, batches), rows = arrow_batches(path), None
            _column(path, schema, options)
        first, size = 0, path.stat().st_size
        for batch in batches:
            values = batch.column(options.field).to_pylist()
            share = size * len(values) // rows if rows else batch.nbytes
            yield RecordPiece(str(path), first, None, values, share, options)
            first += len(values)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"input '{path}' is not a readable {path.suffix[1:]} file ({e}); pass an intact file") from None


def arrow_batches(path: Path):
    """(schema, its record batches) of an Arrow IPC file: the stream format `datasets` writes, or
    the random-access file format; pyarrow's errors pass through."""
    import pyarrow as pa
    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_stream(source)
        return reader.schema, iter(reader)
    except pa.ArrowInvalid:
        source.seek(0)
        reader = pa.ipc.open_file(source)
        return reader.schema, (reader.get_batch(i) for i in range(reader.num_record_batches))


def _column(path: Path, schema, options: RecordOptions) -> list[str]:
    import pyarrow as pa
    if options.field not in schema.names:
        raise UserError(f"input '{path}' has no column '{options.field}' (its columns: "
                        f"{', '.join(schema.names)}); pass --text-field NAME")
    kind = schema.field(options.field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise UserError(f"input '{path}': column '{options.field}' holds {kind}, not strings; pass "
                        "--text-field NAME of a text column")
    return [options.field]


def documents(piece: RecordPiece) -> tuple[list[str], int]:
    """(the piece's texts, how many bad records were skipped)."""
    texts, skipped, field = [], 0, piece.options.field
    values = piece.values if piece.lines is None else piece.lines.split(b"\n")
    for index, value in enumerate(values):
        if piece.lines is not None:
            if not value.strip():
                continue
            value = _json_field(piece, index, value)
        if isinstance(value, str):
            texts.append(value)
        elif piece.options.skip_bad:
            skipped += 1
        else:
            what = "no" if value is None else f"a {type(value).__name__}, not a string, as its"
            raise UserError(f"input '{piece.path}': record {piece.first + index} has {what} '{field}' "
                            "field; pass --text-field NAME, or --skip-bad-records to leave such records out")
    return texts, skipped


def _json_field(piece: RecordPiece, index: int, line: bytes):
    try:
        record = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        if piece.options.skip_bad:
            return None
        raise UserError(f"input '{piece.path}': line {piece.first + index + 1} is not JSON; pass one "
                        "JSON object a line, or --skip-bad-records to leave such lines out") from None
    return record.get(piece.options.field) if isinstance(record, dict) else None
