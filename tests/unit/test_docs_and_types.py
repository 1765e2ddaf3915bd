"""The README documents every supported key; the package type-checks."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.config import describe_keys

ROOT = Path(__file__).resolve().parents[2]


def test_readme_lists_every_supported_key() -> None:
    readme = (ROOT / "README.md").read_text()
    missing = [k for k, _, _ in describe_keys() if f"`{k}`" not in readme]
    assert not missing, f"README.md does not document {missing}"
    assert "bash run.sh" in readme and "bash test.sh" in readme
    assert (ROOT / ".ci" / "run").read_text().strip().endswith("bash test.sh")


@pytest.mark.skipif(shutil.which("mypy") is None and not (Path(sys.executable).parent / "mypy").exists(),
                    reason="mypy is not installed (pip install -e .[test])")
@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_package_type_checks() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", "zeroshard"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_readme_layout_names_every_module() -> None:
    """The Layout section names every module and package of zeroshard/, so a newcomer finds each one."""
    readme = (ROOT / "README.md").read_text()
    layout = readme.split("## Layout", 1)[1].split("```", 2)[1]
    package = ROOT / "zeroshard"
    names = [p.name for p in package.iterdir() if p.suffix == ".py" and p.name != "__init__.py"]
    names += [f"{p.name}/" for p in package.iterdir() if p.is_dir() and p.name != "__pycache__"]
    for sub in ("checkpoint", "offload", "optim", "sharding"):
        names += [p.name for p in (package / sub).glob("*.py") if p.name != "__init__.py"]
    missing = [n for n in names if n not in layout]
    assert not missing, f"README.md's Layout does not name {missing}"
    assert (ROOT / "docs" / "ARCHITECTURE.md").exists()
