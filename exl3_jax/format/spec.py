"""Constants of the EXL3 format and the shape/dtype rules of one EXL3 linear (numpy only).

The rules are checked on tensor *descriptors* (shape, dtype name), so the reader can validate a
checkpoint from the safetensors headers alone and the writer can refuse bad input before it writes
anything. See shared/spec/exl3_format.md sections 1.3-1.7 and exl3_format_165.md section 1.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from .errors import (CodebookMarkerError, MissingTensorError, TensorDtypeError,
                     TensorShapeError)

CODEBOOKS = ("3inst", "mcg", "mul1")

# Locked codebook multipliers; the marker tensors hold them as int32 scalars.
MCG_MULTIPLIER = 0xCBAC1FED
MUL1_MULTIPLIER = 0x83DCD12D
MARKER_MULTIPLIERS = {"mcg": MCG_MULTIPLIER, "mul1": MUL1_MULTIPLIER}

HADAMARD_BLOCK = 128   # every EXL3 tensor is padded to multiples of this on both axes
TILE = 16              # 16x16 weights per trellis tile
TILE_WEIGHTS = 256

INTEGER_RATES = tuple(range(1, 9))
HALF_RATES = (1.5, 2.5, 3.5)          # exllamav3 1.6.5, mul1 only
LINEAR_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")


def marker_as_int32(codebook: str) -> int:
    """The int32 value stored in a codebook marker tensor (the multiplier reinterpreted)."""
    value = MARKER_MULTIPLIERS[codebook]
    return value - (1 << 32) if value >= 1 << 31 else value


def rate_from_width(width: int) -> float | int:
    """Bits per weight K from the trellis' last dimension (int16 words per 256-weight tile).

    Returns an int for K = 1..8 (width 16K) and a float for the half rates 1.5/2.5/3.5 (width 24,
    40, 56). Raises ValueError for any other width (e.g. 72: exllamav3's kernel crashes on it).
    """
    if width % 16 == 0 and 1 <= width // 16 <= 8:
        return width // 16
    if width in (24, 40, 56):
        return (width - 8) // 16 + 0.5
    raise ValueError(f"trellis last dimension {width} is neither 16*K for K in 1..8 "
                     f"nor 24/40/56 (half-integer mul1 rates)")


def width_from_rate(K: float) -> int:
    """int16 words per tile for bits per weight K (inverse of ``rate_from_width``)."""
    if K in INTEGER_RATES:
        return 16 * int(K)
    if K in HALF_RATES:
        return 16 * int(K) + 8
    raise ValueError(f"unsupported bits per weight K={K!r}: use 1..8 or 1.5/2.5/3.5")


@dataclasses.dataclass(frozen=True)
class TensorDesc:
    """What a safetensors header says about one tensor."""
    shape: tuple[int, ...]
    dtype: str   # safetensors dtype name: "I16", "F16", "BF16", "F32", "I32", ...


@dataclasses.dataclass(frozen=True)
class LinearInfo:
    """Metadata of one EXL3 linear, validated, without its arrays.

    ``k`` and ``n`` are the padded in/out sizes (multiples of 128); the EXL3 matrix is (k, n) and
    the forward is y = x @ W.
    """
    key: str
    K: float | int
    codebook: str
    k: int
    n: int
    has_bias: bool
    legacy_signs: tuple[bool, bool]     # (su used instead of suh, sv used instead of svh)
    tensors: tuple[str, ...]            # full names of the stored tensors of this module

    @property
    def width(self) -> int:
        return width_from_rate(self.K)

    @property
    def trellis_bytes(self) -> int:
        return (self.k // TILE) * (self.n // TILE) * self.width * 2


def linear_tensor_name(key: str, suffix: str) -> str:
    return f"{key}.{suffix}"


def check_linear(key: str, descs: Mapping[str, TensorDesc],
                 marker_values: Mapping[str, int] | None = None,
                 *, file: str | None = None) -> LinearInfo:
    """Validate one EXL3 linear from its tensor descriptors and return its metadata.

    descs: suffix ("trellis", "suh", ...) -> TensorDesc for the tensors present under ``key``.
    marker_values: suffix ("mcg"/"mul1") -> the marker's int32 value, when it has been read.
    Raises a subclass of Exl3FormatError naming ``file`` and the tensor on any violation.
    """
    def name(suffix):
        return linear_tensor_name(key, suffix)

    if "trellis" not in descs:
        raise MissingTensorError("EXL3 module has no trellis", file=file, tensor=name("trellis"))
    trellis = descs["trellis"]
    if trellis.dtype != "I16":
        raise TensorDtypeError(f"trellis must be int16, got {trellis.dtype}", file=file,
                               tensor=name("trellis"))
    if len(trellis.shape) != 3:
        raise TensorShapeError(f"trellis must be 3-D [k/16, n/16, 16K], got shape "
                               f"{list(trellis.shape)}", file=file, tensor=name("trellis"))

    has_mcg, has_mul1 = "mcg" in descs, "mul1" in descs
    if has_mcg and has_mul1:
        raise CodebookMarkerError("both .mcg and .mul1 codebook markers are present", file=file,
                                  tensor=name("mcg"))
    codebook = "mcg" if has_mcg else "mul1" if has_mul1 else "3inst"
    if codebook != "3inst":
        marker = descs[codebook]
        if marker.dtype != "I32" or marker.shape != ():
            raise CodebookMarkerError(f"codebook marker must be an int32 scalar, got "
                                      f"{marker.dtype} {list(marker.shape)}", file=file,
                                      tensor=name(codebook))
        if marker_values is not None and codebook in marker_values:
            got = int(marker_values[codebook]) & 0xFFFFFFFF
            if got != MARKER_MULTIPLIERS[codebook]:
                raise CodebookMarkerError(
                    f"non-standard {codebook} multiplier 0x{got:08X} (expected "
                    f"0x{MARKER_MULTIPLIERS[codebook]:08X}); it would decode to garbage",
                    file=file, tensor=name(codebook))

    width = trellis.shape[2]
    try:
        K = rate_from_width(width)
    except ValueError as e:
        raise TensorShapeError(str(e), file=file, tensor=name("trellis")) from None
    if isinstance(K, float) and codebook != "mul1":
        raise CodebookMarkerError(f"half-integer rate K={K} (width {width}) requires the mul1 "
                                  f"codebook, but the module uses {codebook}", file=file,
                                  tensor=name("trellis"))

    k, n = trellis.shape[0] * TILE, trellis.shape[1] * TILE
    if k % HADAMARD_BLOCK or n % HADAMARD_BLOCK or k == 0 or n == 0:
        raise TensorShapeError(f"trellis implies k={k}, n={n}; both must be positive multiples "
                               f"of {HADAMARD_BLOCK}", file=file, tensor=name("trellis"))

    legacy = []
    for full, packed, size in (("suh", "su", k), ("svh", "sv", n)):
        if full in descs:
            d = descs[full]
            if d.dtype != "F16":
                raise TensorDtypeError(f"{full} must be float16, got {d.dtype}", file=file,
                                       tensor=name(full))
            if d.shape != (size,):
                raise TensorShapeError(f"{full} has shape {list(d.shape)} but the trellis "
                                       f"implies [{size}]", file=file, tensor=name(full))
            legacy.append(False)
        elif packed in descs:
            d = descs[packed]
            if d.dtype != "I16":
                raise TensorDtypeError(f"legacy {packed} must be int16, got {d.dtype}",
                                       file=file, tensor=name(packed))
            if d.shape != (size // 16,):
                raise TensorShapeError(f"legacy {packed} has shape {list(d.shape)} but the "
                                       f"trellis implies [{size // 16}]", file=file,
                                       tensor=name(packed))
            legacy.append(True)
        else:
            raise MissingTensorError(f"EXL3 module has a trellis but no {full} (or legacy "
                                     f"{packed})", file=file, tensor=name(full))

    has_bias = "bias" in descs
    if has_bias:
        d = descs["bias"]
        if d.dtype not in ("F16", "F32", "BF16"):
            raise TensorDtypeError(f"bias must be float16/float32/bfloat16, got {d.dtype}",
                                   file=file, tensor=name("bias"))
        if d.shape != (n,):
            raise TensorShapeError(f"bias has shape {list(d.shape)} but the trellis implies "
                                   f"[{n}]", file=file, tensor=name("bias"))

    tensors = tuple(name(s) for s in LINEAR_SUFFIXES if s in descs)
    return LinearInfo(key=key, K=K, codebook=codebook, k=k, n=n, has_bias=has_bias,
                      legacy_signs=(legacy[0], legacy[1]), tensors=tensors)


def expand_sign_bits(packed, size: int):
    """Legacy packed su/sv (int16 [size/16]) -> float16 +-1 [size] (spec 1.5: bit set = -1)."""
    import numpy as np
    words = np.asarray(packed).view(np.uint16).astype(np.uint32)
    bits = (words[:, None] >> np.arange(16, dtype=np.uint32)[None, :]) & 1
    return (1.0 - 2.0 * bits.reshape(size)).astype(np.float16)


def split_module_key(name: str) -> tuple[str, str]:
    """'model.layers.0.q_proj.trellis' -> ('model.layers.0.q_proj', 'trellis')."""
    key, _, suffix = name.rpartition(".")
    return key, suffix


def group_by_module(names: Sequence[str]) -> dict[str, dict[str, str]]:
    """Group tensor names ending in an EXL3 suffix by module key: key -> {suffix: name}."""
    groups: dict[str, dict[str, str]] = {}
    for nm in names:
        key, suffix = split_module_key(nm)
        if key and suffix in LINEAR_SUFFIXES + ("signs",):
            groups.setdefault(key, {})[suffix] = nm
    return groups
