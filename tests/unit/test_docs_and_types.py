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
def test_package_type_checks() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", "zeroshard"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
