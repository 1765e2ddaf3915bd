"""Text that every machine has: the Python standard library's source files, as bytes."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch


def stdlib_bytes(limit: int = 4_000_000) -> torch.Tensor:
    """Up to ``limit`` bytes of ``*.py`` files from the standard library, in a stable order (1D uint8)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    if not chunks:
        raise RuntimeError(f"no Python source found under {root}")
    return torch.frombuffer(bytearray(b"".join(chunks)[:limit]), dtype=torch.uint8)


class ByteWindows(torch.utils.data.Dataset):
    """Fixed windows of ``seq_len + 1`` bytes: input is the first ``seq_len``, target the next ones."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data, self.seq_len = data.long(), seq_len

    def __len__(self) -> int:
        return (self.data.numel() - 1) // self.seq_len

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        window = self.data[i * self.seq_len: (i + 1) * self.seq_len + 1]
        return window[:-1], window[1:]
