"""The cache of tuned kernel configurations: one JSON file, `kernel_tuning.json` in
train.kernel_cache's folder (empty: the user's cache folder, $XDG_CACHE_HOME/jaxpar or
~/.cache/jaxpar), and `tune`, which looks each request up in it or tunes it and stores it at once.

Each entry is keyed by the device kind, the kernel, the leg (forward, dlhs, drhs), the shapes and
the dtypes, and holds the chosen config and what finding it cost. A lookup that misses calls a
tuner, stores what it found (a temporary file renamed over the cache: a reader never sees half of
it) and says in one line what it tuned and what that cost, or that it reused N entries and tuned
nothing. A file that does not parse, or that another jaxpar version or cache format wrote, is
ignored with one line and rewritten; so is an entry that cannot be used (its kind's `problem`
says why). Where the cache's path holds what jaxpar did not write (a folder in place of the file,
a file in place of the folder), that is said and left as it is, and nothing is kept.
"""

import json
import math
import os
import tempfile
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path


def installed_version() -> str:
    """jaxpar's installed version (the package's metadata: nn may not import jaxpar's top)."""
    try:
        return metadata.version("jaxpar")
    except metadata.PackageNotFoundError:
        return "unknown"


VERSION = installed_version()

FORMAT = 1  # the cache file's layout; a file of another is rewritten
CACHE_FILE = "kernel_tuning.json"


def cache_folder(folder: str = "") -> Path:
    """`folder`, or the user's cache folder's jaxpar/."""
    if folder:
        return Path(folder)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jaxpar"


def device_kind(device) -> str:
    """A device's kind as tokamax names its data folders: 'NVIDIA H100 80GB HBM3' -> nvidia_h100_80gb_hbm3."""
    return "_".join(device.device_kind.lower().replace("-", " ").split())


@dataclass(frozen=True)
class Request:
    """One thing to tune: a kernel's leg at the step's shapes and dtypes."""
    kernel: str
    leg: str
    shapes: tuple  # e.g. ((rows, K), (G, K, N))
    dtypes: tuple  # e.g. ("bfloat16", "bfloat16")

    def key(self, device: str) -> str:
        shapes = ",".join("x".join(map(str, s)) for s in self.shapes)
        return f"{device}|{self.kernel}|{self.leg}|{shapes}|{','.join(self.dtypes)}"


class TuningCache:
    """The cache file's entries, read once; `note`: the one line of what was wrong with the file
    or its entries, if anything. `keeps`: whether what is tuned is written back, which it is not
    where the path holds what jaxpar did not write (a folder in place of the file, a file in place
    of the folder): that is left as it is."""

    def __init__(self, folder: str = ""):
        self.path = cache_folder(folder) / CACHE_FILE
        self.entries, self.problems, self.keeps = read(self.path)

    @property
    def note(self) -> str | None:
        return "; ".join(self.problems) or None

    def save(self) -> None:
        """Written whole to a temporary file beside it, then renamed over it; where it cannot be
        written, that is said in the note, and tuning goes on without keeping it."""
        if not self.keeps:
            return
        body, temporary = {"jaxpar": VERSION, "format": FORMAT, "entries": self.entries}, None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(dir=self.path.parent, prefix=CACHE_FILE + ".", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(body, f, indent=1, sort_keys=True)
            os.replace(temporary, self.path)
        except BaseException as error:
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)  # its own file; a failure to remove it is raised
            if not isinstance(error, OSError):
                raise
            self.keeps = False
            self.problems.append(f"kernel tuning: {self.path} cannot be written ({error.strerror or error}); "
                                 "what is tuned now is not kept")


def misplaced(path: Path) -> str | None:
    """Why the cache file at `path` is off limits, or None: its folder, or one above, is a file;
    or the cache file is not a file."""
    existing = next(folder for folder in (path.parent, *path.parent.parents) if folder.exists())
    left = "it is left as it is, and what is tuned now is not kept: set train.kernel_cache to another folder"
    if not existing.is_dir():
        return f"kernel tuning: {existing} is a file where the cache's folder {path.parent} should be; {left}"
    if path.exists() and not path.is_file():
        what = "a folder" if path.is_dir() else "not a file"
        return f"kernel tuning: {path} is {what}, not the file jaxpar writes; {left}"
    return None


def read(path: Path) -> tuple[dict, list[str], bool]:
    """(the entries of the cache file at `path`, the lines why it was ignored, whether it may be
    written)."""
    if why := misplaced(path):
        return {}, [why], False
    if not path.exists():
        return {}, [], True
    try:
        body = json.loads(path.read_text())
        entries = body["entries"]
        if not isinstance(entries, dict):
            raise TypeError("entries is not a table")
    except (OSError, ValueError, KeyError, TypeError) as error:
        why = f"kernel tuning: ignored {path}, which does not parse ({type(error).__name__}); it is rewritten"
        return {}, [why], True
    if body.get("jaxpar") != VERSION or body.get("format") != FORMAT:
        return {}, [(f"kernel tuning: ignored {path}, written by jaxpar {body.get('jaxpar')} (format "
                     f"{body.get('format')}), not {VERSION} ({FORMAT}); it is rewritten")], True
    return entries, [], True


def entry_problem(entry, problem) -> str | None:
    """Why a cache entry ({"config": ..., "cost_s": seconds}) cannot be used, or None; `problem`:
    its config's, by the kind of config."""
    if not isinstance(entry, dict) or "config" not in entry:
        return "no config"
    if not seconds_number(entry.get("cost_s")):
        return f"cost_s {entry.get('cost_s')!r} is not a number of seconds"
    return problem(entry["config"])


def tune(cache: TuningCache, device: str, requests, tuner, problem=lambda config: None) -> tuple[dict, str]:
    """Each request's config from the cache, or from tuner(request) -> (config, seconds it cost),
    stored as soon as it is found (a run stopped while tuning keeps what it tuned); returns
    ({request: config}, the one line of what was tuned and what it cost, after the cache's note). A
    cached entry that cannot be used (entry_problem) is dropped, said, and tuned again."""
    bad = {key: why for key in dict.fromkeys(r.key(device) for r in requests)
           if key in cache.entries and (why := entry_problem(cache.entries[key], problem))}
    for key in bad:
        del cache.entries[key]
    if bad:
        key, why = next(iter(bad.items()))
        entries = "an entry" if len(bad) == 1 else f"{len(bad)} entries"
        cache.problems.append(f"kernel tuning: {cache.path}: dropped {entries} that cannot be used ('{key}': {why}), "
                              "tuned again")
    configs, tuned, cost = {}, [], 0.0
    for request in requests:
        key = request.key(device)
        if key not in cache.entries:
            config, seconds = tuner(request)
            cache.entries[key] = {"config": config, "cost_s": round(seconds, 6)}
            cache.save()
            tuned.append(f"{request.kernel} {request.leg} {'/'.join('x'.join(map(str, s)) for s in request.shapes)}")
            cost += seconds
        configs[request] = cache.entries[key]["config"]
    if tuned:
        line = (f"kernel tuning on {device}: tuned {len(tuned)} ({'; '.join(tuned)}) in {cost:.2f} s, reused "
                f"{len(configs) - len(tuned)}; " + (f"kept in {cache.path}" if cache.keeps else "not kept"))
    else:
        line = f"kernel tuning on {device}: reused {len(configs)} entries from {cache.path}, tuned nothing"
    note, cache.problems = cache.note, []  # said once, in this line
    return configs, line if note is None else f"{note}; {line}"


def seconds_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
