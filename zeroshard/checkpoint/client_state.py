"""A checkpoint's client state: JSON in the manifest, its tensors in a safetensors file beside it.

[Note: client state holds tensors, never pickles]
``save_checkpoint(client_state=...)`` takes what the script hands it, and trainers hand it tensors
(Lightning's ``ModelCheckpoint`` keeps its best scores as tensors, its loops their counters beside them).
DeepSpeed pickles the whole object with ``torch.save``; loading a pickle runs whatever it names, so
zeroshard never writes one.  The client state is walked once, on every rank (one that cannot be saved
is refused on every rank alike): JSON values stay in the manifest as they are, each tensor goes into
``client_state.safetensors`` (rank 0 writes it, in a node-local save each node's first rank;
checksummed and listed like every file of the checkpoint) and leaves a ``{"__tensor__": name}``
reference, and the two forms JSON would change, a tuple and a dict whose keys are not all strings (or that uses one of these reserved
keys), leave ``{"__tuple__": [...]}`` and ``{"__dict__": [[key, value], ...]}``.  A load rebuilds the
same object: the same tensors (dtype, shape, values; on the CPU, as DeepSpeed's loads map them), tuples
as tuples, keys of their own types.  Any other object (a class instance, a set, a function) is refused
at the save with its place in the client state named: nothing is stored that a load would have to
execute.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

import torch

from .format import CheckpointError

__all__ = ["CLIENT_STATE_FILE", "encode", "decode"]

#: the file of the client state's tensors, beside the manifest
CLIENT_STATE_FILE = "client_state.safetensors"

_TENSOR, _TUPLE, _DICT = "__tensor__", "__tuple__", "__dict__"
_RESERVED = frozenset({_TENSOR, _TUPLE, _DICT})
_SCALARS = (str, int, float, bool, type(None))


def encode(value: Any) -> tuple[Any, dict[str, torch.Tensor]]:
    """``value`` as JSON with tensor references, and the tensors (host copies, taken now) by name."""
    tensors: dict[str, torch.Tensor] = {}
    return _encode(value, "client_state", tensors), tensors


def _encode(value: Any, where: str, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        name = f"t{len(tensors)}"
        tensors[name] = value.detach().to("cpu", copy=True).contiguous()
        return {_TENSOR: name}
    if isinstance(value, _SCALARS):  # non-finite floats too: the manifest's JSON writes them as Python's
        return value
    if isinstance(value, list):
        return [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {_TUPLE: [_encode(v, f"{where}[{i}]", tensors) for i, v in enumerate(value)]}
    if isinstance(value, Mapping):
        if all(isinstance(k, str) for k in value) and not _RESERVED & set(value):
            return {k: _encode(v, f"{where}[{k!r}]", tensors) for k, v in value.items()}
        for k in value:
            if not isinstance(k, _SCALARS):
                raise CheckpointError(f"{where} cannot be saved: its key {k!r} is a {type(k).__name__}; keys "
                                      f"must be strings, numbers, booleans or None")
        return {_DICT: [[k, _encode(v, f"{where}[{k!r}]", tensors)] for k, v in value.items()]}
    raise CheckpointError(f"{where} cannot be saved: a {type(value).__module__}.{type(value).__qualname__} is "
                          f"neither JSON (strings, numbers, lists, tuples, dicts) nor a tensor, and zeroshard "
                          f"writes no pickles (a load would run what they name); store its state as those")


def decode(document: Any, tensor: Callable[[str], torch.Tensor]) -> Any:
    """The client state :func:`encode` described, with ``tensor(name)`` reading each tensor."""
    if isinstance(document, list):
        return [decode(v, tensor) for v in document]
    if not isinstance(document, dict):
        return document
    if len(document) == 1:
        (key, inner), = document.items()
        if key == _TENSOR:
            return tensor(inner)
        if key == _TUPLE:
            return tuple(decode(v, tensor) for v in inner)
        if key == _DICT:
            return {k: decode(v, tensor) for k, v in inner}
    return {k: decode(v, tensor) for k, v in document.items()}
