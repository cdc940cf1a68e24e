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


def main() -> None:
    print(f"jaxpar/  ({sum(lines(p) for p in ROOT.rglob('*.py'))} lines)")
    top = sorted(p for p in ROOT.glob("*.py"))
    folders = sorted(p for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file())
    for path in top:
        print(f"  {path.name:<22}{lines(path):>5}  {summary(path)}")
    for folder in folders:
        files = sorted(folder.glob("*.py"))
        print(f"  {folder.name + '/':<22}{sum(lines(p) for p in files):>5}  {summary(folder / '__init__.py')}")
        for path in files:
            if path.name != "__init__.py":
                print(f"    {path.name:<20}{lines(path):>5}  {summary(path)}")


if __name__ == "__main__":
    main()
