"""Group-wise asymmetric quantisation of K/V (KIVI style) into packed 2/4/8-bit codes.

Keys have outlier *channels*, so they are quantised per channel over a block of ``group`` tokens; values have no
channel structure worth keeping, so they are quantised per token over groups of channels. Scale and zero are fp16.
Codes are packed along the channel axis: two 4-bit codes per byte, four 2-bit codes, one 8-bit code.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

VALUE_GROUP = 32  # channels per value group (head_dim 64 -> two groups per token; heads not a multiple use one group)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes (< 2**bits) along the last axis; its length must be a multiple of 8 // bits."""
    if bits == 8:
        return codes.to(torch.uint8)
    per = 8 // bits
    grouped = codes.to(torch.uint8).reshape(*codes.shape[:-1], codes.shape[-1] // per, per)
    packed = grouped[..., 0].clone()  # OR of shifted planes: the codes' bits do not overlap (faster than a sum)
    for k in range(1, per):
        packed |= grouped[..., k] << (k * bits)
    return packed


def unpack_codes(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of :func:`pack_codes`: uint8 codes, last axis ``8 // bits`` times longer."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    codes = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


_LUTS: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def _lut(bits: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8 // bits] table: the codes a packed byte holds, as floats (one gather instead of shift/mask/convert)."""
    key = (bits, dtype, device)
    if key not in _LUTS:
        per = 8 // bits
        byte = torch.arange(256).unsqueeze(1)
        shifts = torch.arange(0, 8, bits).unsqueeze(0)
        _LUTS[key] = ((byte >> shifts) & ((1 << bits) - 1)).to(dtype=dtype, device=device).reshape(256, per)
    return _LUTS[key]


def unpack_float(packed: torch.Tensor, bits: int, dtype: torch.dtype) -> torch.Tensor:
    """Unpack codes straight into ``dtype`` (the decode-time path)."""
    if bits == 8:
        return packed.to(dtype)
    vals = torch.nn.functional.embedding(packed.int(), _lut(bits, dtype, packed.device))
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def _affine(x: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, bits: int) -> tuple[torch.Tensor, ...]:
    """Codes, fp16 scale and fp16 zero for ``x`` given broadcastable group minima and maxima."""
    levels = (1 << bits) - 1
    zero = lo.to(torch.float16)
    span = hi.float() - zero.float()
    scale = torch.where(span > 0, span / levels, torch.ones_like(span)).to(torch.float16)
    scale = torch.where(scale > 0, scale, torch.full_like(scale, 2.0 ** -24))  # fp16 underflow guard
    codes = (x.float() - zero.float()).div_(scale.float()).round_().clamp_(0, levels).to(torch.uint8)
    return codes, scale, zero


@dataclass
class Quantized:
    """Packed codes of a ``[B, H, T, D]`` tensor plus the fp16 scale/zero of each group."""

    codes: torch.Tensor  # uint8 [B, H, T_pad, D * bits / 8]
    scale: torch.Tensor  # fp16, keys [B, H, T_pad / group, 1, D]; values [B, H, T, D / group, 1]
    zero: torch.Tensor
    bits: int
    length: int
    per_channel: bool  # True: keys (groups of tokens per channel); False: values (groups of channels per token)
    group: int

    def nbytes(self) -> int:
        """Device bytes of codes, scales and zeros."""
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))

    def dequantize_into(self, out: torch.Tensor) -> torch.Tensor:
        """Reconstruct into ``out`` [B, H, T, D] (a view is fine, e.g. the front of attention's K buffer).

        The decode path: each bit plane of the packed bytes holds every ``8 // bits``-th channel, so one shift-and-mask
        per plane and one fused multiply-add straight into that plane's channels of ``out``; no unpacked copy and no
        concatenation after. The multiply-add runs in fp32 and rounds once into ``out``.
        """
        b, h, _, d = out.shape
        n, g, per = self.length, self.group, 8 // self.bits
        mask = (1 << self.bits) - 1
        scale, zero = self.scale.float(), self.zero.float()
        full = n // g if self.per_channel else 0
        for j in range(per):
            plane = self.codes if per == 1 else (self.codes >> (j * self.bits)) & mask  # [B, H, T_pad, D / per]
            if not self.per_channel:
                torch.addcmul(zero, plane[:, :, :n].view(b, h, n, d // g, g // per), scale,
                              out=out.view(b, h, n, d // g, g)[..., j::per])
                continue
            grouped = plane.view(b, h, -1, g, d // per)
            if full:
                torch.addcmul(zero[:, :, :full, :, j::per], grouped[:, :, :full], scale[:, :, :full, :, j::per],
                              out=out[:, :, : full * g].view(b, h, full, g, d)[..., j::per])
            if n > full * g:
                torch.addcmul(zero[:, :, full, :, j::per], grouped[:, :, full, : n - full * g],
                              scale[:, :, full, :, j::per], out=out[:, :, full * g: n, j::per])
        return out

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        """Reconstruct the ``[B, H, T, D]`` tensor in ``dtype``."""
        vals = unpack_float(self.codes, self.bits, dtype)
        b, h, t_pad, d = vals.shape
        if self.per_channel:
            grouped = vals.view(b, h, t_pad // self.group, self.group, d)
        else:
            grouped = vals.view(b, h, t_pad, d // self.group, self.group)
        # fp16 scale/zero promote inside the in-place ops: no separate casts on the decode path
        out = grouped.mul_(self.scale).add_(self.zero).view(b, h, t_pad, d)
        return out[:, :, : self.length]


def quantize_keys(x: torch.Tensor, bits: int, group: int = 32, length: int | None = None) -> Quantized:
    """Per-channel quantisation over blocks of ``group`` tokens; the last block is padded by repeating its last token.

    ``length``: the real tokens when ``x`` already holds that padding (the tiered cache reads the padded rows in the
    same gather as the rest instead of copying the tier again to append them)."""
    b, h, t, d = x.shape
    if length is not None and length != t:
        if t != length + (-length) % group:
            raise ValueError(f"{t} key rows for {length} tokens: padding must round up to a multiple of {group}")
        codes = quantize_keys(x, bits, group)
        codes.length = length
        return codes
    pad = (-t) % group
    if pad:
        filler = x[:, :, -1:].expand(b, h, pad, d) if t else x.new_zeros(b, h, pad, d)
        x = torch.cat([x, filler], dim=2)
    grouped = x.float().reshape(b, h, (t + pad) // group, group, d)  # float32 reductions: several times bf16's speed
    lo, hi = grouped.amin(dim=3, keepdim=True), grouped.amax(dim=3, keepdim=True)
    codes, scale, zero = _affine(grouped, lo, hi, bits)
    packed = pack_codes(codes.reshape(b, h, t + pad, d), bits)
    return Quantized(packed, scale, zero, bits, t, True, group)


def quantize_values(x: torch.Tensor, bits: int) -> Quantized:
    """Per-token quantisation over groups of ``VALUE_GROUP`` channels."""
    b, h, t, d = x.shape
    group = VALUE_GROUP if d % VALUE_GROUP == 0 else d  # small heads: one group per token
    grouped = x.float().reshape(b, h, t, d // group, group)  # float32 reductions: several times bf16's speed
    lo, hi = grouped.amin(dim=-1, keepdim=True), grouped.amax(dim=-1, keepdim=True)
    codes, scale, zero = _affine(grouped, lo, hi, bits)
    packed = pack_codes(codes.reshape(b, h, t, d), bits)
    return Quantized(packed, scale, zero, bits, t, False, group)
