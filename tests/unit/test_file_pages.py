"""``drop_mapped_pages``: the pages of a mapped file go back once read, and nothing else ever does
(anonymous memory, a private page written in place)."""

from __future__ import annotations

import mmap
import struct
import sys
from pathlib import Path

import pytest
import torch

from zeroshard.host import file_pages

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and madvise: Linux only")

PAGE = mmap.PAGESIZE


def resident_pages(tensor: torch.Tensor) -> int:
    first = tensor.data_ptr() // PAGE
    last = -(-(tensor.data_ptr() + tensor.numel() * tensor.element_size()) // PAGE)
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        raw = pagemap.read((last - first) * 8)
    return sum(1 for (entry,) in struct.iter_unpack("<Q", raw) if entry >> 63)


def mapped(path: Path, values: torch.Tensor) -> tuple[mmap.mmap, torch.Tensor]:
    """A private, writable mapping of ``path`` holding ``values`` (as safetensors maps its files)."""
    path.write_bytes(values.numpy().tobytes())
    with open(path, "rb+") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    return mapping, torch.frombuffer(mapping, dtype=values.dtype)


def test_read_pages_of_a_file_mapping_are_given_back_and_read_again_unchanged(tmp_path: Path) -> None:
    values = torch.arange(3 * file_pages.MIN_BYTES // 4, dtype=torch.float32)
    mapping, view = mapped(tmp_path / "w.bin", values)
    weight = view[5:]  # not page-aligned at the start: the partial first page stays
    assert torch.equal(weight, values[5:])  # every page read: resident
    assert resident_pages(weight) == -(-(weight.numel() * 4 + 20) // PAGE)
    released = file_pages.drop_mapped_pages(weight)
    assert released == (weight.numel() * 4 + 20) // PAGE * PAGE - PAGE
    # the first, partial page was not advised away (the kernel may still unmap it with its neighbours
    # where it mapped the file's page cache in large folios: a file page is read again on demand)
    assert resident_pages(weight) <= 1
    assert torch.equal(weight, values[5:])  # faulted in again from the file
    del view, weight
    mapping.close()


def test_a_page_written_in_a_private_mapping_keeps_the_whole_range(tmp_path: Path) -> None:
    values = torch.ones(2 * file_pages.MIN_BYTES // 4)
    mapping, view = mapped(tmp_path / "w.bin", values)
    view[PAGE * 10 // 4] = 7.0  # a copy-on-write page: dropping it would lose the write
    assert file_pages.drop_mapped_pages(view) == 0
    assert float(view[PAGE * 10 // 4]) == 7.0 and float(view.sum()) == values.numel() + 6
    del view
    mapping.close()


def test_anonymous_memory_and_small_tensors_are_left_alone() -> None:
    anonymous = torch.ones(2 * file_pages.MIN_BYTES // 4)
    assert file_pages.drop_mapped_pages(anonymous) == 0
    assert float(anonymous.sum()) == anonymous.numel()
    assert file_pages.drop_mapped_pages(torch.ones(8)) == 0


def test_the_mapping_is_found_from_proc_maps_text() -> None:
    text = ("7f0000000000-7f0000100000 rw-p 00000000 fd:01 5433396    /data/model.safetensors\n"
            "7f0000100000-7f0000200000 rw-p 00000000 00:00 0 \n")
    in_file = file_pages.mapping_containing(0x7F0000000010, text)
    assert in_file == file_pages.Mapping(0x7F0000000000, 0x7F0000100000, shared=False, inode=5433396)
    anon = file_pages.mapping_containing(0x7F0000100010, text)
    assert anon is not None and anon.inode == 0
    assert file_pages.mapping_containing(0x10, text) is None


def test_a_swapped_out_page_counts_as_a_private_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy-on-write page the kernel swapped out is not present, yet dropping it would lose it."""
    entries = {"present file page": (1 << 63) | (1 << 61), "present anonymous": 1 << 63, "swapped": 1 << 62,
               "not present": 0}
    real_open = open

    def pagemap_of(entry: int):  # type: ignore[no-untyped-def]
        def opening(path, *args, **kwargs):  # type: ignore[no-untyped-def]
            if path == "/proc/self/pagemap":
                import io
                return io.BytesIO(struct.pack("<Q", entry) * (1 << 20))
            return real_open(path, *args, **kwargs)
        return opening

    for what, entry in entries.items():
        monkeypatch.setattr("builtins.open", pagemap_of(entry))
        copied = file_pages._has_private_copies(0, 4 * PAGE)
        assert copied == (what in ("present anonymous", "swapped")), what
