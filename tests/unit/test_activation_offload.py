"""Activation offload (activations/offload.py, hidden_states_offload.py, hf_layer_marker.py) and
DeepSpeed's checkpointing settings as module attributes (deepspeed/checkpointing.py), in one process.

The copy path runs on the CPU too when the offloader is told the tensors are movable: host to host,
through the same keep-last, tracking, copy-back and pooling code a GPU run takes without streams.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import zeroshard
from zeroshard.activations import hf_layer_marker
from zeroshard.activations.hidden_states_offload import CheckpointHiddenStatesOffload
from zeroshard.activations.offload import ActivationOffloader, ActivationOffloadError
from zeroshard.config import ConfigError
from zeroshard.deepspeed import checkpointing as ds_checkpointing
from zeroshard.deepspeed.checkpointing import ContiguousCheckpointingError


def _layers() -> nn.ModuleList:
    torch.manual_seed(3)
    return nn.ModuleList(nn.Linear(16, 16) for _ in range(4))


def _run(layers: nn.ModuleList, x: torch.Tensor, offload: CheckpointHiddenStatesOffload | None) -> torch.Tensor:
    h = x
    for layer in layers:
        if offload is not None:
            offload.mark(h)
        h = checkpoint(layer, h, use_reentrant=False)
    return h.square().sum()


def _movable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every marked tensor is moved (on a CPU-only machine the offloader otherwise keeps them all)."""
    monkeypatch.setattr(ActivationOffloader, "_should_skip", lambda self, tensor: False)


@pytest.mark.parametrize("keep_last", [0, 1, 2])
def test_moved_inputs_come_back_and_gradients_match_plain_torch(monkeypatch: pytest.MonkeyPatch,
                                                                keep_last: int) -> None:
    _movable(monkeypatch)
    layers = _layers()
    x = torch.randn(8, 16, requires_grad=True)
    _run(layers, x, None).backward()
    expected = [x.grad.clone()] + [p.grad.clone() for p in layers.parameters()]
    layers.zero_grad(set_to_none=True)
    x.grad = None
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=keep_last)
    with offload:
        loss = _run(layers, x, offload)
        assert list(offload._keep_last) == list(range(5 - keep_last, 5))[:keep_last]  # the newest stay
        assert all(moved.host.is_contiguous() for moved in offload._tracker.values())
        loss.backward()
    got = [x.grad] + [p.grad for p in layers.parameters()]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
    assert offload.stats.marked_tensors == 4
    assert offload.stats.offloaded_tensors == offload.stats.restored_tensors == 4 - keep_last
    assert offload.stats.kept_last_tensors == keep_last
    assert offload._cpu_buffer_pool_count == 4 - keep_last  # the host buffers wait for the next step


def test_a_second_step_reuses_the_pooled_host_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    _movable(monkeypatch)
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    with offload:
        _run(layers, x, offload).backward()
    pooled = {id(buffer) for buffers in offload._cpu_buffer_pool.values() for buffer in buffers}
    with offload:
        _run(layers, x, offload)
        assert {id(moved.host) for moved in offload._tracker.values()} <= pooled


def test_strided_view_comes_back_with_its_strides(monkeypatch: pytest.MonkeyPatch) -> None:
    _movable(monkeypatch)
    offloader = ActivationOffloader(use_streams=False, min_offload_bytes=0, keep_last_count=0)
    view = torch.randn(6, 8)[:, ::2]
    tensor_id = offloader.offload_input(view)
    assert tensor_id is not None
    back = offloader.restore_input(tensor_id)
    assert back.stride() == view.stride() and torch.equal(back, view)
    with pytest.raises(ActivationOffloadError):
        offloader.restore_input(tensor_id)  # handed back once


def test_on_the_cpu_marked_tensors_stay_and_unmarked_ones_pass_through() -> None:
    layers, x = _layers(), torch.randn(8, 16, requires_grad=True)
    offload = CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0)
    with offload:
        nn.Linear(8, 8)(torch.randn(4, 8, requires_grad=True)).sum().backward()
        assert offload.stats.saved_tensors_seen > 0 and offload.stats.marked_tensors == 0
        _run(layers, x, offload).backward()
    assert offload.stats.marked_tensors == 4 and offload.stats.skipped_marked_tensors == 4
    assert offload.stats.offloaded_tensors == 0


def test_small_parameters_and_overlapping_tensors_are_skipped() -> None:
    offloader = ActivationOffloader(use_streams=False, min_offload_bytes=1024)
    assert offloader._should_skip(torch.randn(4))
    assert offloader._should_skip(nn.Parameter(torch.randn(1024)))
    assert offloader._should_skip(torch.randn(4, 1024)[:1].expand(3, 1024))


