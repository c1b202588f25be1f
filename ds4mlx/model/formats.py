"""Weight formats: DeepSeek's FP8/FP4 release encodings and MLX's quantized layouts.

DeepSeek's release stores
* most linear weights as ``F8_E4M3`` ``(out, in)`` with one ``F8_E8M0`` scale per 128×128
  block (``scale`` shape ``(ceil(out/128), ceil(in/128))``), value = e4m3 × 2^(s−127);
* routed experts as ``I8`` ``(out, in/2)``, two e2m1 values per byte (low nibble first),
  with one ``F8_E8M0`` scale per 32 inputs (``scale`` shape ``(out, in/32)``).

MLX's microscaling modes hold exactly these numbers: ``mxfp8`` packs four e4m3 bytes per
``uint32`` with one e8m0 scale per 32 inputs, ``mxfp4`` eight e2m1 nibbles per ``uint32``
(low nibble first) with one e8m0 scale per 32. So FP4 experts repack by reinterpreting
the bytes, and an FP8 block scale becomes per-32 scales by repeating it (4 groups per
block column, 128 rows per block row): no value changes. ``mx.load`` reads both 8-bit
float encodings as ``uint8``; the safetensors header says which one it is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx

FP8_BLOCK = 128  # DeepSeek's FP8 weight block (rows and columns)
MX_GROUP = 32  # elements per scale in MLX's mxfp4 / mxfp8 (and DeepSeek's FP4)
# e2m1 code -> value (bit 3 is the sign), as DeepSeek and the OCP MX spec define it.
_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class QuantSpec:
    """One MLX quantization: ``mode`` (``"affine"``, ``"mxfp4"``, ``"mxfp8"``), ``bits``,
    ``group_size`` (elements per scale)."""

    mode: str
    bits: int
    group_size: int

    def as_dict(self) -> dict:
        """mlx-lm's ``quantization`` entry for this spec."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    @property
    def label(self) -> str:
        """``"mxfp4"``, ``"mxfp8"`` or ``"q4g64"`` (affine bits and group size)."""
        return self.mode if self.mode != "affine" else f"q{self.bits}g{self.group_size}"

    @property
    def bits_per_weight(self) -> float:
        """Storage per weight: value bits + the group's scale (8-bit e8m0 for mx modes,
        16-bit scale and bias for affine at bf16/f16)."""
        extra = 8 if self.mode != "affine" else 32
        return self.bits + extra / self.group_size


MXFP4 = QuantSpec("mxfp4", 4, MX_GROUP)
MXFP8 = QuantSpec("mxfp8", 8, MX_GROUP)
_SPEC = re.compile(r"^(?:q)?([2-8])(?:[:g](\d+))?$")


def parse_spec(text: str, group_size: int = 64) -> QuantSpec | str | None:
    """A quantization choice from the command line.

    ``"mxfp4"`` / ``"mxfp8"``: MLX microscaling; ``"2"``…``"8"`` (optionally ``"4:32"`` or
    ``"q4g32"`` for the group size): affine at that many bits; ``"none"`` / ``"float"``:
    unquantized (None); ``"keep"``: whatever the source stores (returned as ``"keep"``).

    Raises:
        ValueError: anything else, or an affine bits / group size MLX does not support.
    """
    t = str(text).strip().lower()
    if t in ("none", "float", "f"):
        return None
    if t == "keep":
        return "keep"
    if t == "mxfp4":
        return MXFP4
    if t == "mxfp8":
        return MXFP8
    m = _SPEC.match(t)
    if not m:
        raise ValueError(f"bad quantization {text!r}: use mxfp4, mxfp8, 2..8[:group], none, keep")
    bits, gs = int(m.group(1)), int(m.group(2) or group_size)
    if bits not in AFFINE_BITS or gs not in AFFINE_GROUPS:
        raise ValueError(
            f"bad quantization {text!r}: affine bits must be one of {AFFINE_BITS}, "
            f"group size one of {AFFINE_GROUPS}"
        )
    return QuantSpec("affine", bits, gs)


