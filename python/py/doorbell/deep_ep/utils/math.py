"""Numeric helpers with the names and meaning of DeepEP's ``deep_ep.utils.math`` (what its tests
import), written for doorbell."""

from __future__ import annotations

from typing import Any, Tuple

# e4m3's largest finite value: a group's scale maps its absolute maximum there.
_E4M3_MAX = 448.0


def calc_diff(x: Any, y: Any) -> float:
    """1 - the cosine-like similarity 2<x, y> / (|x|^2 + |y|^2), in double: 0 for equal
    tensors, small for close ones (DeepEP's tests bound it, e.g. below 5e-6)."""
    a, b = x.double(), y.double()
    denominator = (a * a + b * b).sum()
    if float(denominator) == 0.0:
        return 0.0
    return float(1.0 - 2.0 * (a * b).sum() / denominator)


def per_token_cast_to_fp8(x: Any) -> Tuple[Any, Any]:
    """bf16/f32 ``[tokens, hidden]`` (hidden a multiple of 128) to ``(e4m3 [tokens, hidden],
    f32 scales [tokens, hidden / 128])``: each group of 128 values divided by its scale,
    amax / 448 (amax at least 1e-4)."""
    import torch

    if x.dim() != 2 or x.size(1) % 128 != 0:
        raise ValueError(f"per_token_cast_to_fp8: x of shape {tuple(x.shape)}; (tokens, a multiple of 128)")
    tokens, hidden = x.shape
    groups = x.float().view(tokens, hidden // 128, 128)
    scale = groups.abs().amax(dim=2, keepdim=True).clamp(min=1e-4) / _E4M3_MAX
    q = (groups / scale).to(torch.float8_e4m3fn)
    return q.view(tokens, hidden), scale.view(tokens, hidden // 128)


def per_token_cast_back(x_fp8: Any, x_scales: Any) -> Any:
    """The inverse of :func:`per_token_cast_to_fp8`, to bf16. ``x_scales`` is f32 ``[tokens,
    hidden / 128]``, or int32 ``[tokens, hidden / 512]`` holding four UE8M0 exponents each (a
    scale of 2^(e - 127) per byte e, as DeepEP's ``use_ue8m0`` returns)."""
    import torch

    tokens, hidden = x_fp8.shape
    if x_scales.dtype == torch.int32:
        # A dense copy: `contiguous()` keeps a column-major tensor whose last dimension has size
        # 1 (hidden 512) as it is, and viewing int32 as bytes needs that dimension's stride 1.
        dense = x_scales.new_empty(x_scales.shape).copy_(x_scales)
        exps = dense.view(torch.uint8).to(torch.int32) << 23
        scales = exps.view(torch.float32)
    else:
        scales = x_scales.float()
    scales = scales.reshape(tokens, -1)[:, : hidden // 128]
    values = x_fp8.float().view(tokens, hidden // 128, 128) * scales.unsqueeze(2)
    return values.view(tokens, hidden).to(torch.bfloat16)


def inplace_unique(x: Any, num_slots: int) -> None:
    """Each row of int ``x`` (values -1 or in ``[0, num_slots)``) keeps each value once, largest
    first, the rest of the row -1; in place."""
    import torch

    if x.dim() != 2:
        raise ValueError("inplace_unique: x is (rows, k)")
    rows, k = x.shape
    seen = torch.zeros(rows, num_slots + 1, dtype=torch.bool, device=x.device)
    seen.scatter_(1, x.masked_fill(x < 0, num_slots).long(), True)
    slots = torch.arange(num_slots, device=x.device, dtype=x.dtype).expand(rows, num_slots)
    present = torch.where(seen[:, :num_slots], slots, torch.full_like(slots, -1))
    if num_slots < k:
        pad = torch.full((rows, k - num_slots), -1, dtype=x.dtype, device=x.device)
        present = torch.cat([present, pad], dim=1)
    x.copy_(present.topk(k, dim=1).values)


def hash_tensor(t: Any) -> int:
    """A 64-bit checksum of ``t``'s bytes (equal bytes, equal hash): the sum of its 8-byte words,
    zero-padded, wrapped to 64 bits."""
    import torch

    raw = t.detach().contiguous().view(-1).view(torch.uint8)
    pad = (-raw.numel()) % 8
    if pad:
        raw = torch.cat([raw, torch.zeros(pad, dtype=torch.uint8, device=raw.device)])
    return int(raw.view(torch.int64).sum().item()) & ((1 << 64) - 1)
