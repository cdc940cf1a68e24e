"""`python -m jaxpar.export --ckpt RUN_DIR --out HF_DIR [--dtype bfloat16] [--force]`: a checkpoint
as a Hugging Face GPT2LMHeadModel or LlamaForCausalLM, by its model.family.

HF_DIR gets config.json, model.safetensors (shards and their index above 5 GB, as save_pretrained
writes them), and (for every tokenizer but tiktoken's) tokenizer.json
and tokenizer_config.json, so that transformers' AutoModelForCausalLM.from_pretrained(HF_DIR) and
AutoTokenizer.from_pretrained(HF_DIR) both load it; and jaxpar_export.json, which lists the files
the export wrote.

jaxpar deletes only what it wrote. HF_DIR must be new, empty, or (with --force) an earlier export,
whose listed files are all it holds; a run, a folder holding one anywhere below, the run --ckpt
reads (or a folder inside it or holding it) and a folder holding any other file are refused in one
line, before the checkpoint is read. One export per HF_DIR: it holds the lock of the hidden folder
`.HF_DIR.jaxpar-export` beside HF_DIR, where it stages the files and renames them into place, so
HF_DIR is never half-written and the lock file is never in it.
"""

import contextlib
import errno
import json
import os
import shutil
import sys
from pathlib import Path

from jaxpar.core.errors import UserError
from jaxpar.core.out_lock import LOCK_NAME, RunLock
from jaxpar.core.paths import check_output_dir, output_folder

LOCK_FOLDER = ".{name}.jaxpar-export"  # beside --out: the lock, and the export staged before its rename
RUN_BELOW_LIMIT = 10_000  # folders searched for a run below --out before naming a foreign file instead


def check_out_dir(out: Path, ckpt, force: bool) -> None:
    """A UserError unless export may write `out`: new, empty, or (with `force`) an earlier export
    that holds nothing else, apart from the run `ckpt`."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out '{out}' is a file, not a directory; pass a directory")
    check_output_dir(out)
    check_apart(out, ckpt)
    from jaxpar.formats.hf_files import written_files
    names = {child.name for child in out.iterdir()} if out.is_dir() else set()
    if not names:
        return
    marks = run_files()
    if mark := next((name for name in sorted(names) if name in marks), None):
        raise UserError(f"--out '{out}' holds a training run (its {mark}); jaxpar.export replaces only an "
                        "export it wrote: pass another --out")
    foreign = sorted(names - written_files(out))
    for name in foreign:
        if run := run_below(out / name, marks):
            raise UserError(f"--out '{out}' holds the training run '{run}' below it; jaxpar.export "
                            "replaces only an export it wrote: pass another --out")
    if foreign:
        more = f" (and {len(foreign) - 1} more)" if len(foreign) > 1 else ""
        raise UserError(f"--out '{out}' holds '{foreign[0]}'{more}, which jaxpar.export did not write; move "
                        f"{'them' if more else 'it'} out, or pass an empty or new --out")
    if not force:
        raise UserError(f"--out '{out}' holds an earlier export; pass --force to replace it, or "
                        "another directory")


def check_apart(out: Path, ckpt) -> None:
    """--out is neither the run that --ckpt reads, nor inside it, nor a folder holding it."""
    from jaxpar.training.checkpoints.checkpoint import find_checkpoints
    find_checkpoints(ckpt)  # a run without checkpoints is the first problem to name
    where, source = out.resolve(), Path(ckpt).resolve()
    if where == source:
        raise UserError(f"--out '{out}' is the run that --ckpt reads; pass another --out, apart from the run")
    if where.is_relative_to(source) or source.is_relative_to(where):
        how = "is inside" if where.is_relative_to(source) else "holds"
        raise UserError(f"--out '{out}' {how} '{ckpt}', which --ckpt reads; pass another --out, apart "
                        "from the run")


def run_files() -> set[str]:
    """The names that mark a folder as a jaxpar run's --out."""
    from jaxpar.training.checkpoints.checkpoint import CHECKPOINTS
    from jaxpar.training.run.ends import OUTPUTS
    return {CHECKPOINTS, LOCK_NAME, *OUTPUTS}


