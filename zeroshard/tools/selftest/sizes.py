"""The models the self-test trains: GPT-like decoders of a few preset sizes, and the parity model.

``--size`` names a preset (``tiny``, ``125m``, ``350m``, ...) or a parameter count (``200m``, ``1.5b``,
``3e8``), which picks the preset nearest to it.  The presets from 125m up are the GPT-3 paper's shapes
(hidden and layers) with GPT-2's vocabulary rounded up to a multiple of 64; the small ones are for
CPUs, where a step of a 125M model takes seconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..demo.model import GPTConfig


@dataclass(frozen=True)
class Preset:
    name: str
    model: GPTConfig
    micro_batch: int

    @property
    def num_params(self) -> int:
        return self.model.num_params()


def _gpt(vocab: int, seq: int, hidden: int, layers: int, heads: int) -> GPTConfig:
    return GPTConfig(vocab_size=vocab, seq_len=seq, d_model=hidden, n_layer=layers, n_head=heads)


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("tiny", _gpt(4096, 64, 128, 2, 4), 4),        # 0.93M: the CPU default
    Preset("5m", _gpt(8192, 128, 256, 4, 4), 4),
    Preset("30m", _gpt(8192, 256, 512, 8, 8), 4),
    Preset("125m", _gpt(50304, 1024, 768, 12, 12), 8),
    Preset("350m", _gpt(50304, 1024, 1024, 24, 16), 8),
    Preset("760m", _gpt(50304, 1024, 1536, 24, 16), 4),
    Preset("1.3b", _gpt(50304, 1024, 2048, 24, 16), 4),
    Preset("2.7b", _gpt(50304, 1024, 2560, 32, 32), 2),
)}

#: the correctness cases' model: a vocabulary no world size divides (padding at every stage), no
#: attention bias (its key part gets a mathematically zero gradient, pure rounding noise that Adam
#: would turn into a full step: the runs could not be compared to 1e-5)
PARITY_MODEL = GPTConfig(vocab_size=61, seq_len=16, d_model=32, n_layer=2, n_head=2, attn_bias=False)

_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}


def parse_count(text: str) -> float:
    """``350m`` -> 3.5e8, ``1.3b`` -> 1.3e9, ``2e8`` -> 2e8 (ValueError otherwise)."""
    match = _COUNT.match(text)
    if not match:
        raise ValueError(f"{text!r} is neither a preset ({', '.join(PRESETS)}) nor a parameter count (350m, 1.3b)")
    return float(match.group(1)) * _SCALE[match.group(2).lower()]


def pick_size(text: str) -> Preset:
    """The preset ``text`` names, or the one whose parameter count is nearest (in ratio) to it."""
    if text.lower() in PRESETS:
        return PRESETS[text.lower()]
    target = parse_count(text)
    if target <= 0:
        raise ValueError(f"--size {text}: give a positive parameter count")
    return min(PRESETS.values(), key=lambda p: abs(math.log(p.num_params / target)))
