"""Released pages parked and moved under the next buffer filled (see [Note: released pages move to the
next gather] in host/page_reserve.py), measured with mincore."""

import sys

import pytest
import torch

from zeroshard.host import libc
from zeroshard.host.page_reserve import PageReserve
from zeroshard.host.page_release import resident_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or libc.mremap is None,
                                reason="mremap/madvise/mincore: Linux only")


def whole(tensor: torch.Tensor) -> int:
    return libc.whole_pages(tensor.data_ptr(), tensor.numel() * tensor.element_size())[1]


def aligned_values(tensor: torch.Tensor) -> torch.Tensor:
    """The elements lying on the tensor's whole pages."""
    start = libc.whole_pages(tensor.data_ptr(), 1 << 30)[0]
    first = (start - tensor.data_ptr()) // tensor.element_size()
    return tensor[first: first + whole(tensor) // tensor.element_size()]


def test_parked_pages_move_under_the_next_buffer_filled() -> None:
    """Given pages stay resident where they were until another buffer is filled: then they are under that
    buffer, with the values they had (moved, not zeroed or copied), and the first holds none."""
    first, second = torch.full((1 << 20,), 3.0), torch.empty(1 << 20)
    reserve = PageReserve(capacity=1 << 30)
    reserve.give(first)
    assert reserve.nbytes == whole(first) == resident_bytes(first)
    reserve.fill(second)
    moved = min(whole(first), whole(second))
    assert reserve.moved_bytes == moved and reserve.nbytes == whole(first) - moved
    assert resident_bytes(first) == whole(first) - moved
    assert resident_bytes(second) >= moved
    assert int((aligned_values(second) == 3.0).sum()) * 4 >= moved - 4096  # the pages' own values came along


def test_a_buffer_filled_takes_its_own_parked_pages_back_without_moving_them() -> None:
    buffer = torch.full((1 << 20,), 5.0)
    reserve = PageReserve(capacity=1 << 30)
    reserve.give(buffer)
    reserve.fill(buffer)
    assert reserve.moved_bytes == 0 and reserve.nbytes == 0
    assert bool((buffer == 5.0).all()) and resident_bytes(buffer) == whole(buffer)


def test_what_is_parked_beyond_capacity_goes_oldest_first_and_close_drops_the_rest() -> None:
    old, new = torch.ones(1 << 20), torch.ones(1 << 20)
    reserve = PageReserve(capacity=whole(new))
    reserve.give(old)
    reserve.give(new)
    assert reserve.nbytes == whole(new)
    assert resident_bytes(old) == 0 and resident_bytes(new) == whole(new)
    reserve.drop_all()
    assert reserve.nbytes == 0 and resident_bytes(new) == 0


def test_a_reclaimed_range_leaves_the_reserve_and_the_rest_of_a_buffer_stays_parked() -> None:
    buffer = torch.full((1 << 20,), 7.0)
    reserve = PageReserve(capacity=1 << 30)
    reserve.give(buffer)
    half = aligned_values(buffer)[: (whole(buffer) // 2) // 4]
    reserve.reclaim(half)
    assert reserve.nbytes == whole(buffer) - whole(half)
    assert bool((half == 7.0).all())


def test_a_kernel_that_cannot_move_pages_gets_them_dropped_as_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """mremap refused (a kernel without MREMAP_DONTUNMAP): what was parked is dropped, moves stop, and
    every later release drops its pages at once."""
    import zeroshard.host.page_reserve as page_reserve

    monkeypatch.setattr(page_reserve, "_MOVE", lambda *args: 2**64 - 1)  # MAP_FAILED
    first, second, third = torch.ones(1 << 20), torch.empty(1 << 20), torch.ones(1 << 20)
    reserve = PageReserve(capacity=1 << 30)
    reserve.give(first)
    reserve.fill(second)
    assert reserve.nbytes == 0 and reserve.moved_bytes == 0 and resident_bytes(first) == 0
    reserve.give(third)
    assert reserve.nbytes == 0 and resident_bytes(third) == 0


def test_a_hand_over_moves_the_whole_pages_and_copies_the_partial_ends() -> None:
    """``target`` ends with ``source``'s exact values; ``source``'s whole pages are now ``target``'s (moved,
    not copied: source holds none of them), its partial end pages stay; parked pages under either are
    no longer parked."""
    big = torch.zeros(4 << 20)
    shift = 1000  # elements: the views start mid-page, at the same offset within a page
    source = big[shift: shift + (1 << 20) + 77]
    offset = (1 << 21) + shift  # the same offset within a page as source's (a page: 1024 floats)
    target = big[offset: offset + source.numel()]
    assert target.numel() == source.numel()
    assert (source.data_ptr() - target.data_ptr()) % libc.PAGE == 0
    source.copy_(torch.arange(source.numel(), dtype=torch.float32))
    reserve = PageReserve(capacity=1 << 30)
    reserve.give(target)
    assert reserve.nbytes == whole(target)
    assert reserve.hand_over(source, target)
    assert reserve.nbytes == 0 and reserve.moved_bytes == whole(source)
    assert torch.equal(target, torch.arange(source.numel(), dtype=torch.float32))
    assert resident_bytes(source) == 0
    assert resident_bytes(target) == whole(target)


def test_a_hand_over_is_refused_where_pages_cannot_line_up() -> None:
    """Different offsets within a page, sizes or dtypes: nothing moves, nothing changes (the caller copies)."""
    big = torch.ones(3 << 20)
    reserve = PageReserve(capacity=1 << 30)
    source = big[: 1 << 20]
    assert not reserve.hand_over(source, big[(1 << 21) + 1: (1 << 21) + 1 + (1 << 20)])  # 4 bytes off
    assert not reserve.hand_over(source, big[1 << 21: (1 << 21) + (1 << 20) - 1024])
    assert not reserve.hand_over(source, torch.ones(1 << 20, dtype=torch.float64))
    assert reserve.moved_bytes == 0 and resident_bytes(source) == whole(source)
