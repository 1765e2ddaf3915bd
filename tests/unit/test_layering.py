"""The package's layers import downwards only.

Every module of ``zeroshard/`` is parsed with ``ast`` and each of its imports resolved to the module it
loads (relative imports against the module's package; ``from pkg import name`` is the submodule
``pkg.name`` where there is one, else ``pkg``).  Imports inside functions and under ``TYPE_CHECKING``
count too: a lazy import hides a dependency from Python, not from a reader.  The rules:

- **The core never imports the DeepSpeed face.**  ``zeroshard/deepspeed/`` is DeepSpeed's names over
  zeroshard (``import deepspeed`` maps there); nothing outside it imports ``zeroshard.deepspeed``,
  except ``zeroshard/__init__.py`` (the package root re-exports the face) and ``zeroshard/tools/`` (the
  CLI's ``zeroshard run --as-deepspeed`` front end).
- **Checkpoints never import the engine.**  ``zeroshard/checkpoint/`` sees the engine's state through the
  protocols of ``checkpoint/interface.py``; nothing in it imports ``zeroshard.engine``.
- **Lower layers never import higher ones** (``_BELOW``): ``host/`` and ``device/`` serve every other
  part, ``offload/`` serves ``sharding/`` (through ``offload/policy.py``), and ``sharding/`` is handed
  what it needs of checkpoints and the engine (a buffer memory, a copy gate) when it is built.

Each failure lists every offending ``file -> module``.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path
from typing import Iterable

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "zeroshard"

#: files outside ``zeroshard/deepspeed/`` that may import it (a trailing ``/``: every file under that folder)
_FACE_IMPORTERS = ("zeroshard/__init__.py", "zeroshard/tools/")

#: package -> the packages above it, which it never imports
_BELOW = {
    "checkpoint": ("engine",),
    "sharding": ("checkpoint", "engine"),
    "offload": ("sharding", "checkpoint", "engine"),
    "host": ("sharding", "offload", "checkpoint", "engine"),
    "device": ("sharding", "offload", "checkpoint", "engine"),
}

Edge = tuple[str, str]  # (file relative to the repository root, module it imports)


def _module_name(rel_path: str) -> str:
    parts = list(Path(rel_path).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_of(rel_path: str) -> list[str]:
    """The package a relative import of ``rel_path`` starts from."""
    parts = _module_name(rel_path).split(".")
    return parts if rel_path.endswith("__init__.py") else parts[:-1]


def imports_of(rel_path: str, source: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` that ``source``, the text of the file at ``rel_path``, imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source, rel_path)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            package = _package_of(rel_path)
            base_parts = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(base_parts + ([node.module] if node.module else []))
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                     for alias in node.names]
        for name in names:
            while name and name not in modules:  # ``import a.b.c`` of a name in a.b: its nearest module
                name = name.rpartition(".")[0]
            if name:
                found.add(name)
    return found


@functools.lru_cache(maxsize=1)
def edges(package: Path = PACKAGE) -> frozenset[Edge]:
    """Every import between the package's modules."""
    files = {path.relative_to(ROOT).as_posix(): path for path in sorted(package.rglob("*.py"))}
    modules = {_module_name(rel) for rel in files}
    return frozenset((rel, target) for rel, path in files.items()
                     for target in imports_of(rel, path.read_text(), modules))


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def face_violations(found: Iterable[Edge]) -> set[Edge]:
    """Imports of ``zeroshard.deepspeed`` from outside it, bar its allowed importers."""
    return {(path, target) for path, target in found
            if _under(target, "zeroshard.deepspeed") and not path.startswith("zeroshard/deepspeed/")
            and not any(path == allowed or (allowed.endswith("/") and path.startswith(allowed))
                        for allowed in _FACE_IMPORTERS)}


def upward_imports(found: Iterable[Edge], lower: str, higher: str) -> set[Edge]:
    """Imports of ``zeroshard.<higher>`` from ``zeroshard/<lower>/``."""
    return {(path, target) for path, target in found
            if path.startswith(f"zeroshard/{lower}/") and _under(target, f"zeroshard.{higher}")}


def _listed(violations: set[Edge]) -> str:
    return "\n".join(f"  {path} -> {target}" for path, target in sorted(violations))


def test_the_core_never_imports_the_deepspeed_face() -> None:
    offenders = face_violations(edges())
    assert not offenders, "the core imports the DeepSpeed face:\n" + _listed(offenders)


def test_checkpoints_never_import_the_engine() -> None:
    offenders = upward_imports(edges(), "checkpoint", "engine")
    assert not offenders, "checkpoint/ imports engine/:\n" + _listed(offenders)


def test_lower_layers_never_import_higher_ones() -> None:
    offenders = {v for lower, higher in _BELOW.items() for above in higher
                 for v in upward_imports(edges(), lower, above)}
    assert not offenders, "a lower layer imports a higher one:\n" + _listed(offenders)


def test_the_walk_sees_every_kind_of_import() -> None:
    """Relative, absolute, ``from package import submodule`` and function-local imports are all seen,
    and each rule catches what it forbids."""
    modules = {"zeroshard", "zeroshard.deepspeed", "zeroshard.deepspeed.refused", "zeroshard.engine",
               "zeroshard.engine.engine", "zeroshard.experts.layer"}
    source = ("import zeroshard.deepspeed\n"
              "from ..deepspeed.refused import refuse\n"
              "def f():\n    from .. import engine\n    from ..engine.engine import Engine\n")
    found = imports_of("zeroshard/checkpoint/probe.py", source, modules)
    assert found == {"zeroshard.deepspeed", "zeroshard.deepspeed.refused", "zeroshard.engine",
                     "zeroshard.engine.engine"}
    assert imports_of("zeroshard/deepspeed/__init__.py", "from . import refused\n", modules) \
        == {"zeroshard.deepspeed.refused"}
    probe = {("zeroshard/checkpoint/probe.py", target) for target in found}
    assert face_violations(probe) == {p for p in probe if "deepspeed" in p[1]}
    assert upward_imports(probe, "checkpoint", "engine") == {p for p in probe if "engine" in p[1]}
    assert not face_violations({("zeroshard/tools/cli.py", "zeroshard.deepspeed.launcher"),
                                ("zeroshard/__init__.py", "zeroshard.deepspeed"),
                                ("zeroshard/deepspeed/comm.py", "zeroshard.deepspeed.utils")})


def test_only_zeroshard_lightning_imports_lightning() -> None:
    """Lightning is optional: only ``zeroshard/lightning/`` imports it, and nothing imports that package,
    so ``import zeroshard`` never needs Lightning."""
    lightning = {"lightning", "pytorch_lightning"}
    outside = {rel for rel in (p.relative_to(ROOT).as_posix() for p in PACKAGE.rglob("*.py"))
               if not rel.startswith("zeroshard/lightning/")}
    offenders = {(path, target) for path, target in edges()
                 if path in outside and _under(target, "zeroshard.lightning")}
    for rel in sorted(outside):
        for node in ast.walk(ast.parse((ROOT / rel).read_text(), rel)):
            if isinstance(node, ast.Import):
                offenders |= {(rel, a.name) for a in node.names if a.name.split(".")[0] in lightning}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                if (node.module or "").split(".")[0] in lightning:
                    offenders.add((rel, node.module or ""))
    assert not offenders, "Lightning imported outside zeroshard/lightning/:\n" + _listed(offenders)
