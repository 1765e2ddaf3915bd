"""``deepspeed.OnDevice``: build a model's tensors directly on a device and in a floating dtype.

    with OnDevice(dtype=torch.bfloat16, device="meta"):
        model = MyModel()          # every parameter on "meta", in bfloat16, nothing allocated

Inside the block every tensor factory (``torch.empty``, ``zeros``, ``randn``, ``tensor``, ... — the
functions torch's own ``with torch.device(...)`` redirects) that is given no device creates its
tensor on ``device``, and every floating-point tensor a factory makes is ``dtype``, also where the
call names another floating dtype (as DeepSpeed's does: a module that asks for fp32 weights still
gets ``dtype`` ones).  Integer and boolean tensors keep their dtype.  The default dtype is ``dtype``
for the block, so the common call with no dtype is born in it instead of being converted.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Union

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors  # the factories torch.device(...) redirects


class _FactoriesOn(TorchFunctionMode):
    """Gives every tensor factory call the block's device (where it names none) and floating dtype."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.device, self.dtype = device, dtype
        self.factories = _device_constructors()

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (),
                           kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = dict(kwargs or {})
        if func not in self.factories:
            return func(*args, **kwargs)
        if kwargs.get("device") is None:
            kwargs["device"] = self.device
        asked = kwargs.get("dtype")
        if isinstance(asked, torch.dtype) and asked.is_floating_point:
            kwargs["dtype"] = self.dtype
        made = func(*args, **kwargs)
        if isinstance(made, torch.Tensor) and made.is_floating_point() and made.dtype != self.dtype:
            made = made.to(self.dtype)  # a float from data of another precision (a float64 array, ...)
        return made


class OnDevice:
    """Within the block, tensor factories build on ``device`` and floating tensors are ``dtype``
    (see the module's doc); ``enabled=False`` makes the block do nothing."""

    def __init__(self, dtype: torch.dtype, device: Union[str, torch.device] = "meta", enabled: bool = True) -> None:
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise ValueError(f"OnDevice(dtype={dtype!r}): the dtype floating-point tensors are made in must be a "
                             f"floating torch.dtype, such as torch.float16 or torch.bfloat16")
        self.dtype = dtype
        self.device = torch.device(device)
        self.enabled = enabled
        self._mode: Optional[_FactoriesOn] = None
        self._default_dtype: Optional[torch.dtype] = None

    def __enter__(self) -> "OnDevice":
        if self.enabled:
            if self._mode is not None:
                raise RuntimeError("this OnDevice block is already open: use one OnDevice object per with-block")
            self._default_dtype = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            self._mode = _FactoriesOn(self.device, self.dtype)
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._mode is None:
            return
        try:
            self._mode.__exit__(*exc)
        finally:
            self._mode = None
            assert self._default_dtype is not None
            torch.set_default_dtype(self._default_dtype)
