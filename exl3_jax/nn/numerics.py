"""Numerics policy of the model graph (activations, the fp16 kernel boundary).

Policy:
* Activations (residual stream, attention/MLP inputs and outputs, KV cache) are bf16 by default;
  ``"float32"`` is the exact mode the tests compare against dequantized fp32 weights.
* Norms, softmax, RoPE, routing and logits are computed in fp32 and cast back to the activation
  dtype; logits stay fp32.
* EXL3 kernels take fp16 operands. At that boundary a bf16 activation row whose magnitude exceeds
  the fp16 range (65504) is **scaled, not clamped**: each row is divided by a power of two
  ``s = 2^ceil(log2(amax / 65504))`` (s = 1 for rows already in range), cast to fp16, multiplied by
  the weight, and the fp32 result multiplied by ``s`` before the bias is added. Because the scale is
  a power of two and the op is linear, in-range values are untouched and out-of-range rows keep
  their direction instead of saturating to +-inf. bf16 values below the fp16 normal range (6.1e-5)
  become fp16 subnormals (or 0), which is negligible next to the rest of the row. Non-finite inputs
  stay non-finite.
* In float32 mode the operand is passed as fp32 (the reference backend computes in fp32), so the
  EXL3 forward equals the dequantized-weight forward to fp32 rounding.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

F16_MAX = 65504.0
ACTIVATION_DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def resolve_dtype(dtype) -> jnp.dtype:
    """The activation dtype for a name ("bfloat16", "float32") or dtype; anything else raises."""
    if isinstance(dtype, str):
        if dtype not in ACTIVATION_DTYPES:
            raise ValueError(f"unknown activation dtype {dtype!r}; use one of "
                             f"{sorted(ACTIVATION_DTYPES)}")
        return jnp.dtype(ACTIVATION_DTYPES[dtype])
    dt = jnp.dtype(dtype)
    if dt not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
        raise ValueError(f"unsupported activation dtype {dt}; use bfloat16 or float32")
    return dt


def fp16_operand(x):
    """Bring activations into the fp16 range of the EXL3 kernels by per-row power-of-two scaling.

    Args:
      x: float [..., d] (bf16 or fp32).
    Returns:
      (x16 float16 [..., d], scale float32 [..., 1]) with x == x16 * scale for every in-range value
      (exactly for bf16 inputs in the fp16 normal range).
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    ratio = jnp.maximum(amax / np.float32(F16_MAX), np.float32(1.0))
    scale = jnp.exp2(jnp.ceil(jnp.log2(ratio)))
    x16 = jnp.clip(xf / scale, -F16_MAX, F16_MAX).astype(jnp.float16)
    return x16, scale
