"""4-bit NormalFloat (NF4) weights, as QLoRA stores a frozen base: torchao's `NF4Tensor` (the tensor subclass
torchtune trains with; it traces under torch.compile), made here block by block and for 3-D expert weights.

- `quantize(t)`: `t` (any float dtype, 2-D or 3-D) in NF4: blocks of 64 values, each with an absmax scaler; the scalers
  double-quantised to int8 in groups of `SCALER_BLOCK` (256, QLoRA's; a tensor whose block count 256 does not divide
  takes the largest power of two that does). The 4-bit codes are computed `CHUNK` values at a time, so quantising
  never holds more than a bounded temporary (torchao's own `to_nf4` holds 16 x the tensor). Dequantised in bf16.
- `F.linear(x, w)` on an NF4 weight runs torchao's `linear_nf4` (its `__torch_function__`): the backward dequantises
  again, never keeping a bf16 copy of the weight for the backward.
- `grouped(x, w, offs, mm)`: the same for a 3-D [E, out, in] expert weight under a grouped GEMM `mm`.
torchao is optional (the `qlora` extra): imported when a weight is first quantised, with one line if missing.
"""

from __future__ import annotations

import torch

from hybridtune.errors import ConfigError

BLOCK = 64
SCALER_BLOCK = 256
CHUNK = 1 << 24  # values quantised at once (a multiple of BLOCK)
MISSING = "load_in_4bit (QLoRA, NF4) needs torchao, which is not installed; pip install 'hybridtune[qlora]'"


def _nf4_module():
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError:
        raise ConfigError(MISSING) from None
    return nf4_tensor


def available() -> bool:
    try:
        _nf4_module()
    except ConfigError:
        return False
    return True


def is_nf4(t) -> bool:
    """Whether `t` (a tensor or Parameter) holds NF4 data; False without torchao loaded (nothing can be NF4 then)."""
    return type(t).__name__ == "NF4Tensor" and hasattr(t, "get_original_weight")


def quantizable(t: torch.Tensor) -> bool:
    """NF4 takes a floating tensor of 2 or 3 dimensions whose size is a multiple of the 64-value block."""
    return t.is_floating_point() and t.dim() in (2, 3) and t.numel() % BLOCK == 0 and t.numel() > 0


def scaler_block(numel: int) -> int:
    """The double quantisation's group: 256 scalers, or the largest power of two dividing the block count."""
    blocks, size = numel // BLOCK, SCALER_BLOCK
    while blocks % size:
        size //= 2
    return size


@torch.no_grad()
def quantize(t: torch.Tensor) -> torch.Tensor:
    """`t` as an NF4Tensor of the same shape (see the module doc), on `t`'s device; its values first cast to bf16."""
    mod = _nf4_module()
    if not quantizable(t):
        raise ValueError(f"NF4 needs a 2-D or 3-D float tensor of a multiple of {BLOCK} values, got {tuple(t.shape)}")
    flat = t.detach().to(torch.bfloat16).contiguous().view(-1)
    sblock = scaler_block(flat.numel())
    scalers, factor, mean = mod.NF4Tensor.double_quantize_scalers(flat, BLOCK, sblock)
    nf4 = torch.tensor(_LEVELS, device=flat.device, dtype=flat.dtype)
    codes = []
    for start in range(0, flat.numel(), CHUNK):
        part = flat[start : start + CHUNK]
        codes.append(mod.NF4Tensor.convert_to_norm_float_weight(part, part.numel() // BLOCK, BLOCK, nf4))
    meta = mod.SubclassTensorArgs(t.shape, _contiguous_strides(t.shape), 0, torch.bfloat16, flat.device, False)
    data = torch.cat(codes) if len(codes) > 1 else codes[0]
    return mod.NF4Tensor(meta, BLOCK, flat.numel() // BLOCK, sblock, scalers, factor, mean, data, nf4)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(tuple(shape)):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


# torchao's NF4 levels (QLoRA's), the lookup table every NF4Tensor carries.
_LEVELS = [
    -1.0,
    -0.6962,
    -0.5251,
    -0.3949,
    -0.2844,
    -0.1848,
    -0.0911,
    0.0,
    0.0796,
    0.1609,
    0.2461,
    0.3379,
    0.4407,
    0.5626,
    0.7230,
    1.0,
]


def dequantize(t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An NF4 tensor's values (bf16, or `dtype`); any other tensor as it is (cast to `dtype` when given)."""
    if is_nf4(t):
        w = t.get_original_weight()
        return w if dtype is None else w.to(dtype)
    return t if dtype is None else t.to(dtype)


def dequantize_bounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize(t, dtype)` (the same values) holding at most `CHUNK` values' temporaries at once beside the
    result: torchao's `get_original_weight` holds 16 bytes of indices a value, too much for a layer's fused experts
    in eager mode. Under torch.compile the plain form is traced (inductor fuses it)."""
    if torch.compiler.is_compiling() or not is_nf4(t):
        return dequantize(t, dtype)
    out = torch.empty(t.shape, dtype=dtype, device=t.device)
    flat, data = out.view(-1), t.quantized_data
    scalers = t.dequantize_scalers(t.quantized_scalers, t.quantization_factor, t.scaler_block_size)
    step = CHUNK // 2  # bytes (two values each) per chunk: whole blocks
    for start in range(0, data.numel(), step):
        part = data[start : start + step]
        codes = torch.stack([part >> 4, part & 0b1111], dim=-1).view(-1).long()
        first = start * 2 // BLOCK
        values = t.nf4[codes].view(-1, BLOCK) * scalers[first : first + codes.numel() // BLOCK, None]
        flat[start * 2 : start * 2 + codes.numel()] = values.view(-1).to(dtype)
    return out


def roundtrip(t: torch.Tensor) -> torch.Tensor:
    """`t` through NF4 and back, in `t`'s dtype: the values a 4-bit base computes with."""
    return dequantize(quantize(t), t.dtype)


class _Grouped(torch.autograd.Function):
    """x [S, in] times each row's expert of an NF4 [E, out, in] weight (frozen) under the grouped GEMM `mm`; the
    backward dequantises the weight again rather than keeping it."""

    @staticmethod
    def forward(ctx, x, weight, offs, mm):
        ctx.save_for_backward(weight, offs)
        ctx.mm = mm
        return mm(x, dequantize_bounded(weight, x.dtype).transpose(1, 2), offs)

    @staticmethod
    def backward(ctx, grad):
        weight, offs = ctx.saved_tensors
        w = dequantize_bounded(weight, grad.dtype)
        return ctx.mm(grad.contiguous(), w, offs), None, None, None


def grouped(x: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor, mm) -> torch.Tensor:
    """`mm(x, weight^T per expert, offs)` for an NF4 expert weight (see `_Grouped`)."""
    return _Grouped.apply(x, weight, offs, mm)


def nbytes(t: torch.Tensor) -> int:
    """The bytes a tensor holds: an NF4 one its codes, scalers and lookup table."""
    if is_nf4(t):
        inner, _ = t.__tensor_flatten__()
        return sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in inner)
    return t.numel() * t.element_size()


__all__ = ["BLOCK", "available", "dequantize", "grouped", "is_nf4", "nbytes", "quantizable", "quantize", "roundtrip"]