def run_below(folder: Path, marks: set[str]) -> Path | None:
    """The first run in `folder` or below it, if any (the search is bounded: None past the limit)."""
    if not folder.is_dir() or folder.is_symlink():
        return None
    for count, (path, folders, files) in enumerate(os.walk(folder)):
        if count >= RUN_BELOW_LIMIT:
            return None
        if marks.intersection(folders) or marks.intersection(files):
            return Path(path)
    return None


def tokenizer_files(tokenizer, block_size: int) -> dict[str, str]:
    """tokenizer.json and tokenizer_config.json for AutoTokenizer; none for tiktoken, which has no
    tokenizer.json here (its GPT-2 encoding is Hugging Face's 'gpt2' tokenizer)."""
    from jaxpar.data.tokenizer import meta_files, tokenizer_json
    text = tokenizer_json(tokenizer)
    if text is None:
        return meta_files(tokenizer)  # its name, checked against the data it meets
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": block_size,
              "clean_up_tokenization_spaces": False}
    if tokenizer.eot_id is not None:
        eot = tokenizer.decode([tokenizer.eot_id])
        config |= {"bos_token": eot, "eos_token": eot, "unk_token": eot}
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}


DTYPES = ("float32", "bfloat16")


def export(ckpt, out, force: bool = False, dtype: str = "float32",
           max_shard_bytes: int | None = None) -> tuple[int, list[str]]:
    """Write the newest checkpoint of the run `ckpt` to `out` as a Hugging Face model, its tensors
    in `dtype`; returns (the checkpoint's step, the model's files written: those its manifest lists)."""
    import ml_dtypes
    import numpy as np

    from jaxpar.formats.hf_files import MAX_SHARD_BYTES
    from jaxpar.inference import sample
    from jaxpar.models.hf import hf_config, hf_state_dict
    # through a symbolic link, which stays: the export replaces the folder it names; the lock's
    # folder beside it has a name LOCK_FOLDER's bytes longer
    out = output_folder(out, spare=len(LOCK_FOLDER.format(name="")))
    check_out_dir(out, ckpt, force)  # before the lock, whose folder beside --out a refusal need not make
    with locked(out) as folder:
        staging, replaced, where = folder / "staging", folder / "replaced", Path(os.path.abspath(out))
        recover(where, staging, replaced)
        check_out_dir(out, ckpt, force)  # again: now no other export can change --out
        model = sample.load(ckpt, "dp=1")  # on one device: the params whole, as the file holds them
        m, vocab = model.cfg.model, model.vocab_size
        array_dtype = np.float32 if dtype == "float32" else ml_dtypes.bfloat16
        tensors = hf_state_dict(model.params, m, vocab, array_dtype)  # refuses before anything is written
        texts = {"config.json": json.dumps(hf_config(m, vocab, model.tokenizer.eot_id, dtype),
                                           indent=2) + "\n"}
        texts |= tokenizer_files(model.tokenizer, m.block_size)
        files = write_staged(tensors, texts, staging, where, replaced, max_shard_bytes or MAX_SHARD_BYTES)
    return model.step, sorted(files)


def write_staged(tensors: dict, texts: dict[str, str], staging: Path, out: Path, replaced: Path,
                 max_shard_bytes: int) -> list[str]:
    """The export's files written in `staging`, then put at `out`; their names. A failure to write
    (a full or read-only disk) is one line, after `undo`: no staged file is left, and `out` is as
    it was."""
    from safetensors import SafetensorError

    from jaxpar.formats.hf_files import save_weights, write_manifest
    try:
        staging.mkdir()
        files = save_weights(tensors, staging, max_shard_bytes) + list(texts)
        for name, text in texts.items():
            (staging / name).write_text(text, encoding="utf-8")
        write_manifest(staging, files)
        replace_dir(staging, out, replaced)
        return files
    except BaseException as error:
        left = undo(out, staging, replaced)
        if isinstance(error, (OSError, SafetensorError)):
            why = reason(error) if isinstance(error, OSError) else str(error).splitlines()[0]
            raise UserError(f"cannot write the export in '{out.parent}' ({why}); --out '{out}' is as it "
                            f"was: free some space or make it writable, or pass another --out{left}") from None
        if left:
            print(f"jaxpar.export: note: {left.removeprefix('; and ')}", file=sys.stderr)
        raise


