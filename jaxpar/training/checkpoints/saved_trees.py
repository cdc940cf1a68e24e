"""A saved tree of arrays against the tree a run expects: where they first differ, in words.

Orbax's metadata describes a saved tree with dicts, lists and None for empty nodes; the run's
abstract trees are optax's named tuples, tuples and dicts. Both are brought to one plain form
(a named tuple as the dict of its fields, a tuple as a list, an empty node as None, an array as
its shape and dtype) and compared.
"""


def plain(tree):
    """`tree` as nested dicts, lists, None and (shape, dtype) leaves."""
    if tree is None:
        return None
    if hasattr(tree, "shape") and hasattr(tree, "dtype"):
        return tuple(tree.shape), str(tree.dtype)
    if hasattr(tree, "_fields"):  # a named tuple: orbax keeps its fields by name
        tree = {name: getattr(tree, name) for name in tree._fields}
    if isinstance(tree, dict):
        return {str(k): plain(v) for k, v in tree.items()} or None
    if isinstance(tree, (list, tuple)):
        return [plain(v) for v in tree] or None
    raise TypeError(f"unexpected node {type(tree).__name__} in a tree of arrays")


def _describe(node) -> str:
    if node is None:
        return "nothing"
    if isinstance(node, tuple):
        return f"{node[1]}{list(node[0])}"
    kind = "entries " + ", ".join(map(str, node)) if isinstance(node, dict) else f"{len(node)} entries"
    return kind if len(kind) < 80 else kind[:77] + "..."


def _walk(saved, wanted, path: str) -> str | None:
    if isinstance(saved, dict) and isinstance(wanted, dict) and saved.keys() == wanted.keys():
        return next(filter(None, (_walk(saved[k], wanted[k], f"{path}/{k}") for k in saved)), None)
    if isinstance(saved, list) and isinstance(wanted, list) and len(saved) == len(wanted):
        return next(filter(None, (_walk(s, w, f"{path}/{i}") for i, (s, w) in
                                  enumerate(zip(saved, wanted)))), None)
    if saved == wanted:
        return None
    return f"at {path or '/'}: saved {_describe(saved)}, this run {_describe(wanted)}"


def first_difference(saved, wanted) -> str | None:
    """None when the saved tree has the wanted tree's structure, shapes and dtypes; else where
    they first differ, e.g. "at /0/v_row/wte: saved float32[128], this run float32[1]"."""
    return _walk(plain(saved), plain(wanted), "")
