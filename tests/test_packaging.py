"""A regular (non-editable) install: the wheel carries the named configs and the built-in corpus.

The wheel is built from a copy of the sources without build isolation, and installed into a fresh
venv that borrows this environment's dependencies (so no network is needed): jaxpar there comes
from the wheel alone. `--dry-run` runs from a directory with no configs/ in it.
"""

import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["pyproject.toml", "README.md", "jaxpar", "configs"]


def build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "--quiet", "-w", str(tmp_path / "dist"), str(src)], check=True)
    return next((tmp_path / "dist").glob("jaxpar-*.whl"))


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    venv_site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip()
    # This environment's site-packages, for jax and the rest; a path in a .pth file does not run
    # the .pth files inside it, so an editable jaxpar here stays out of the venv.
    (Path(venv_site) / "borrowed.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--quiet",
                    "--target", venv_site, str(wheel)], check=True)
    return python


def test_the_wheel_ships_the_configs_and_a_regular_install_finds_them(tmp_path):
    wheel = build_wheel(tmp_path)
    names = zipfile.ZipFile(wheel).namelist()
    for config in (ROOT / "configs").glob("*.toml"):
        assert f"jaxpar/configs/{config.name}" in names
    assert "jaxpar/assets/tinyshakespeare.txt.gz" in names

    python = fresh_venv(tmp_path, wheel)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # only the venv's jaxpar
    where = subprocess.run([python, "-c", "import jaxpar; print(jaxpar.__file__)"], cwd=elsewhere,
                           env=env, check=True, capture_output=True, text=True).stdout.strip()
    assert where.startswith(str(tmp_path / "venv")), where
    done = subprocess.run([python, "-m", "jaxpar.train", "--config", "shakespeare_char",
                           "--dry-run"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "(6, 384, 1536)" in done.stdout  # shakespeare_char: 6 layers, 384 wide
    assert "compiled train step, per device" in done.stdout
    assert list(elsewhere.iterdir()) == []  # a dry run writes nothing
