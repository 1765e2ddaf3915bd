"""Link speeds as people write them ("900GB/s", "400Gbps"), read into bytes per second for the scale model."""

from __future__ import annotations

import re

__all__ = ["parse_bandwidth"]

_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "m": 1e6, "G": 1e9, "g": 1e9, "T": 1e12, "t": 1e12}


def parse_bandwidth(text: str) -> float:
    """Bytes per second from "900GB/s", "50 GB/s", "400Gbps", "400Gb/s" or "1.6Tbps".

    A capital ``B`` is bytes (``GB/s``, ``GBps``), a small ``b`` bits (``Gb/s``, ``Gbps``); prefixes are
    decimal, ``Gi``/``Mi``/``Ti`` binary.  A plain number is refused: 50 could be GB/s or Gb/s, 8x apart.
    """
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([kKmMgGtT]?)(i?)(B/s|Bps|b/s|bps)\s*", text)
    if not match:
        raise ValueError(f"{text!r} is not a bandwidth: write a positive number and a unit, e.g. 900GB/s (bytes) "
                         f"or 400Gbps (bits)")
    value, prefix, binary, unit = match.groups()
    scale = 2.0 ** (10 * "kmgt".index(prefix.lower()) + 10) if binary and prefix else _PREFIX[prefix]
    bandwidth = float(value) * scale / (8 if unit in ("b/s", "bps") else 1)
    if bandwidth <= 0:
        raise ValueError(f"{text!r}: a bandwidth must be positive")
    return bandwidth
