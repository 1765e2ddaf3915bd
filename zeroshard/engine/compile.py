"""``engine.compile()``: DeepSpeed's method, which compiles the engine's module in place.

[Note: compiling the engine's module in place]
``engine.compile(backend, compile_kwargs, schedule)`` has DeepSpeed's signature and meaning (Hugging
Face Accelerate calls it so): the wrapped module is compiled with ``nn.Module.compile``, which keeps
the module object, its parameters and every hook registered on it, so the engine's gradient hooks and
stage 3's gather hooks stay where they are (the hooks run outside the compiled regions, see [Note:
stage-3 hooks run outside compiled regions] in sharding/stage3/gather_scheduler.py).  Options are
checked here, before anything is compiled (``backend`` overrides a ``backend`` in ``compile_kwargs``,
as in DeepSpeed, whose callers may pass both), and what cannot work is refused by name with a
:class:`CompileError`: a backend torch does not know; ``schedule``, DeepCompile's pass schedule, which
needs DeepSpeed's graph passes; ``fullgraph=True`` at stage 3, whose hooks break the graph at every
unit; and CUDA graphs at stage 3 (the ``cudagraphs`` backend, ``mode="reduce-overhead"`` or
``"max-autotune"``), which replay recorded addresses while a unit's parameters are gathered into new
memory on every pass; and an engine whose forward itself communicates: tensor parallelism (DTensor's
collectives), sequence parallelism (the all-to-alls or the ring), expert parallelism (the tokens'
all-to-all) and pipeline stages (their sends and receives), whose collectives zeroshard does not yet keep
out of the compiled graphs.  ``torch.compile(model)`` before ``initialize()`` is the other way in and
needs nothing of the engine.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Union

import torch

from ..distributed.parallel_dims import ParallelDims
from ..errors import NotSupportedByZeroshard

Backend = Union[str, Callable[..., Any]]

#: ``torch.compile`` modes that record CUDA graphs
_GRAPH_MODES = frozenset({"reduce-overhead", "max-autotune"})


class CompileError(NotSupportedByZeroshard):
    """``engine.compile()`` was asked for a backend or an option that cannot work with zeroshard (see
    [Note: compiling the engine's module in place])."""


def compile_options(backend: Backend, compile_kwargs: Optional[Mapping[str, Any]], schedule: Any,
                    stage: int, axes: Optional[ParallelDims] = None) -> dict[str, Any]:
    """The keyword arguments for ``nn.Module.compile``, or a :class:`CompileError` naming what cannot work."""
    if axes is not None:
        inside = [name for name, size in (("tensor", axes.tp), ("sequence", axes.sp), ("expert", axes.ep),
                                          ("pipeline", axes.pp)) if size > 1]
        if inside:
            raise CompileError(f"engine.compile() with {' and '.join(inside)} parallelism is not supported yet: its "
                               f"collectives run inside the forward, and zeroshard does not yet keep them out of "
                               f"the compiled graphs; train this engine eager")
    options = dict(compile_kwargs or {})
    if schedule is not None:
        raise CompileError("engine.compile(schedule=...) is DeepCompile's pass schedule, which zeroshard does not "
                           "have; call engine.compile() without schedule")
    options["backend"] = backend  # over compile_kwargs' own, as DeepSpeed's
    if isinstance(backend, str) and backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise CompileError(f"engine.compile(backend={backend!r}): torch knows no such backend; known: "
                           f"{', '.join(torch._dynamo.list_backends())}")
    if stage == 3:
        if options.get("fullgraph"):
            raise CompileError("engine.compile(compile_kwargs={'fullgraph': True}) cannot work at ZeRO stage 3: its "
                               "gather and release hooks run outside the graph at every unit; drop fullgraph")
        if backend == "cudagraphs" or options.get("mode") in _GRAPH_MODES:
            raise CompileError(f"engine.compile() with CUDA graphs (backend={backend!r}, mode={options.get('mode')!r})"
                               f" cannot work at ZeRO stage 3: its parameters are gathered into new memory on "
                               f"every pass; use mode='default' or 'max-autotune-no-cudagraphs'")
    return options

