"""The folders depend one way and no modules import each other in a circle: import-linter's contracts
in pyproject.toml, run on the package, and on a copy with a wrong import to show that they fail."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]


def lint(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run(LINT, cwd=root, env={"PYTHONPATH": str(root), "PATH": ""},
                          capture_output=True, text=True, timeout=120)


def copy_with(tmp_path: Path, module: str, line: str) -> Path:
    """A copy of the package and pyproject.toml, with `line` added to the top of `module`."""
    shutil.copytree(ROOT / "jaxpar", tmp_path / "jaxpar", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    path = tmp_path / module
    path.write_text(line + "\n" + path.read_text())
    return tmp_path


def test_contracts_are_kept():
    proc = lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 kept, 0 broken" in proc.stdout


def test_an_import_up_the_layers_breaks_them(tmp_path):
    proc = lint(copy_with(tmp_path, "jaxpar/core/errors.py", "import jaxpar.training.step.step"))
    assert proc.returncode != 0
    assert "jaxpar.core.errors -> jaxpar.training.step.step" in proc.stdout, proc.stdout


def test_a_circle_between_modules_breaks_them(tmp_path):
    proc = lint(copy_with(tmp_path, "jaxpar/data/corpus.py", "import jaxpar.data.tokenizer"))
    assert proc.returncode != 0
    assert "1 kept, 1 broken" in proc.stdout, proc.stdout
