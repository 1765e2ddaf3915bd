"""docs/CONFIGURATION.md's key table, rendered from the typed schema so that the page cannot drift from it.

:func:`reference_table` renders one Markdown row per supported key (key, default, meaning), in the schema's
field order, from each field's ``doc`` and default (:func:`zeroshard.config.loader.documented_keys`).
``python -m zeroshard.config.reference [path]`` rewrites the table between the two marker comments of the
page (docs/CONFIGURATION.md by default, from the repository root) and leaves the rest of it as it is.

A default shows as the field's ``default_text`` where it has one, else as its value: ``none`` for null,
JSON's ``true`` / ``false``, strings as written (``""`` when empty), and whole numbers of at least
:data:`SCIENTIFIC_FROM` that are one digit times a power of ten in ``e`` notation (``5e8``, ``1e5``), as
DeepSpeed's documentation writes them; other numbers as integers when whole (``1800``, ``0``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Sequence

from .loader import DocumentedKey, documented_keys

#: the line above the generated table
START_MARKER = "<!-- keys: generated from zeroshard/config/schema.py by python -m zeroshard.config.reference -->"
#: the line below it
END_MARKER = "<!-- end of generated keys -->"
#: the page the module rewrites when given no path (relative to the repository root)
DEFAULT_PAGE = Path("docs") / "CONFIGURATION.md"
#: whole numbers from this size on print as ``5e8`` when they are one digit times a power of ten
SCIENTIFIC_FROM = 10_000

HEADER = ("| key | default | meaning |", "| --- | --- | --- |")


def reference_table() -> str:
    """The key table: its header and one row per supported key, each line ending in a newline."""
    return "".join(f"{line}\n" for line in (*HEADER, *(table_row(k) for k in documented_keys())))


def table_row(key: DocumentedKey) -> str:
    """One key's row: the key as code, how its default reads, and its meaning."""
    default = key.default_text if key.default_text is not None else default_text(key.default)
    cells = (f"`{key.key}`", default, key.doc)
    return "| " + " | ".join(table_cell(cell) for cell in cells) + " |"


def table_cell(text: str) -> str:
    """``text`` on one line, with the ``|`` that would end the cell escaped."""
    return " ".join(text.split()).replace("|", "\\|")


def default_text(value: Any) -> str:
    """How a default value reads in the table (see the module's docstring)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, (int, float)):
        return f"`{number_text(value)}`"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{json.dumps(value)}`"


def number_text(value: int | float) -> str:
    """``5e8`` for 500000000, ``1800`` for 1800.0, ``0.5`` for 0.5."""
    if not float(value).is_integer():
        return repr(value)
    whole = int(value)
    digit, exponent = abs(whole), 0
    while digit >= 10 and digit % 10 == 0:
        digit, exponent = digit // 10, exponent + 1
    if abs(whole) >= SCIENTIFIC_FROM and digit < 10:
        return f"{'-' if whole < 0 else ''}{digit}e{exponent}"
    return str(whole)


def written_table(page: str) -> str:
    """The table ``page`` holds between the markers (without the blank lines around it)."""
    _, table, _ = split_page(page)
    return table.strip("\n") + "\n"


def with_table(page: str, table: str) -> str:
    """``page`` with ``table`` between the markers, set off by blank lines; the rest as it was."""
    before, _, after = split_page(page)
    return f"{before}\n{table}\n{after}"


def split_page(page: str) -> tuple[str, str, str]:
    """``page`` up to the start marker's line included, what lies between the markers, and the rest."""
    start, end = page.find(START_MARKER), page.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"the page has no key table between the lines {START_MARKER!r} and {END_MARKER!r}; "
                         "add them where the table goes")
    body = page.index("\n", start) + 1
    return page[:body], page[body:end], page[end:]


def rewrite(path: Path) -> bool:
    """Bring the key table of the page at ``path`` up to date; whether it changed."""
    page = path.read_text()
    table = reference_table()
    if written_table(page) == table:
        return False
    path.write_text(with_table(page, table))
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m zeroshard.config.reference",
                                     description="Rewrite the configuration reference's key table from the schema.")
    parser.add_argument("path", nargs="?", type=Path, default=DEFAULT_PAGE,
                        help=f"the page to rewrite (default: {DEFAULT_PAGE}, from the repository root)")
    path = parser.parse_args(argv).path
    if not path.is_file():
        parser.error(f"{path} does not exist; run from the repository root or give the page's path")
    try:
        changed = rewrite(path)
    except ValueError as err:
        parser.error(f"{path}: {err}")
    rows = len(documented_keys())
    print(f"{path}: {'rewrote' if changed else 'already up to date:'} the key table ({rows} keys)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
