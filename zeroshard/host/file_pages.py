"""Give back the pages of a memory-mapped checkpoint file once its values have been copied elsewhere.

[Note: mapped checkpoint pages under Init]
``with zeroshard.Init(): AutoModelForCausalLM.from_pretrained(dir)``: transformers opens each
safetensors file through safetensors' own memory map and hands every weight over as a view into that
map; Init copies this rank's slice of it into a shard.  The pages the copy (and transformers' own
checks) touched stay resident in this process until transformers closes the file, at the end of the
load, so every rank's RSS would grow by the whole model even though each keeps half (measured in
benchmarks/RESULTS.md, section "Pretrained weights into the shards").  The pages are file pages: the
page cache holds them, and a later read faults them in again with the same bytes.  So once a parameter
is sharded, :func:`drop_mapped_pages` tells the kernel (``madvise(MADV_DONTNEED)``) that this process no
longer needs the pages lying wholly inside the weight's bytes, and RSS follows what each rank keeps.

It acts only where that cannot change a value: a mapping of a file (not anonymous memory), shared
(a written page stays in the page cache) or private with no page of the range copied on write
(safetensors maps its files private and writable; a written private page would be discarded, losing
the write, and ``/proc/self/pagemap`` says which pages are such anonymous copies).  Anything else — another platform, a tensor not in a mapping, a failed call — leaves
memory as it was; it is an optimisation, never a condition for a correct load.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional

import torch

from . import libc

#: /proc/self/pagemap: one 64-bit entry per page; bit 63 present, bit 62 swapped out, bit 61 file page
#: or shared anonymous
_PRESENT = 1 << 63
_SWAPPED = 1 << 62
_FILE_OR_SHARED = 1 << 61
#: smaller weights (norms, biases) are not worth a read of /proc/self/maps
MIN_BYTES = 1 << 20


@dataclass(frozen=True)
class Mapping:
    """One line of ``/proc/self/maps``."""

    start: int
    end: int
    shared: bool  # 's' (MAP_SHARED) rather than 'p' (private)
    inode: int    # 0 for anonymous memory


def mapping_containing(address: int, maps_text: Optional[str] = None) -> Optional[Mapping]:
    """The mapping of this process that holds ``address``, or None (not Linux, or not mapped)."""
    if maps_text is None:
        try:
            maps_text = open("/proc/self/maps").read()
        except OSError:
            return None
    for line in maps_text.splitlines():
        fields = line.split()
        if len(fields) < 5:
            continue
        start_s, _, end_s = fields[0].partition("-")
        start, end = int(start_s, 16), int(end_s, 16)
        if start <= address < end:
            perms = fields[1]
            return Mapping(start, end, perms.endswith("s"), int(fields[4]))
    return None


def _has_private_copies(start: int, length: int) -> bool:
    """Whether any page in ``[start, start+length)`` is a private copy-on-write copy: present and
    anonymous, or swapped out (only anonymous pages are)."""
    first, count = start // libc.PAGE, length // libc.PAGE
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            pagemap.seek(first * 8)
            raw = pagemap.read(count * 8)
    except OSError:
        return True  # cannot tell: assume the worst
    if len(raw) != count * 8:
        return True
    for (entry,) in struct.iter_unpack("<Q", raw):
        if entry & _SWAPPED or (entry & _PRESENT and not entry & _FILE_OR_SHARED):
            return True
    return False


def drop_mapped_pages(tensor: torch.Tensor) -> int:
    """Release the resident pages wholly inside ``tensor``'s bytes if they belong to a file mapping and
    hold no private writes (see the Note); returns the bytes advised away (0 where nothing was done)."""
    nbytes = tensor.numel() * tensor.element_size()
    if libc.madvise is None or tensor.device.type != "cpu" or nbytes < MIN_BYTES:
        return 0
    begin = tensor.data_ptr()
    end = begin + nbytes
    mapping = mapping_containing(begin)
    if mapping is None or mapping.inode == 0 or end > mapping.end:
        return 0
    first, length = libc.whole_pages(begin, nbytes)  # whole pages inside the tensor
    if not length:
        return 0
    if not mapping.shared and _has_private_copies(first, length):
        return 0
    if libc.madvise(first, length, libc.MADV_DONTNEED) != 0:
        return 0
    return length
