"""Design notes stay findable and say why the code is as it is.

A note is a line ``[Note: title]`` on its own in a docstring or comment of ``zeroshard/``, followed by its
text.  A reference is ``[Note: title]`` anywhere else: bare, it means a note of the same file; followed
by ``in path`` (``[Note: gather units] in sharding/stage3/units.py``, the path under ``zeroshard/``, also
written with a leading ``zeroshard/``), a note of that file.  References are read in ``zeroshard/**/*.py``,
``docs/*.md``, ``README.md`` and ``benchmarks/RESULTS.md``, titles and paths wrapped over lines and comment
markers included.  The checks: every reference finds its note; no file defines a title twice; no note's
text tells the project's history (what came first, what was tried or reverted) or how the work was
organised, which belong in git history.  Each failure lists every offender with file:line.
"""

from __future__ import annotations

import io
import re
import tokenize
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zeroshard"

#: a note's title in brackets, wrapped over lines or not
BRACKETS = re.compile(r"\[Note:\s+([^\]]+?)\s*\]")
#: ``in path`` right after a reference (the path may wrap to the next line and sit in backticks)
IN_PATH = re.compile(r"\s+in\s+`?((?:[\w-]+/)*[\w-]+\.py)\b`?")
#: a string literal's prefix and opening quotes
QUOTES = re.compile(r"^[rRbBuUfF]*(\"\"\"|\'\'\'|\"|\')")

#: words of history or of how the work was organised, none of which a note says
HISTORY = [re.compile(p, re.IGNORECASE) for p in (
    r"\bsessions?\b", r"\bpreviously\b", r"\bformerly\b", r"\boriginally\b", r"\bused to\b",
    r"\bas before\b", r"\bas it was before\b", r"\bwe tried\b", r"\btried\b", r"\brevert(?:ed|ing|s)?\b",
    r"\bissues?\s*#", r"\bPR\s*#\d", r"\bpull request\b", r"\bthis commit\b",
    r"\b(?:it|they|this|which|zeroshard) now\b", r"\bthe (?:old|new) (?:code|version|way)\b",
)]


@dataclass(frozen=True)
class Note:
    path: str  #: relative to the repository root
    line: int
    title: str
    #: the note's lines, first (the definition) to last, each with its line number
    text: tuple[tuple[int, str], ...]


@dataclass(frozen=True)
class Reference:
    path: str
    line: int
    title: str
    target: Optional[str]  #: the file it names, as written; None for a bare reference


def _title(raw: str) -> str:
    return " ".join(raw.split())


def _python_prose(source: str) -> tuple[list[str], list[object]]:
    """Each line's prose (the text of its comment and of the strings on it, without markers or quotes) and
    the block it belongs to: one string literal (a docstring) or a run of whole-line comments."""
    lines = source.splitlines()
    prose: list[str] = [""] * len(lines)
    block: list[object] = [None] * len(lines)
    for n, tok in enumerate(tokenize.generate_tokens(io.StringIO(source).readline)):
        row = tok.start[0] - 1
        if tok.type == tokenize.COMMENT:
            prose[row] = f"{prose[row]} {re.sub(r'^#:?', '', tok.string).strip()}".strip()
            block[row] = "comment" if lines[row].lstrip().startswith("#") else None
        elif tok.type == tokenize.STRING:
            quotes = QUOTES.match(tok.string)
            assert quotes is not None, tok
            inner = tok.string[quotes.end():len(tok.string) - len(quotes.group(1))]
            for k, part in enumerate(inner.split("\n")):
                prose[row + k] = f"{prose[row + k]} {part.strip()}".strip()
                block[row + k] = n
    return prose, block


