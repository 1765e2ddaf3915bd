"""Stage 3's released units keep their storage and drop their pages (see [Note: releasing a gathered
unit's pages]): measured with mincore, on buffers large enough to hold whole pages."""

import sys

import pytest
import torch

from zeroshard.host.page_release import can_release_pages, prefer_huge_pages, release_pages, resident_bytes

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise/mincore: Linux only")


def test_released_pages_leave_memory_and_come_back_on_write() -> None:
    buffer = torch.randn(3 << 20)  # 12 MiB: thousands of whole pages
    assert can_release_pages(buffer)
    address, nbytes = buffer.untyped_storage().data_ptr(), buffer.untyped_storage().nbytes()
    prefer_huge_pages(buffer)  # advice only: values and residency unchanged
    resident = resident_bytes(buffer)
    assert nbytes - 8192 <= resident <= nbytes  # all but the partial pages at the ends

    release_pages(buffer)
    assert resident_bytes(buffer) == 0
    assert (buffer.untyped_storage().data_ptr(), buffer.untyped_storage().nbytes()) == (address, nbytes)
    # the whole pages read as zeros; at most a partial page at either end keeps its values
    assert int((buffer != 0).sum()) <= 2 * 4096 // buffer.element_size()

    buffer.fill_(2.0)  # a gather writes the values back: the pages fault in again
    assert resident_bytes(buffer) == resident and bool((buffer == 2.0).all())


def test_a_buffer_smaller_than_a_page_has_nothing_to_release() -> None:
    small = torch.ones(16)
    release_pages(small)
    assert resident_bytes(small) == 0 and bool((small == 1).all())  # no whole page: untouched


def test_device_memory_is_refused_clearly() -> None:
    meta = torch.empty(1024, device="meta")
    assert not can_release_pages(meta)
    with pytest.raises(RuntimeError, match="can_release_pages"):
        release_pages(meta)


def test_a_pool_hands_its_buffers_out_again_as_they_were_left() -> None:
    from zeroshard.host.page_memory import HostPageMemory
    from zeroshard.sharding.buffer_pool import BufferPool

    pool = BufferPool(1 << 20, torch.float32, torch.device("cpu"), HostPageMemory())  # 4 MiB buffers
    first = pool.acquire(1 << 20)
    first.fill_(3.0)
    pool.release(first)
    assert pool.nbytes == 4 << 20
    again = pool.acquire(1000)
    # the same buffer, not zeroed: its user writes what it reads (see [Note: filling a stage-2 bucket])
    assert again.data_ptr() == first.data_ptr() and bool((again == 3.0).all())
    second = pool.acquire(10)  # all lent: the pool grows
    assert second.data_ptr() != again.data_ptr() and pool.nbytes == 8 << 20


def test_kept_buffers_give_back_their_pages_and_keep_their_address() -> None:
    from zeroshard.host.page_memory import HostPageMemory
    from zeroshard.sharding.buffer_pool import KeptBuffers

    kept = KeptBuffers(torch.device("cpu"), HostPageMemory())  # parks nothing: given-back pages are dropped
    chunk = kept.take(7, 1 << 20, torch.float32).fill_(1.0)
    kept.give_back(7)
    assert resident_bytes(chunk) == 0
    assert kept.take(7, 1 << 20, torch.float32).data_ptr() == chunk.data_ptr()
    assert kept.take(7, 1 << 19, torch.float32).numel() == 1 << 19  # another size: a new buffer
    kept.give_back(8)  # never taken: nothing to give back