def e8m0_to_float(s: mx.array) -> mx.array:
    """float32 2^(s − 127) of ``uint8`` e8m0 exponents (exact: built from the float bits)."""
    bits = s.astype(mx.uint32) << 23
    val = bits.view(mx.float32)
    # Exponent byte 0 is 2^-127, a float32 subnormal the bit trick cannot build.
    return mx.where(s == 0, mx.array(2.0**-127, dtype=mx.float32), val)


def fp8_block_dequant(w: mx.array, scale: mx.array) -> mx.array:
    """float32 ``(out, in)`` of an FP8 weight (``uint8`` e4m3) and its 128×128 block scales."""
    out, inn = w.shape[-2:]
    s = e8m0_to_float(scale)
    s = mx.repeat(mx.repeat(s, FP8_BLOCK, axis=-2)[..., :out, :], FP8_BLOCK, axis=-1)[..., :inn]
    return mx.from_fp8(w, dtype=mx.float32) * s


def fp8_block_to_mxfp8(w: mx.array, scale: mx.array) -> tuple[mx.array, mx.array]:
    """Lossless repack of an FP8 block-scaled weight into MLX ``mxfp8``.

    Args:
        w: ``uint8`` e4m3 codes ``(out, in)``, ``in`` a multiple of 32.
        scale: ``uint8`` e8m0 block exponents ``(ceil(out/128), ceil(in/128))``.

    Returns:
        ``(weight uint32 (out, in/4), scales uint8 (out, in/32))``.
    """
    out, inn = w.shape[-2:]
    per_block = FP8_BLOCK // MX_GROUP
    s = mx.repeat(scale, FP8_BLOCK, axis=-2)[..., :out, :]
    s = mx.repeat(s, per_block, axis=-1)[..., : inn // MX_GROUP]
    return w.view(mx.uint32), s


def fp4_dequant(w: mx.array, scale: mx.array) -> mx.array:
    """float32 ``(out, in)`` of packed e2m1 experts (``int8``/``uint8`` ``(out, in/2)``) and
    their per-32 e8m0 scales ``(out, in/32)``."""
    b = w.view(mx.uint8)
    lut = mx.array(_E2M1, dtype=mx.float32)
    vals = mx.stack([lut[b & 15], lut[b >> 4]], axis=-1).reshape(*b.shape[:-1], -1)
    return vals * mx.repeat(e8m0_to_float(scale), MX_GROUP, axis=-1)


def fp4_to_mxfp4(w: mx.array, scale: mx.array) -> tuple[mx.array, mx.array]:
    """Lossless repack of packed e2m1 experts into MLX ``mxfp4``: ``(uint32 (out, in/8),
    scales uint8 (out, in/32))``. Same nibble order, so only the container type changes."""
    return w.view(mx.uint8).view(mx.uint32), scale


def infer_mlx_spec(
    weight_shape: tuple[int, ...], scales_shape: tuple[int, ...], in_dim: int, has_biases: bool
) -> QuantSpec:
    """The MLX quantization of a stored ``.weight/.scales[/.biases]`` triple, from shapes.

    ``in_dim`` is the unquantized input size the network expects.

    Raises:
        ValueError: shapes that no supported mode produces.
    """
    bits = weight_shape[-1] * 32 // in_dim
    gs = in_dim // scales_shape[-1] if scales_shape[-1] else 0
    if has_biases and bits in AFFINE_BITS and gs in AFFINE_GROUPS:
        return QuantSpec("affine", bits, gs)
    if not has_biases and gs == MX_GROUP and bits in (4, 8):
        return MXFP4 if bits == 4 else MXFP8
    raise ValueError(
        f"unsupported MLX quantization: weight {weight_shape}, scales {scales_shape}, "
        f"input size {in_dim}"
    )
