"""Argument checks for tensors crossing into doorbell.

Results doorbell owns come back as torch views through ``__cuda_array_interface__``
(``device_view``). Tensors are checked by duck typing (``is_cuda``, ``device``, ``dtype``, ``shape``,
``is_contiguous()``, ``data_ptr()``, ``element_size()``), so this module imports no torch and
the checks run (and are tested) without a GPU. Every message says what to change.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Sequence, Tuple, Union

DTypes = Union[str, Iterable[str]]


_DTYPE_NAMES: Dict[Any, str] = {}


def dtype_name(t: Any) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (each dtype's name worked out once)."""
    dt = t.dtype
    try:
        name = _DTYPE_NAMES.get(dt)
    except TypeError:  # an unhashable stand-in
        return str(dt).rsplit(".", 1)[-1]
    if name is None:
        name = str(dt).rsplit(".", 1)[-1]
        _DTYPE_NAMES[dt] = name
    return name


def describe(t: Any) -> str:
    return f"a {dtype_name(t)} tensor of shape {tuple(t.shape)} on {t.device}"


def check_tensor(
    name: str,
    t: Any,
    *,
    device: Optional[int],
    dtypes: Optional[DTypes],
    ndim: Optional[int] = None,
    shape: Optional[Sequence[Optional[int]]] = None,
    align: int = 16,
) -> None:
    """Raises TypeError / ValueError unless ``t`` is a contiguous CUDA tensor of GPU ``device``
    with one of ``dtypes`` (None: any), ``ndim`` dimensions, the given ``shape`` (None entries: any size),
    and a data pointer aligned to ``align`` bytes. The common case (everything right) is
    checked first in one pass, since the calls on the decode path pay it per call; any miss goes
    through the checks below one by one, for the message."""
    try:
        # ``get_device()`` is -1 off the GPU; a shape without None compares as a tuple (a
        # ``torch.Size`` is one), the cheapest way PyTorch offers.
        if (
            (t.get_device() == device if device is not None else t.is_cuda)
            and (dtypes is None or (dtype_name(t) == dtypes if isinstance(dtypes, str) else isinstance(dtypes, tuple) and dtype_name(t) in dtypes))
            and (ndim is None or len(t.shape) == ndim)
            and (shape is None or (t.shape == shape if None not in shape else _shape_is(t.shape, shape)))
            and t.is_contiguous()
            and (align <= 1 or t.data_ptr() % align == 0)
        ):
            return
    except (AttributeError, TypeError):
        pass  # not a tensor: said below
    if not all(hasattr(t, a) for a in ("is_cuda", "dtype", "shape", "data_ptr", "is_contiguous")):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    allowed = None if dtypes is None else [dtypes] if isinstance(dtypes, str) else list(dtypes)
    if not t.is_cuda:
        raise ValueError(f"{name}: {describe(t)}; move it to the GPU (e.g. {name}.cuda())")
    if device is not None and t.device.index != device:
        raise ValueError(
            f"{name}: {describe(t)}, but this communicator runs on cuda:{device}; "
            f"use a tensor of cuda:{device}"
        )
    if allowed is not None and dtype_name(t) not in allowed:
        want = " or ".join(allowed)
        raise TypeError(f"{name}: {describe(t)}; expected {want} (convert with {name}.to(...))")
    if ndim is not None and len(t.shape) != ndim:
        raise ValueError(f"{name}: {describe(t)}; expected {ndim} dimensions")
    if shape is not None:
        if len(t.shape) != len(shape) or any(
            w is not None and int(s) != w for s, w in zip(t.shape, shape)
        ):
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
            raise ValueError(f"{name}: {describe(t)}; expected shape {want}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: {describe(t)} is not contiguous; pass {name}.contiguous()")
    if align > 1 and t.data_ptr() % align != 0:
        raise ValueError(
            f"{name}: its data starts at {t.data_ptr():#x}, not {align}-byte aligned; "
            f"pass a fresh tensor (or {name}.clone()) rather than an offset view"
        )


def _shape_is(have: Any, want: Sequence[Optional[int]]) -> bool:
    return len(have) == len(want) and all(w is None or int(s) == w for s, w in zip(have, want))


def nbytes(t: Any) -> int:
    n = 1
    for s in t.shape:
        n *= int(s)
    return n * int(t.element_size())


def numel(t: Any) -> int:
    n = 1
    for s in t.shape:
        n *= int(s)
    return n


# __cuda_array_interface__ type strings; bf16 and e4m3 travel as integers and are viewed back.
_TYPESTR = {"int16": "<i2", "int32": "<i4", "float32": "<f4", "uint8": "|u1"}


class _Device:
    """Device memory owned by doorbell, exposed through ``__cuda_array_interface__``."""

    def __init__(self, ptr: int, shape: Tuple[int, ...], typestr: str, owner: Any) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (int(ptr), False),
            "version": 3,
            "strides": None,
            "stream": None,
        }
        self._owner = owner  # keeps the buffer alive while a view exists


def device_view(ptr: int, shape: Tuple[int, ...], dtype: str, device: int, owner: Any) -> Any:
    import torch

    if ptr == 0:
        raise RuntimeError("doorbell returned no buffer for this result (not produced by this path)")
    base = {"bfloat16": "int16", "float8_e4m3fn": "uint8"}.get(dtype, dtype)
    t = torch.as_tensor(_Device(ptr, shape, _TYPESTR[base], owner), device=f"cuda:{device}")
    if base != dtype:
        t = t.view(getattr(torch, dtype))
    return t
