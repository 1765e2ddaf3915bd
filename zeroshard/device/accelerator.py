"""The process's accelerator: the device questions DeepSpeed scripts ask (``get_accelerator()``), for CPU
and CUDA, under DeepSpeed's names (``deepspeed/accelerator.py`` publishes this module as
``deepspeed.accelerator``; the core's own parts, such as the activation offloader, ask it here).

One object per device kind, chosen once: CUDA when torch sees a GPU, otherwise the CPU.  Every
answer comes from torch itself (``torch.cuda.*``) or, on the CPU, from what zeroshard measures
(host memory of this process for ``memory_allocated``/``max_memory_allocated``).
"""

from __future__ import annotations

import contextlib
import functools
import glob
import os
from typing import Any, Optional, Union

import torch

from ..distributed.launch_env import local_world_size
from ..host.pinned_total import pin_host_tensor
from ..host.process_memory import host_peak_bytes, proc_bytes

__all__ = ["get_accelerator", "is_current_accelerator_supported", "SUPPORTED_ACCELERATOR_LIST", "CPUAccelerator",
           "CUDAAccelerator"]


class CUDAAccelerator:
    """NVIDIA GPUs through ``torch.cuda``; NCCL for communication."""

    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device() if device_index is None else device_index)

    def set_device(self, device_index: Union[int, torch.device]) -> None:
        torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self, device_index: Optional[int] = None) -> None:
        torch.cuda.synchronize(device_index)

    def communication_backend_name(self) -> str:
        return "nccl"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """``tensor`` page-locked, counted in the process's pinned total (host/pinned_total.py).  With
        ``make_copy=False`` the tensor is only a template: a fresh page-locked buffer of its shape
        (``match_shape=False``: flat) and dtype, its values undefined."""
        if make_copy:
            return pin_host_tensor(tensor)
        shape = tensor.shape if match_shape else (tensor.numel(),)
        return pin_host_tensor(torch.empty(shape, dtype=tensor.dtype))

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def is_synchronized_device(self) -> bool:
        """False: kernels run asynchronously on streams."""
        return False

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cuda"

    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name: the stream class
        return torch.cuda.Stream

    @property
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's name: the event class
        return torch.cuda.Event

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: Optional[int] = None) -> Any:
        return torch.cuda.default_stream(device_index)


class CPUAccelerator:
    """The host CPU: gloo for communication; memory figures are this process's host memory."""

    def device_name(self, device_index: Optional[int] = None) -> str:
        return "cpu"

    def current_device_name(self) -> str:
        return "cpu"

    def current_device(self) -> int:
        return int(os.environ.get("LOCAL_RANK", "0"))

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device("cpu")

    def set_device(self, device_index: Any) -> None:
        """One CPU device: nothing to select (every local rank shares it)."""

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        """CPU "devices" on this node, as DeepSpeed counts them: the processes on this node, as whichever
        launcher said (DeepSpeed's ``LOCAL_SIZE``, torchrun's ``LOCAL_WORLD_SIZE``, OpenMPI's, MPICH's or
        SLURM's; distributed/launch_env.py), else the NUMA nodes that have cores, else 1."""
        return local_world_size(os.environ) or max(1, _numa_nodes_with_cores())

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        """Resident host memory of this process now (bytes)."""
        return proc_bytes("/proc/self/status", "VmRSS") or 0

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        """Peak resident host memory of this process (bytes)."""
        return host_peak_bytes()

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        """The kernel's peak cannot be reset from inside the process; the figure stays the lifetime peak."""

    def empty_cache(self) -> None:
        """No device cache on the CPU."""

    def synchronize(self, device_index: Optional[int] = None) -> None:
        """CPU work is synchronous."""

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def pin_memory(self, tensor: torch.Tensor, make_copy: bool = True, match_shape: bool = True) -> torch.Tensor:
        """The tensor itself: page-locking only speeds copies to a GPU, and this process has none (so
        nothing is counted as pinned either)."""
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned()

    def is_synchronized_device(self) -> bool:
        """True: every operation has finished when it returns, there are no streams to overlap."""
        return True

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu"

    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name; None: the CPU has no streams
        return None

    @property
    def Event(self) -> Any:  # noqa: N802 - DeepSpeed's name; None: the CPU has no events
        return None

    def stream(self, stream: Any) -> Any:
        """No stream to switch to: a context that does nothing."""
        return contextlib.nullcontext()

    def current_stream(self, device_index: Optional[int] = None) -> Any:
        return None

    def default_stream(self, device_index: Optional[int] = None) -> Any:
        return None


def _numa_nodes_with_cores(root: str = "/sys/devices/system/node") -> int:
    """NUMA nodes whose ``cpulist`` names at least one core (a memory-only node, such as HBM in flat
    mode, has none); 0 where the system does not say."""
    count = 0
    for node in glob.glob(os.path.join(root, "node[0-9]*", "cpulist")):
        try:
            with open(node) as f:
                count += bool(f.read().strip())
        except OSError:
            continue
    return count


#: the device names DeepSpeed knows an accelerator for
SUPPORTED_ACCELERATOR_LIST = ["cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu"]


def is_current_accelerator_supported() -> bool:
    """Whether this process's accelerator is one DeepSpeed supports (zeroshard's two always are)."""
    return get_accelerator().device_name() in SUPPORTED_ACCELERATOR_LIST


@functools.lru_cache(maxsize=1)
def get_accelerator() -> Union[CUDAAccelerator, CPUAccelerator]:
    """The accelerator of this process: CUDA when torch sees a GPU, else the CPU."""
    return CUDAAccelerator() if torch.cuda.is_available() else CPUAccelerator()
