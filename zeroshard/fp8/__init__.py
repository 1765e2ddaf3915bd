"""FP8 training: chosen linear layers run their forward and both backward GEMMs in FP8 (docs/FP8.md).

    import zeroshard.fp8
    zeroshard.fp8.convert(model, recipe="rowwise")      # or the config's "fp8": {"enabled": true}

recipes.py names the recipes (torchao's, imported only here), selection.py picks the layers,
convert.py swaps them, checks.py refuses what FP8 does not compose with.
"""

from .convert import convert, convert_from_config, fp8_layers
from .errors import FP8ConfigError, FP8UnavailableError
from .recipes import FP8_RECIPES
from .selection import Selection

__all__ = ["FP8_RECIPES", "FP8ConfigError", "FP8UnavailableError", "Selection", "convert", "convert_from_config",
           "fp8_layers"]