def parse(path: str, source: str) -> tuple[list[Note], list[Reference]]:
    """Every note defined in ``source`` (the text of the file at ``path``) and every reference it makes."""
    prose: list[str]
    block: list[object]
    if path.endswith(".py"):
        prose, block = _python_prose(source)
    else:
        prose = [line.strip() for line in source.splitlines()]
        block = [path] * len(prose)
    defined = {i: _title(m.group(1)) for i, line in enumerate(prose) if (m := BRACKETS.fullmatch(line))}
    notes = []
    for i, title in defined.items():
        j = i + 1
        while j < len(prose) and j not in defined and block[j] is not None and block[j] == block[i]:
            j += 1
        notes.append(Note(path, i + 1, title, tuple((k + 1, prose[k]) for k in range(i, j))))
    joined = "\n".join(prose)
    starts = {sum(len(p) + 1 for p in prose[:i]) for i in defined}
    references = []
    for m in BRACKETS.finditer(joined):
        if m.start() in starts or joined[m.start() - 1:m.start()] == "`":
            continue  # a definition, or a reference written as code: an example of the syntax
        target = IN_PATH.match(joined, m.end())
        references.append(Reference(path, joined.count("\n", 0, m.start()) + 1, _title(m.group(1)),
                                    target.group(1) if target else None))
    return notes, references


def _sources() -> dict[str, str]:
    files = sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "docs").glob("*.md"))
    files += [ROOT / "README.md", ROOT / "benchmarks" / "RESULTS.md"]
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in files if p.is_file()}


def check(sources: dict[str, str]) -> tuple[list[str], list[str], list[str]]:
    """The broken references, the titles defined twice in one file, and the notes that tell history."""
    notes: dict[str, list[Note]] = {}
    references: list[Reference] = []
    for path, source in sources.items():
        n, r = parse(path, source)
        notes[path] = n
        references += r
    titles = {path: {n.title for n in ns} for path, ns in notes.items()}

    def homes(title: str) -> list[str]:
        return sorted(path.removeprefix("zeroshard/") for path, ts in titles.items() if title in ts)

    broken = []
    for ref in references:
        where, elsewhere = f"{ref.path}:{ref.line}: [Note: {ref.title}]", homes(ref.title)
        hint = f"; it is in {', '.join(elsewhere)}" if elsewhere else "; no file defines it"
        if ref.target is None:
            if ref.title not in titles.get(ref.path, set()):
                broken.append(f"{where} names no file and this file has no such note{hint}")
            continue
        target = f"zeroshard/{ref.target.removeprefix('zeroshard/')}"
        if target not in sources:
            broken.append(f"{where} in {ref.target}: no file {target} (paths are written under zeroshard/){hint}")
        elif ref.title not in titles[target]:
            broken.append(f"{where} in {ref.target}: that file has no such note{hint}")

    doubled = [f"{path}:{n.line}: [Note: {n.title}] is defined twice in this file"
               for path, ns in notes.items() for title, count in Counter(n.title for n in ns).items()
               if count > 1 for n in ns if n.title == title]

    history = []
    for note in (note for ns in notes.values() for note in ns):
        for line, text in note.text:
            words = [m.group(0) for pattern in HISTORY for m in pattern.finditer(text)]
            if words:
                history.append(f"{note.path}:{line}: [Note: {note.title}] says {', '.join(map(repr, words))}: "
                               f"{text.strip()}")
    return broken, doubled, history


def test_the_parser_reads_notes_and_references() -> None:
    """Definitions in docstrings and comments, references wrapped over lines, paths in backticks."""
    source = "\n".join([
        '"""[Note: first note]',
        "The first note's text.",
        '"""',
        "# [Note: second note]",
        "# Its text, then code.",
        "x = 1  # see [Note: first",
        "y = 2  # note] and [Note: third] in",
        "# `sharding/stage3/units.py`.",
        "",
    ])
    notes, references = parse("zeroshard/example.py", source)
    assert [(n.line, n.title) for n in notes] == [(1, "first note"), (4, "second note")]
    assert [line for line, _ in notes[0].text] == [1, 2, 3] and [line for line, _ in notes[1].text] == [4, 5]
    assert [(r.line, r.title, r.target) for r in references] == [
        (6, "first note", None), (7, "third", "sharding/stage3/units.py")]


