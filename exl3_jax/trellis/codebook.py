"""The three EXL3 codebooks: a 16-bit trellis state -> one float16 weight (spec section 3).

All integer arithmetic is uint32 modulo 2^32; the only float rounding is one round-to-nearest-even
to float16, which the fp32 emulations below reproduce bit-exactly (spec 3.1, 3.3).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from ..format.spec import CODEBOOKS, MCG_MULTIPLIER, MUL1_MULTIPLIER

THREEINST_MULTIPLIER = 89226354
THREEINST_ADDEND = 64248484
LOP3_AND = 0x8FFF8FFF          # forces each fp16 half's exponent into 0b011xx
LOP3_XOR = 0x3B603B60
MUL1_K_INV = np.float16(np.uint16(0x1EEE).view(np.float16))     # 1774 * 2^-18
MUL1_K_BIAS = np.float16(np.uint16(0xC931).view(np.float16))    # -1329 * 2^-7
# mul1 as an affine map of an integer: value = k_inv * (h - MUL1_CENTER) + MUL1_RESIDUAL with
# h = 1024 + bytesum (fp16 0x6400 + bytesum); MUL1_CENTER is the integer nearest -k_bias / k_inv
# (fp16-exact), so h - MUL1_CENTER lies in [-510, 510] and the residual is small, exact in fp32:
# k_bias + 1534 * k_inv = -476 * 2^-18. The GPU split-pair kernels multiply h - MUL1_CENTER.
MUL1_CENTER = 1534
MUL1_RESIDUAL = np.float32(-476 * 2.0**-18)


def check_codebook(codebook: str) -> str:
    if codebook not in CODEBOOKS:
        raise ValueError(f"unknown codebook {codebook!r}; expected one of {CODEBOOKS}")
    return codebook


def _u32(value: int):
    return np.uint32(value)


def _two_halves_sum(x):
    """fp16(lo16) + fp16(hi16) in fp32, exact (both exponents lie in 0b011xx); its one rounding
    to fp16 is the weight (spec 3.1)."""
    lo = lax.bitcast_convert_type((x & _u32(0xFFFF)).astype(jnp.uint16), jnp.float16)
    hi = lax.bitcast_convert_type((x >> _u32(16)).astype(jnp.uint16), jnp.float16)
    return lo.astype(jnp.float32) + hi.astype(jnp.float32)


def decode_states(states, codebook: str, *, unrounded: bool = False):
    """Decode 16-bit trellis states to weights.

    Args:
      states: integer array [...] (only the low 16 bits are used).
      codebook: "3inst", "mcg" or "mul1".
      unrounded: return the value before its one fp16 rounding (exact in fp32), what the GPU
        decode kernels' split pairs multiply (the MMA sums the two fp16 halves in fp32).
    Returns:
      float16 [...], bit-exact with exllamav3's decoders (float32 if ``unrounded``).
    """
    check_codebook(codebook)
    s = jnp.asarray(states).astype(jnp.uint32) & _u32(0xFFFF)
    if codebook == "mul1":
        x = s * _u32(MUL1_MULTIPLIER)
        byte_sum = ((x & _u32(0xFF)) + ((x >> _u32(8)) & _u32(0xFF))
                    + ((x >> _u32(16)) & _u32(0xFF)) + (x >> _u32(24)))
        h = (byte_sum + _u32(1024)).astype(jnp.float32)       # fp16(0x6400 + s) = 1024 + s
        # h * k_inv has <= 22 significant bits and the sum is a multiple of 2^-18 below 2^4,
        # so both fp32 steps are exact and the one fp16 rounding equals the kernel's fp16 FMA.
        value = h * np.float32(MUL1_K_INV) + np.float32(MUL1_K_BIAS)
        return value if unrounded else value.astype(jnp.float16)
    if codebook == "mcg":
        x = s * _u32(MCG_MULTIPLIER)
    else:
        x = s * _u32(THREEINST_MULTIPLIER) + _u32(THREEINST_ADDEND)
    x = (x & _u32(LOP3_AND)) ^ _u32(LOP3_XOR)
    value = _two_halves_sum(x)
    return value if unrounded else value.astype(jnp.float16)


def codebook_table(codebook: str):
    """All 65,536 decoded values of a codebook, float16 [65536] (index = state)."""
    return decode_states(jnp.arange(1 << 16, dtype=jnp.uint32), codebook)
