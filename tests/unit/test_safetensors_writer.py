"""The streaming safetensors writer of checkpoints, buffered and around the page cache (O_DIRECT): the
files it writes are what the safetensors library reads, whatever the tensor sizes, the buffer size and
a header that outgrows its room; where the file system refuses O_DIRECT it writes buffered."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from zeroshard.checkpoint.direct_io import ALIGN
from zeroshard.checkpoint.format import FileWriting, SafetensorsWriter, file_matches


def tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"a": torch.randn(3, 5, generator=g),           # 60 bytes: nothing aligned after it
            "b": torch.randn(5000, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0),
            "c": torch.randint(0, 100, (777,), generator=g),
            "d": torch.randn(2048, generator=g)}          # exactly two blocks


def write(path: Path, direct: bool, io_chunk: int, header_room: int = 1 << 12) -> SafetensorsWriter:
    writer = SafetensorsWriter(path, header_room=header_room, writing=FileWriting(io_chunk, direct), checksum=True)
    for name, value in tensors().items():
        writer.add(name, value)
    writer.finish()
    return writer


@pytest.mark.parametrize("direct", [False, True])
@pytest.mark.parametrize("io_chunk", [ALIGN, 3 * ALIGN, 64 << 20])
def test_files_read_back_equal(tmp_path: Path, direct: bool, io_chunk: int) -> None:
    writer = write(tmp_path / "f.safetensors", direct, io_chunk)
    if direct and not writer.direct:
        pytest.skip("this file system refuses O_DIRECT")
    loaded = load_file(str(tmp_path / "f.safetensors"))
    assert set(loaded) == set(tensors())
    for name, value in tensors().items():
        assert torch.equal(loaded[name], value), name
    assert not list(tmp_path.glob(".*tmp*"))  # no leftover temporary file
    assert file_matches(tmp_path / "f.safetensors", writer.checksum)  # the checksum taken while writing


def test_direct_data_starts_on_a_block_and_the_file_has_its_true_size(tmp_path: Path) -> None:
    writer = write(tmp_path / "f.safetensors", True, ALIGN)
    if not writer.direct:
        pytest.skip("this file system refuses O_DIRECT")
    raw = (tmp_path / "f.safetensors").read_bytes()
    header_len = int.from_bytes(raw[:8], "little")
    assert (8 + header_len) % ALIGN == 0
    data = sum(v.numel() * v.element_size() for v in tensors().values())
    assert len(raw) == 8 + header_len + data  # the padded last block was cut off


@pytest.mark.parametrize("direct", [False, True])
def test_a_header_that_outgrows_its_room_moves_the_data(tmp_path: Path, direct: bool) -> None:
    writer = write(tmp_path / "f.safetensors", direct, ALIGN, header_room=8)
    assert file_matches(tmp_path / "f.safetensors", writer.checksum)
    loaded = load_file(str(tmp_path / "f.safetensors"))
    for name, value in tensors().items():
        assert torch.equal(loaded[name], value), name


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")
@pytest.mark.parametrize("refused_at", ["open", "write"])
def test_a_file_system_without_o_direct_gets_buffered_writes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            refused_at: str) -> None:
    """As tmpfs before Linux 6.6 (at open) or a file system that takes the flag and refuses the writes."""
    real_open, real_pwrite, direct_fds = os.open, os.pwrite, set()

    def opening(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & os.O_DIRECT and refused_at == "open":
            raise OSError(errno.EINVAL, "Invalid argument")
        fd = real_open(path, flags, *args)
        if flags & os.O_DIRECT:
            direct_fds.add(fd)
        return fd

    def writing(fd, data, offset):  # type: ignore[no-untyped-def]
        if fd in direct_fds:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", opening)
    monkeypatch.setattr(os, "pwrite", writing)
    writer = write(tmp_path / "f.safetensors", True, ALIGN)
    assert not writer.direct
    loaded = load_file(str(tmp_path / "f.safetensors"))
    assert torch.equal(loaded["d"], tensors()["d"])
    assert [p.name for p in tmp_path.iterdir()] == ["f.safetensors"]