def test_the_checks_find_every_kind_of_offender() -> None:
    broken, doubled, history = check({
        "zeroshard/a.py": '"""[Note: here]\nWe tried another way first.\n"""\n# [Note: here]\n# Text.\n',
        "zeroshard/b.py": "# see [Note: here] and [Note: here] in a.py and [Note: gone] in zeroshard/a.py\n",
        "docs/X.md": "[Note: here] in `a.py`, [Note: here] in `b.py`\n",
    })
    assert broken == [
        "zeroshard/b.py:1: [Note: here] names no file and this file has no such note; it is in a.py",
        "zeroshard/b.py:1: [Note: gone] in zeroshard/a.py: that file has no such note; no file defines it",
        "docs/X.md:1: [Note: here] in b.py: that file has no such note; it is in a.py"]
    assert doubled == ["zeroshard/a.py:1: [Note: here] is defined twice in this file",
                       "zeroshard/a.py:4: [Note: here] is defined twice in this file"]
    assert history == ["zeroshard/a.py:2: [Note: here] says 'We tried', 'tried': We tried another way first."]


def test_every_reference_finds_its_note() -> None:
    broken, _, _ = check(_sources())
    assert not broken, "references that find no note:\n" + "\n".join(broken)


def test_no_file_defines_a_title_twice() -> None:
    _, doubled, _ = check(_sources())
    assert not doubled, "titles defined twice:\n" + "\n".join(doubled)


def test_notes_say_why_not_what_happened() -> None:
    """A note explains the code as it is; history and measurements' provenance live in git and
    benchmarks/RESULTS.md."""
    _, _, history = check(_sources())
    assert not history, "notes that tell history:\n" + "\n".join(history)


#: a citation of benchmarks/RESULTS.md: ``section "X"``, then maybe ``paragraph "Y"`` or ``subsection "Y"``
RESULTS_CITATION = re.compile(r'RESULTS\.md,? section "([^"]+)"(?:, (paragraph|subsection) "([^"]+)")?')


def results_citations(path: str, source: str) -> list[tuple[str, str, Optional[str], Optional[str]]]:
    """(path, section, paragraph or subsection kind, its title) of each citation in ``source``, read
    across wrapped lines, comment markers, backticks and adjacent string literals."""
    text = source.replace("`", "")
    text = re.sub(r'"\s*\n\s*"', "", text)  # "...", newline, "..." joined as Python joins them
    text = re.sub(r"\s*\n\s*(?:#\s*)?", " ", text).replace('\\"', '"')
    return [(path, m.group(1), m.group(2), m.group(3)) for m in RESULTS_CITATION.finditer(text)]


def test_every_citation_of_results_finds_its_section_and_paragraph() -> None:
    """A note keeps the why and cites the figures by section (and paragraph) of benchmarks/RESULTS.md:
    each cited heading starts with the section's title, and a cited paragraph opens in bold in it."""
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    sections = re.split(r"^(?=## )", results, flags=re.MULTILINE)  # each with its ### subsections
    citations = [c for path, source in _sources().items() if path.startswith("zeroshard/")
                 for c in results_citations(path, source)]
    assert len(citations) >= 10  # the notes do cite it
    broken = []
    for path, section, kind, title in citations:
        found = [s for s in sections if re.search(rf"^#{{2,3}} {re.escape(section)}", s, flags=re.MULTILINE)]
        if not found:
            broken.append(f'{path}: section "{section}": no heading of benchmarks/RESULTS.md starts so')
        elif title is not None and not any((f"**{title}" if kind == "paragraph" else f"### {title}") in s
                                           for s in found):
            broken.append(f'{path}: section "{section}" has no {kind} "{title}"')
    assert not broken, "citations of benchmarks/RESULTS.md that find nothing:\n" + "\n".join(broken)
