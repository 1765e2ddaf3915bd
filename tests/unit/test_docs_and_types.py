"""The docs follow the code: the configuration reference's key table is the schema's, the architecture
page's layout every module, the README indexes docs/; the package type-checks."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from zeroshard.config import describe_keys
from zeroshard.config.reference import END_MARKER, START_MARKER, reference_table, with_table, written_table

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_the_schema() -> None:
    """docs/CONFIGURATION.md's key table is the one the schema renders, row for row."""
    written = written_table((ROOT / "docs" / "CONFIGURATION.md").read_text())
    expected = reference_table()
    stale = [f"page:   {row}" for row in written.splitlines() if row not in expected.splitlines()]
    missing = [f"schema: {row}" for row in expected.splitlines() if row not in written.splitlines()]
    assert written == expected, (
        "docs/CONFIGURATION.md's key table differs from zeroshard/config/schema.py (edit the field's doc in the "
        "schema, not the table); run `python -m zeroshard.config.reference` to regenerate it. Rows that differ:\n"
        + "\n".join(stale + missing))
    assert len(expected.splitlines()) == 2 + len(describe_keys())
    readme = (ROOT / "README.md").read_text()
    assert "bash run.sh" in readme and "bash test.sh" in readme
    # CI runs the README's command itself, then the nightly sweeps through the same script
    commands = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith("#")]
    assert "bash test.sh" in commands, commands
    assert [c for c in commands if "test.sh" in c] == ["bash test.sh", "ZEROSHARD_NIGHTLY=1 bash test.sh -m nightly"]


def test_configuration_rewrite_keeps_the_rest_of_the_page() -> None:
    """The module rewrites only what lies between its markers, and reads back what it wrote."""
    before, after = f"# Title\n\nProse.\n\n{START_MARKER}\n", f"{END_MARKER}\n\nMore prose.\n"
    rewritten = with_table(f"{before}| stale | row |\n{after}", reference_table())
    assert written_table(rewritten) == reference_table()
    assert rewritten.startswith(before) and rewritten.endswith(after)
    assert with_table(rewritten, reference_table()) == rewritten


@pytest.mark.skipif(shutil.which("mypy") is None and not (Path(sys.executable).parent / "mypy").exists(),
                    reason="mypy is not installed (pip install -e .[test])")
@pytest.mark.slow  # extended: runs in CI (see conftest.py)
def test_package_type_checks() -> None:
    proc = subprocess.run([sys.executable, "-m", "mypy", "zeroshard"], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_architecture_layout_names_every_module() -> None:
    """docs/ARCHITECTURE.md's Layout section names every module and package of zeroshard/, so a newcomer
    finds each one."""
    architecture = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    layout = architecture.split("## Layout", 1)[1].split("```", 2)[1]
    package = ROOT / "zeroshard"
    names = sorted({p.name for p in package.rglob("*.py") if p.name != "__init__.py"})
    names += sorted({f"{p.name}/" for p in package.rglob("*") if p.is_dir() and p.name != "__pycache__"})
    missing = [n for n in names if n not in layout]
    assert not missing, f"docs/ARCHITECTURE.md's Layout does not name {missing}"


def test_readme_is_short_and_indexes_every_doc() -> None:
    """README.md stays a front page (at most 220 lines) whose index links every docs/*.md, each of which exists."""
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 220, f"README.md has {len(readme.splitlines())} lines (at most 220)"
    linked = set(re.findall(r"\]\((docs/[^)#\s]+\.md)(?:#[^)\s]*)?\)", readme))
    absent = sorted(p for p in linked if not (ROOT / p).is_file())
    assert not absent, f"README.md links docs that do not exist: {absent}"
    docs = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    unlinked = sorted(docs - linked)
    assert not unlinked, f"README.md does not link {unlinked}"


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens (code blocks skipped)."""
    prose = re.sub(r"```.*?```", "", markdown, flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+\s+(.*)$", prose, flags=re.M)}


def test_relative_links_in_the_docs_resolve() -> None:
    """Every relative link of README.md and docs/*.md names a file that exists, and a heading it has."""
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked.read_text()):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, f"broken links: {broken}"
