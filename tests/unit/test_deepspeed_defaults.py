"""zeroshard's config defaults beside DeepSpeed's, as DeepSpeed computes them (tests/fixtures/deepspeed/
read_defaults.py wrote ``defaults_<version>.json`` from real DeepSpeed): every key both know agrees with the
release zeroshard reports, or is listed with its reason in config/kept_defaults.py; every default a later
release moved is announced (``MOVED_DEFAULTS``) or listed as quiet.

``python tests/unit/test_deepspeed_defaults.py`` rewrites the table in docs/DEEPSPEED_AND_HUGGING_FACE.md.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from zeroshard.config.kept_defaults import DIFFERENT_DEFAULTS, MOVED_DEFAULTS, QUIET_MOVES
from zeroshard.config.schema import ZeroshardConfig
from zeroshard.deepspeed.install import DEEPSPEED_VERSION

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "deepspeed"
DOC = ROOT / "docs" / "DEEPSPEED_AND_HUGGING_FACE.md"
BEGIN, END = "<!-- deepspeed-defaults:begin -->", "<!-- deepspeed-defaults:end -->"
LATER = "0.19.8"  # the newest release read, for defaults moved after the reported one


def deepspeed_defaults(version: str) -> dict[str, Any]:
    path = FIXTURES / f"defaults_{version}.json"
    assert path.exists(), f"no {path.name}: run tests/fixtures/deepspeed/read_defaults.py with DeepSpeed {version}"
    data = json.loads(path.read_text())
    assert data["deepspeed_version"] == version
    return data["defaults"]


def zeroshard_defaults() -> dict[str, Any]:
    found: dict[str, Any] = {}

    def walk(block: Any, prefix: str) -> None:
        for field in dataclasses.fields(block):
            value, path = getattr(block, field.name), f"{prefix}{field.name}"
            if dataclasses.is_dataclass(value):
                walk(value, path + ".")
            else:
                found[path] = value
    walk(ZeroshardConfig(), "")
    return found


def normal(value: Any) -> Any:
    """One spelling per value: numbers by value (5e8 == 500000000), text in any case ("Warn" == "WARN")."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        return value.casefold()
    if isinstance(value, (list, tuple)):
        return [normal(v) for v in value]
    return value


def side_by_side() -> list[tuple[str, Any, Any, str]]:
    """(key, zeroshard's default, DeepSpeed's, "" when they agree or the listed reason) for each key both know."""
    ours, theirs = zeroshard_defaults(), deepspeed_defaults(DEEPSPEED_VERSION)
    return [(path, ours[path], theirs[path], "" if normal(ours[path]) == normal(theirs[path]) else
             DIFFERENT_DEFAULTS.get(path, "NOT LISTED")) for path in sorted(ours.keys() & theirs.keys())]


def test_every_shared_default_agrees_or_differs_for_a_listed_reason():
    rows = side_by_side()
    unlisted = [f"{path}: zeroshard {ours!r}, DeepSpeed {theirs!r}" for path, ours, theirs, why in rows
                if why == "NOT LISTED"]
    assert not unlisted, f"defaults that differ from DeepSpeed {DEEPSPEED_VERSION}'s: {unlisted}"
    differing = {path for path, _, _, why in rows if why}
    assert set(DIFFERENT_DEFAULTS) == differing, \
        f"listed but agreeing or unknown to DeepSpeed: {sorted(set(DIFFERENT_DEFAULTS) - differing)}"
    assert len(rows) >= 70  # the fixture and the schema still meet


def test_defaults_a_later_release_moved_are_announced_or_listed():
    ours, reported, later = zeroshard_defaults(), deepspeed_defaults(DEEPSPEED_VERSION), deepspeed_defaults(LATER)
    moved = {path: later[path] for path in ours.keys() & reported.keys() & later.keys()
             if normal(reported[path]) != normal(later[path]) and normal(ours[path]) == normal(reported[path])}
    assert "gradient_clipping" in moved
    announced = {path: moved[path] for path in moved if path not in QUIET_MOVES}
    assert set(announced) == set(MOVED_DEFAULTS) and set(QUIET_MOVES) <= set(moved)
    for path, value in announced.items():
        assert normal(MOVED_DEFAULTS[path].later) == normal(value), path
        assert normal(MOVED_DEFAULTS[path].kept) == normal(ours[path]), path


def shown(value: Any) -> str:
    if isinstance(value, list) and len(value) > 2:
        return f"{len(value)} names"
    return f"`{json.dumps(value)}`"


def table() -> str:
    rows = side_by_side()
    differing = sum(1 for row in rows if row[3])
    lines = [f"{len(rows)} keys compared with DeepSpeed {DEEPSPEED_VERSION} (read from DeepSpeed itself by "
             f"tests/fixtures/deepspeed/read_defaults.py): {len(rows) - differing} agree, {differing} differ on "
             "purpose.", "", "| key | zeroshard | DeepSpeed | differs because |", "|---|---|---|---|"]
    lines += [f"| `{path}` | {shown(ours)} | {shown(theirs)} | {why} |" for path, ours, theirs, why in rows]
    return "\n".join(lines)


def documented() -> str:
    text = DOC.read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip()


def test_the_documented_table_is_the_compared_one():
    assert documented() == table(), f"run python {Path(__file__).relative_to(ROOT)} to rewrite it"


if __name__ == "__main__":
    text = DOC.read_text()
    DOC.write_text(f"{text[:text.index(BEGIN) + len(BEGIN)]}\n{table()}\n{text[text.index(END):]}")
    sys.exit(0)
