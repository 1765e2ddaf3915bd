"""``zeroshard.install_as_deepspeed()``: let ``import deepspeed`` find zeroshard.

    import zeroshard
    zeroshard.install_as_deepspeed()       # before transformers / accelerate are imported
    import deepspeed                       # zeroshard, under DeepSpeed's name

[Note: standing in for the deepspeed distribution]
Hugging Face's transformers and accelerate switch to their DeepSpeed code paths only when a module
*and* a distribution named ``deepspeed`` exist (``importlib.util.find_spec`` and
``importlib.metadata``), and compare its version against minimums.  Like PyMySQL's
``install_as_MySQLdb()``, this is an explicit call, never a side effect of importing zeroshard: it
puts one finder first on ``sys.meta_path`` that (1) maps every ``deepspeed[.x.y]`` import to the
module object ``zeroshard[.x.y]`` itself (one object under two names, so DeepSpeed-style patches of
module attributes reach the code that reads them) and (2) answers ``importlib.metadata`` for
``deepspeed`` with :data:`DEEPSPEED_VERSION`.  ``transformers`` caches its answer when it is first
imported, hence "before".  A ``deepspeed.x`` that zeroshard does not provide is a
``ModuleNotFoundError`` saying so.  A real DeepSpeed already imported is refused: two engines under
one name would mix.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.metadata
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, Optional, Sequence

#: The DeepSpeed version zeroshard answers with: the oldest whose features Hugging Face's libraries gate
#: on and zeroshard has.  Accelerate needs >= 0.9.3 (its DeepSpeed support), >= 0.14.5 and >= 0.15.2 (its
#: launch and plugin paths), >= 0.16.4 (AutoTP) and >= 0.18.2 for its ``ParallelismConfig(sp_backend=
#: "deepspeed")`` path, which imports ``UlyssesSPAttentionHF`` and ``UlyssesSPDataLoaderAdapter``
#: (zeroshard/sequence/hf.py, loader.py).  A feature gated at a later version than this one fails with
#: its library's own "requires deepspeed>=..." message instead of reaching zeroshard.
DEEPSPEED_VERSION = "0.18.2"
_ALIAS, _REAL = "deepspeed", "zeroshard"


class DeepSpeedAlreadyImportedError(ImportError):
    """A real DeepSpeed is imported in this process: zeroshard cannot also stand in for it."""


class InstalledTooLateError(ImportError):
    """Hugging Face modules that decide at import time whether DeepSpeed exists were imported first."""


#: modules that look for DeepSpeed once, when they are imported
_DECIDED_AT_IMPORT = ("transformers.integrations.deepspeed", "transformers.trainer", "accelerate.utils",
                      "accelerate.accelerator")


def _real_name(fullname: str) -> Optional[str]:
    if fullname == _ALIAS:
        return _REAL
    if fullname.startswith(_ALIAS + "."):
        return _REAL + fullname[len(_ALIAS):]
    return None


class _AliasLoader(importlib.abc.Loader):
    """Hands back the already-imported zeroshard module instead of executing anything."""

    def __init__(self, real: str) -> None:
        self.real = real
        self._real_spec: Optional[importlib.machinery.ModuleSpec] = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.real)
        self._real_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is zeroshard's, executed under its own name.  The import system
        has just stamped the alias's spec on it; its own spec goes back (reloads and relative imports
        inside zeroshard keep working)."""
        if self._real_spec is not None:
            module.__spec__ = self._real_spec


class _StandInDistribution(importlib.metadata.Distribution):
    """The metadata of the ``deepspeed`` distribution zeroshard stands in for."""

    def read_text(self, filename: str) -> Optional[str]:
        if filename == "METADATA":
            return (f"Metadata-Version: 2.1\nName: {_ALIAS}\nVersion: {DEEPSPEED_VERSION}\n"
                    f"Summary: zeroshard standing in for DeepSpeed (zeroshard.install_as_deepspeed)\n")
        return None

    def locate_file(self, path: Any) -> Path:
        return Path(__file__).parent / str(path)


class DeepSpeedFinder(importlib.abc.MetaPathFinder):
    """Finds ``deepspeed[.x]`` as ``zeroshard[.x]``, and the ``deepspeed`` distribution's metadata."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        real = _real_name(fullname)
        if real is None:
            return None
        try:
            real_spec = importlib.util.find_spec(real)
        except ModuleNotFoundError:
            real_spec = None
        if real_spec is None:
            raise ModuleNotFoundError(f"No module named {fullname!r}: zeroshard stands in for deepspeed here "
                                      f"(zeroshard.install_as_deepspeed()) and has no {real!r}", name=fullname)
        return importlib.util.spec_from_loader(fullname, _AliasLoader(real),
                                               is_package=real_spec.submodule_search_locations is not None)

    def find_distributions(self, context: Any = importlib.metadata.DistributionFinder.Context()
                           ) -> Iterator[importlib.metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or name.replace("-", "_").lower() == _ALIAS:
            yield _StandInDistribution()


def install_as_deepspeed() -> None:
    """Make ``import deepspeed`` (and its submodules, and its distribution metadata) resolve to zeroshard.

    Call it before importing transformers or accelerate; calling it again does nothing.
    """
    present = sys.modules.get(_ALIAS)
    if present is not None and present is not sys.modules.get(_REAL):
        raise DeepSpeedAlreadyImportedError(
            f"a real DeepSpeed is already imported (from {getattr(present, '__file__', '?')}); call "
            f"zeroshard.install_as_deepspeed() before anything imports deepspeed, or use one of the two")
    if any(isinstance(f, DeepSpeedFinder) for f in sys.meta_path):
        return
    early = [name for name in _DECIDED_AT_IMPORT if name in sys.modules]
    if early:
        raise InstalledTooLateError(
            f"{', '.join(early)} already imported: they decided at import time that DeepSpeed is absent. "
            f"Call zeroshard.install_as_deepspeed() before importing transformers or accelerate (first "
            f"thing in the script), or launch the script with `zeroshard run --as-deepspeed`")
    importlib.import_module(_REAL)
    sys.meta_path.insert(0, DeepSpeedFinder())
    importlib.invalidate_caches()
