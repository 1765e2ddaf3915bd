"""How a config key is declared: a dataclass field carrying its documentation and its value check, and
the checks the schema's fields share (:mod:`zeroshard.config.schema` declares every key with them)."""

from __future__ import annotations

from dataclasses import field
from typing import Any, Callable, Optional

__all__ = ["Check", "key", "non_negative", "optional_positive", "positive", "strings"]

Check = Callable[[Any], Optional[str]]


def key(default: Any, doc: str, check: Check | None = None, infinite_ok: bool = False,
        default_text: str | None = None) -> Any:
    """Declare a config field with its documentation and an optional value check.

    ``check`` returns ``None`` when the value is fine, or a phrase saying what is allowed; numbers must
    be finite unless ``infinite_ok``.  ``default_text`` (Markdown) is how the configuration reference
    shows the default when the value alone would mislead a reader; without it the value is shown.
    """
    meta = {"doc": doc, "check": check, "infinite_ok": infinite_ok, "default_text": default_text}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def positive(value: Any) -> str | None:
    return None if value > 0 else "a number > 0"


def non_negative(value: Any) -> str | None:
    return None if value >= 0 else "a number >= 0"


def optional_positive(value: Any) -> str | None:
    return None if value is None or value > 0 else "a number > 0 (or omit the key)"


def strings(value: Any) -> str | None:
    return None if all(isinstance(v, str) for v in value) else "a list of strings"
