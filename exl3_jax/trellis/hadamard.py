"""Block Hadamard transforms of size 128 on the last axis (spec 4.1, 4.2)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..format.spec import HADAMARD_BLOCK

# fp32(0.088388347648) = 0x3DB504F3: the reference kernel's 1/sqrt(128) (spec 4.2 step 3).
HADAMARD_SCALE_F32 = np.uint32(0x3DB504F3).view(np.float32)


@functools.lru_cache(maxsize=None)
def hadamard_matrix(size: int = HADAMARD_BLOCK) -> np.ndarray:
    """Natural-order Sylvester matrix H[i, j] = (-1)^popcount(i & j) / sqrt(size), float32."""
    i = np.arange(size)
    bits = np.bitwise_and(i[:, None], i[None, :])
    parity = np.zeros_like(bits)
    while bits.any():
        parity ^= bits & 1
        bits >>= 1
    h = np.where(parity == 1, -1.0, 1.0) / np.sqrt(size)
    h = h.astype(np.float32)
    h.setflags(write=False)
    return h


def fwht_butterflies(x):
    """Unnormalised radix-2 Walsh-Hadamard transform over the last axis (a power of two).

    Stages on index bits 0, 1, 2, ...; lo' = lo + hi, hi' = lo - hi in x's float dtype: the
    reference kernels' order, so with fp32 input the roundings match them exactly.
    """
    *lead, size = x.shape
    h = 1
    while h < size:
        y = x.reshape(*lead, size // (2 * h), 2, h)
        lo, hi = y[..., 0, :], y[..., 1, :]
        x = jnp.stack([lo + hi, lo - hi], axis=-2).reshape(*lead, size)
        h *= 2
    return x


def hadamard128(x, exact: bool = False):
    """Apply H128 to every contiguous 128-block of the last axis: y[.., 128b+j] = sum_i x[.., 128b+i] H[i, j].

    Args:
      x: float [..., d] with d a multiple of 128.
      exact: False: one fp32 matmul per block against H128 (HIGHEST precision).
        True: the reference kernel's arithmetic (spec 4.2 steps 2-3): fp32 butterflies in its
        stage order, then one multiply by fp32 0x3DB504F3; bit-exact with exllamav3's had_r_128
        given the same fp32 input (for an fp16 kernel output, round the result to fp16).
    Returns:
      float32 [..., d].
    """
    x = jnp.asarray(x)
    d = x.shape[-1]
    if d % HADAMARD_BLOCK:
        raise ValueError(f"last axis {d} is not a multiple of {HADAMARD_BLOCK}")
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], d // HADAMARD_BLOCK, HADAMARD_BLOCK)
    if exact:
        y = fwht_butterflies(blocks) * HADAMARD_SCALE_F32
    else:
        y = jnp.matmul(blocks, jnp.asarray(hadamard_matrix()), precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape)
