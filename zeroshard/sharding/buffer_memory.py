"""The buffer memory the sharding parts are handed, under the path they were first imported from: the
interface lives in host/buffer_memory.py ([Note: one buffer memory per engine] in host/buffer_memory.py)."""

from __future__ import annotations

from ..host.buffer_memory import BufferMemory, DeviceMemory

__all__ = ["BufferMemory", "DeviceMemory"]
