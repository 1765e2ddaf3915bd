"""``deepspeed.runtime.pipe``: the module path of DeepSpeed's pipeline topologies (topology.py); the
pipeline itself is ``deepspeed.pipe`` (zeroshard/pipeline/)."""

from . import topology

__all__ = ["topology"]
