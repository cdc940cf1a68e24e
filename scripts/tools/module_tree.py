"""Print jaxpar/ as a tree: each folder and file with its line count and the first line of its
docstring (the tree in docs/design.md is this script's output)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "jaxpar"


def summary(path: Path) -> str:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.split("\n\n")[0].replace("\n", " ")
    return first if len(first) <= 70 else first[:67].rsplit(" ", 1)[0] + " ..."


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def folder_rows(folder: Path, depth: int) -> None:
    """A folder (its files and its subfolders' lines together), its files, then its subfolders."""
    pad = "  " * depth
    files = sorted(folder.glob("*.py"))
    subfolders = sorted(p for p in folder.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    total = sum(lines(p) for p in folder.rglob("*.py"))
    print(f"{pad}{folder.name + '/':<{24 - len(pad)}}{total:>5}  {summary(folder / '__init__.py')}")
    for path in files:
        if path.name != "__init__.py":
            print(f"{pad}  {path.name:<{22 - len(pad)}}{lines(path):>5}  {summary(path)}")
    for sub in subfolders:
        folder_rows(sub, depth + 1)


def main() -> None:
    print(f"jaxpar/  ({sum(lines(p) for p in ROOT.rglob('*.py'))} lines)")
    for path in sorted(ROOT.glob("*.py")):
        print(f"  {path.name:<22}{lines(path):>5}  {summary(path)}")
    for folder in sorted(p for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()):
        folder_rows(folder, 1)


if __name__ == "__main__":
    main()