def test_bad_counts_are_refused_and_the_context_is_not_reentrant() -> None:
    for name in ("keep_last_count", "max_fwd_stash_count", "max_cpu_buffer_pool_count", "min_offload_bytes"):
        with pytest.raises(ValueError, match=name):
            CheckpointHiddenStatesOffload(**{name: -1})
    offload = CheckpointHiddenStatesOffload(use_streams=False)
    with offload:
        with pytest.raises(RuntimeError, match="not re-entrant"):
            offload.__enter__()
    assert not hf_layer_marker.open_contexts()


def test_host_buffers_are_pinned_through_the_accelerator(monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator = zeroshard.accelerator.get_accelerator()
    calls: list[torch.Size] = []
    monkeypatch.setattr(accelerator, "pin_memory", lambda t, **kw: calls.append(t.shape) or t)
    for pin in (True, False):
        offloader = ActivationOffloader(use_streams=False, use_pin_memory=pin)
        buffer, key = offloader._empty_cpu_like(torch.randn(6, 8)[:, ::2])
        assert buffer.is_contiguous() and buffer.shape == (6, 4) and key[-1] is pin
    assert calls == [torch.Size([6, 4])]
    assert offloader._buffer_key(torch.randn(6, 4)) == offloader._buffer_key(torch.randn(6, 8)[:, ::2])


def test_hugging_face_layers_mark_their_hidden_states_while_a_context_is_open() -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GradientCheckpointingLayer"):
        pytest.skip("this transformers has no GradientCheckpointingLayer")
    from functools import partial

    layer_class = transformers.GradientCheckpointingLayer

    class Layer(layer_class):  # type: ignore[misc, valid-type]
        def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
            return hidden_states.sin() * 2

    original = layer_class.__call__
    layer = Layer()
    layer.gradient_checkpointing = True
    layer._gradient_checkpointing_func = partial(checkpoint, use_reentrant=False)
    x = torch.randn(4, 8, requires_grad=True)
    outer, inner = (CheckpointHiddenStatesOffload(use_streams=False, min_offload_bytes=0) for _ in range(2))
    with outer:
        with inner:
            layer(x).sum().backward()
        assert layer_class.__call__ is not original  # the outer context still uses the wrap
    assert layer_class.__call__ is original
    assert inner.stats.marked_tensors == 1 and outer.stats.marked_tensors == 0
    torch.testing.assert_close(x.grad, 2 * x.detach().cos())
    layer(x)
    assert inner.stats.marked_tensors == 1  # no context open: nothing marked
    with pytest.raises(KeyError):
        with outer:
            raise KeyError("boom")
    assert layer_class.__call__ is original


def test_checkpointing_settings_are_module_attributes_over_the_process_settings() -> None:
    saved = (ds_checkpointing.CPU_CHECKPOINT, ds_checkpointing.PROFILE_TIME, ds_checkpointing.num_layers,
             ds_checkpointing.deepspeed_checkpointing_enabled)
    try:
        ds_checkpointing.CPU_CHECKPOINT = True
        ds_checkpointing.PROFILE_TIME = True
        settings = zeroshard.activations.checkpointing.current_process_settings()
        assert settings.cpu_checkpointing and settings.profile
        ds_checkpointing.configure(None, checkpoint_in_cpu=False)
        assert ds_checkpointing.CPU_CHECKPOINT is False and ds_checkpointing.deepspeed_checkpointing_enabled
        with pytest.raises(ConfigError):
            ds_checkpointing.PARTITION_ACTIVATIONS = True
        assert ds_checkpointing.PARTITION_ACTIVATIONS is False
        with pytest.raises(ContiguousCheckpointingError, match="number of layers"):
            ds_checkpointing.configure(None, partition_activations=True, contiguous_checkpointing=True)
        with pytest.raises(ContiguousCheckpointingError, match="partitioned activations"):
            ds_checkpointing.configure(None, contiguous_checkpointing=True, num_checkpoints=2)
        with pytest.raises(ValueError):
            ds_checkpointing.mpu = object()
        import zeroshard.runtime.activation_checkpointing.checkpointing as by_deepspeeds_path
        assert by_deepspeeds_path is ds_checkpointing
    finally:
        ds_checkpointing.configure(None)
        (ds_checkpointing.CPU_CHECKPOINT, ds_checkpointing.PROFILE_TIME, ds_checkpointing.num_layers,
         ds_checkpointing.deepspeed_checkpointing_enabled) = saved
