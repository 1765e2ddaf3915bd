"""StagingBuffers: an asynchronous save's host copies are reused by the next save (no fresh memory to
touch), and are copies: a change to the original after capture does not reach them."""

from __future__ import annotations

import torch

from zeroshard.checkpoint.save import StagingBuffers


def test_buffers_are_copies_reused_by_name_shape_and_dtype() -> None:
    buffers = StagingBuffers()
    original = torch.arange(6.0)
    first = buffers.copy("param.b0", original)
    original.add_(1)
    assert torch.equal(first, torch.arange(6.0))  # a copy, taken at capture
    again = buffers.copy("param.b0", original)
    assert again.data_ptr() == first.data_ptr() and torch.equal(again, original)  # the same memory, refilled
    assert buffers.copy("param.b0", torch.zeros(3)).data_ptr() != first.data_ptr()  # another shape: new
    assert buffers.copy("param.b0", torch.zeros(3, dtype=torch.float64)).dtype == torch.float64
    buffers.release()
    assert buffers._buffers == {}
