"""Decode a trellis tensor to W_hat, dequantize to the original basis, and the reference forward.

W = diag(suh) . Bk . W_hat . Bn . diag(svh)  (k x n, y = x @ W + bias), spec 4.1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..format.spec import TILE
from .bitstream import _width_of, ring_layout, tile_perm, window_states, words_to_u32
from .codebook import check_codebook, decode_states
from .hadamard import hadamard128

_HIGHEST = jax.lax.Precision.HIGHEST


def decode_trellis(trellis, codebook: str, *, unrounded: bool = False):
    """Decode packed trellis tiles to the rotated-basis weight W_hat, bit-exactly.

    Args:
      trellis: int16 [..., k/16, n/16, W].
      codebook: "3inst", "mcg" or "mul1" (half rates require "mul1").
      unrounded: each weight before its fp16 rounding (codebook.decode_states).
    Returns:
      float16 [..., k, n] (float32 if ``unrounded``).
    """
    check_codebook(codebook)
    trellis = jnp.asarray(trellis)
    width = _width_of(trellis, None)
    layout = ring_layout(width)
    if isinstance(layout["K"], float) and codebook != "mul1":
        raise ValueError(f"half-integer rate K={layout['K']} requires the mul1 codebook")
    # Emit states directly in tile-position order (p = 16 r + c): order[p] = t with perm[t] = p.
    order = np.argsort(tile_perm())
    states = window_states(words_to_u32(trellis), layout, order)       # [..., tk, tn, 256]
    values = decode_states(states, codebook, unrounded=unrounded)
    *lead, tk, tn, _ = values.shape
    values = values.reshape(*lead, tk, tn, TILE, TILE)                  # [..., tk, tn, r, c]
    values = jnp.moveaxis(values, -2, -3)                               # [..., tk, r, tn, c]
    return values.reshape(*lead, tk * TILE, tn * TILE)


def _rotate_rows(w):
    """Bk . w: the block Hadamard on the k (second to last) axis, fp32."""
    return jnp.swapaxes(hadamard128(jnp.swapaxes(w, -1, -2)), -1, -2)


def dequantize(trellis, suh, svh, codebook: str):
    """The original-basis weight W = diag(suh) Bk W_hat Bn diag(svh).

    Args:
      trellis: int16 [..., k/16, n/16, W]; suh: [..., k]; svh: [..., n]; codebook name.
    Returns:
      float32 [..., k, n], for y = x @ W.
    """
    w_hat = decode_trellis(trellis, codebook).astype(jnp.float32)
    w = hadamard128(_rotate_rows(w_hat))                                  # Bk W_hat Bn
    return (w * jnp.asarray(suh, jnp.float32)[..., :, None]
            * jnp.asarray(svh, jnp.float32)[..., None, :])


def linear_reference(x, trellis, suh, svh, codebook: str, bias=None, *, exact: bool = False):
    """Rotated-basis forward of one EXL3 linear (spec 4.1).

    xh = had128(x * suh);  y' = xh @ W_hat;  y = had128(y') * svh + bias.

    Args:
      x: float [..., k] (already zero-extended to the padded k).
      trellis, suh, svh, codebook, bias: the linear's tensors (bias [n] or None).
      exact: False: all arithmetic in fp32 (the oracle for the kernels). True: emulate
        exllamav3's fp16 kernel path (spec 4.2/4.3 path A): fp16 pre-scale, fp32 butterflies
        rounded to fp16 for xh, fp32 accumulation, fp16 output transform and fp16 bias add.
    Returns:
      float32 [..., n] (exact=False) or float16 [..., n] (exact=True).
    """
    w_hat = decode_trellis(trellis, codebook)
    k, n = w_hat.shape[-2:]
    if x.shape[-1] != k:
        raise ValueError(f"input last axis {x.shape[-1]} != padded in_features {k}")
    if exact:
        x16 = jnp.asarray(x).astype(jnp.float16) * jnp.asarray(suh, jnp.float16)
        xh = hadamard128(x16, exact=True).astype(jnp.float16)
        y = jnp.matmul(xh.astype(jnp.float32), w_hat.astype(jnp.float32), precision=_HIGHEST)
        y = hadamard128(y, exact=True).astype(jnp.float16) * jnp.asarray(svh, jnp.float16)
        return y if bias is None else y + jnp.asarray(bias, jnp.float16)
    xs = jnp.asarray(x, jnp.float32) * jnp.asarray(suh, jnp.float32)
    xh = hadamard128(xs)                                                     # [..., k]
    y = jnp.matmul(xh, w_hat.astype(jnp.float32), precision=_HIGHEST)       # [..., n]
    y = hadamard128(y) * jnp.asarray(svh, jnp.float32)
    return y if bias is None else y + jnp.asarray(bias, jnp.float32)