def undo(out: Path, staging: Path, replaced: Path) -> str:
    """After a failed write: the staged files removed, and an earlier export that was moved aside
    put back at `out`; "" or, for what could not be undone, "; and ..." to add to the message."""
    left = remove_staging(staging)
    if replaced.exists() and not out.exists():
        try:
            replaced.rename(out)
        except OSError as e:
            left += f"; and the earlier export could not go back from '{replaced}' ({reason(e)}): move it"
    return left


def remove_staging(staging: Path) -> str:
    """Remove the staged files, if any: "" or "; and ..." naming what could not be removed."""
    if not staging.exists():
        return ""
    try:
        shutil.rmtree(staging)  # only export writes there, under the lock
    except OSError as e:
        return f"; and '{e.filename or staging}' could not be removed ({reason(e)}): remove '{staging}' by hand"
    return ""


def reason(error: OSError) -> str:
    return os.strerror(error.errno) if error.errno else str(error)


@contextlib.contextmanager
def locked(out: Path):
    """Hold the one lock of exports to `out`, on the hidden folder beside it (yielded, made if
    missing and removed after): the lock file is never in the export, and it stays held while
    the staged export is renamed into place."""
    where = Path(os.path.abspath(out))  # "." and ".." have no name of their own
    folder = where.parent / LOCK_FOLDER.format(name=where.name)
    with contextlib.ExitStack() as held:
        held.callback(remove_if_empty, folder)  # a killed export's folder, which the lock did not make
        try:
            held.enter_context(RunLock(folder))
        except UserError as error:  # its message names the hidden folder: name --out instead
            raise UserError(str(error).replace(f"'{folder}'", f"'{out}'")) from None
        yield folder


def remove_if_empty(folder: Path) -> None:
    """Remove the lock's folder unless it holds something (staged files that could not be removed,
    which the error named); any other failure is said."""
    try:
        folder.rmdir()
    except OSError as e:
        if e.errno not in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            print(f"jaxpar.export: note: cannot remove the folder '{folder}' ({reason(e)}); "
                  "remove it by hand", file=sys.stderr)


def recover(out: Path, staging: Path, replaced: Path) -> None:
    """Undo what a killed export left beside `out`: its staged files go; an earlier export it had
    moved aside goes back to `out` when nothing took its place, or else is removed."""
    if left := remove_staging(staging):
        raise UserError(f"cannot remove what an earlier export staged beside --out '{out}'{left}, then export again")
    if not replaced.exists():
        return
    if not out.exists():
        replaced.rename(out)
    elif not discard_export(replaced):
        raise UserError(f"'{replaced}' holds files that were in --out '{out}' when an earlier export "
                        "replaced it; move them out of it, then export again")


def replace_dir(new: Path, out: Path, replaced: Path) -> None:
    """Put the folder `new` at `out`, where there may be an empty folder or an earlier export:
    that is moved to `replaced`, and of it only the files its manifest lists are removed."""
    if out.exists():
        out.rename(replaced)
    new.rename(out)
    if not replaced.exists():
        return
    try:
        discarded = discard_export(replaced)
    except OSError as e:  # the export is in place: only the earlier one's removal failed
        print(f"jaxpar.export: note: the earlier export, moved to '{replaced}', could not be removed "
              f"({reason(e)}); remove it by hand", file=sys.stderr)
        return
    if not discarded:
        print(f"jaxpar.export: note: files that jaxpar.export did not write appeared in --out '{out}' "
              f"while it exported; they were kept, in '{replaced}'", file=sys.stderr)


def discard_export(folder: Path) -> bool:
    """Remove the files that jaxpar.export wrote in `folder` (its manifest last), and the folder if
    that empties it; whether it did."""
    from jaxpar.formats.hf_files import MANIFEST_FILE, written_files
    for name in sorted(written_files(folder) - {MANIFEST_FILE}) + [MANIFEST_FILE]:
        if (folder / name).is_file():
            (folder / name).unlink()
    try:
        folder.rmdir()
        return True
    except OSError:
        return False
