"""tiktoken's encodings, from its cache only: never a download, which here would hang or fail.

tiktoken downloads an encoding's files at first use and keeps them in its cache directory
($TIKTOKEN_CACHE_DIR, else $DATA_GYM_CACHE_DIR, else <tmp>/data-gym-cache), each named by the
SHA-1 of its URL. Loading runs with tiktoken's downloader replaced by one that raises, so a
missing file is a one-line UserError naming it, whatever the encoding.
"""

import hashlib
import os
import tempfile

from jaxpar.core.errors import UserError


class _NotCached(Exception):
    def __init__(self, url: str):
        super().__init__(url)
        self.url = url


def cache_dir() -> str:
    """tiktoken's cache directory, found as tiktoken/load.py finds it ("" turns caching off)."""
    for name in ("TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        if name in os.environ:
            return os.environ[name]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


def cache_path(url: str) -> str:
    return os.path.join(cache_dir(), hashlib.sha1(url.encode()).hexdigest())


def load_encoding(name: str):
    """tiktoken.get_encoding(name) when its files are cached; a UserError otherwise."""
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise UserError(f"--tokenizer tiktoken:{name} needs tiktoken: pip install tiktoken "
                        "(or jaxpar[tiktoken])") from None
    known = tiktoken.list_encoding_names()
    if name not in known:
        raise UserError(f"tiktoken has no encoding '{name}'; use one of {', '.join(known)}")
    download = tiktoken.load.read_file

    def from_disk_only(blobpath: str) -> bytes:
        if "://" in blobpath:  # read_file_cached calls this only when the cache lacks the file
            raise _NotCached(blobpath)
        return download(blobpath)

    tiktoken.load.read_file = from_disk_only
    try:
        return tiktoken.get_encoding(name)
    except _NotCached as e:
        raise UserError(not_cached_message(name, e.url)) from None
    finally:
        tiktoken.load.read_file = download


def not_cached_message(name: str, url: str) -> str:
    where = (f"not in tiktoken's cache ({cache_path(url)})" if cache_dir()
             else "not cached (TIKTOKEN_CACHE_DIR is empty, which turns tiktoken's cache off)")
    return (f"tiktoken:{name} needs {url}, which is {where}, and jaxpar does not download; run "
            f"python -c \"import tiktoken; tiktoken.get_encoding('{name}')\" on a machine with "
            "network, copy its cache directory (TIKTOKEN_CACHE_DIR, default /tmp/data-gym-cache) "
            "here and set TIKTOKEN_CACHE_DIR to it, or use --tokenizer PATH/tokenizer.json or "
            "--tokenizer bpe instead")
