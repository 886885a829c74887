"""Numerics policy of the model graph (activations, the fp16 kernel boundary).

Policy:
* Activations (residual stream, attention/MLP inputs and outputs, KV cache) are bf16 by default;
  ``"float32"`` is the exact mode the tests compare against dequantized fp32 weights.
* Norms, softmax, RoPE, routing and logits are computed in fp32 and cast back to the activation
  dtype; logits stay fp32.
* EXL3 kernels take fp16 operands. At that boundary an activation row whose magnitude exceeds
  the fp16 range is **scaled, not clamped**: the row is divided by a power of two s (s = 1 for
  rows in range), cast to fp16, multiplied by the weight, and the fp32 result multiplied by ``s``
  before the bias is added. Because the scale is a power of two and the op is linear, in-range
  values are untouched and out-of-range rows keep their direction instead of saturating to
  +-inf. Values below the fp16 normal range (6.1e-5 * s) become fp16 subnormals (or 0), which is
  negligible next to the rest of the row. Non-finite inputs stay non-finite. Where the scaling
  happens:
  - reference backend: ``ops.fp16_operand`` before the call, ``s = 2^ceil(log2(max|x| /
    65504))`` (the MoE reference backends reach it through ``ops.trellis_matmul`` or compute
    in fp32);
  - GPU Trellis GEMM and GPU MoE: inside their Hadamard kernels, on the operand the GEMM
    really takes (the rotated ``x * suh``, up to sqrt(128) * max|x * suh|): ``s`` is the
    smallest power of two with ``max|x * suh| / s <= 4096`` (ffi/hadamard.py), per row and
    projection plane for FC1 and per route row for FC2's input ``silu(g) * u * suh``
    (ffi/trellis_moe.py); no XLA op runs around the call.
* In float32 mode the operand is passed as fp32 (the reference backend computes in fp32), so the
  EXL3 forward equals the dequantized-weight forward to fp32 rounding.
"""

from __future__ import annotations

import jax.numpy as jnp

from ..ops.trellis_matmul import F16_MAX, fp16_operand

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


__all__ = ["ACTIVATION_DTYPES", "F16_MAX", "fp16_operand", "resolve_dtype"]
