"""The dispatch point of the Trellis GEMM: y = x @ W for an ``Exl3Weight``.

Models call ``trellis_matmul`` (one linear) or ``trellis_matmul_group`` (linears that read the
same input, such as q/k/v) and nothing else; they pick the backend (the jax.numpy reference, or a
GPU kernel from ``exl3_jax.ffi`` when one is available) at trace time.

Numerics at the fp16 boundary (nn.numerics states the policy): fp32 inputs are computed in fp32 by
the reference backend; other dtypes reach it as fp16 operands with a per-row power-of-two scale
(``fp16_operand``), multiplied back before the bias. The GPU kernels take fp16 operands after
the input rotation and scale each row themselves (ffi/hadamard.py), so the GPU backend takes x
in any float dtype with no XLA work around the call.

Backend choice, in order: the ``backend=`` argument, the ``EXL3_JAX_BACKEND`` environment variable
("auto", "reference", "gpu"), then "auto" (the GPU kernel on a CUDA device, else the reference).
"""

from __future__ import annotations

import math
import os

import jax
import jax.numpy as jnp
import numpy as np

from ..trellis import Exl3Weight, linear_reference

F16_MAX = 65504.0
BACKENDS = ("auto", "reference", "gpu")
BACKEND_ENV = "EXL3_JAX_BACKEND"


def resolve_backend(backend: str | None = None) -> str:
    """'reference' or 'gpu' for this call (decided at trace time, from static information)."""
    choice = backend or os.environ.get(BACKEND_ENV, "auto") or "auto"
    if choice not in BACKENDS:
        raise ValueError(f"unknown backend {choice!r} (from "
                         f"{'argument' if backend else BACKEND_ENV}); use one of {BACKENDS}")
    if choice == "auto":
        return "gpu" if gpu_kernels_available() else "reference"   # checks for a CUDA backend
    return choice


def gpu_kernels_available() -> bool:
    """True when the CuTe DSL Trellis GEMM can be used in this process."""
    try:
        from ..ffi import trellis_gemm  # noqa: F401  (provided by the GPU kernel work)
    except ImportError:
        return False
    return trellis_gemm.available()


def pad_input(x, k: int):
    """Zero-extend the last axis of x to the padded in_features k (exact: padded rows see 0)."""
    d = x.shape[-1]
    if d > k:
        raise ValueError(f"input last axis {d} exceeds the weight's padded in_features {k}")
    if d == k:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, k - d)])


def fp16_operand(x):
    """Bring activations into the fp16 range by per-row power-of-two scaling.

    Args:
      x: float [..., d] (bf16 or fp32).
    Returns:
      (x16 float16 [..., d], scale float32 [..., 1]) with x == x16 * scale for every in-range value
      (exactly for bf16 inputs in the fp16 normal range); scale is the smallest power of two
      >= max|x| / 65504 of the row, at least 1.
    """
    xf = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(xf), axis=-1, keepdims=True)
    ratio = jnp.maximum(amax / np.float32(F16_MAX), np.float32(1.0))
    scale = jnp.exp2(jnp.ceil(jnp.log2(ratio)))
    x16 = jnp.clip(xf / scale, -F16_MAX, F16_MAX).astype(jnp.float16)
    return x16, scale


def _reference_matmul(x, weight: Exl3Weight):
    """linear_reference under the numerics policy (fp32 as is, else a scaled fp16 operand)."""
    if x.dtype == jnp.float32:
        return linear_reference(x, weight.trellis, weight.suh, weight.svh, weight.codebook,
                                weight.bias)
    x16, scale = fp16_operand(x)
    y = linear_reference(x16, weight.trellis, weight.suh, weight.svh, weight.codebook) * scale
    return y if weight.bias is None else y + weight.bias.astype(jnp.float32)


def trellis_matmul(x, weight: Exl3Weight, *, backend: str | None = None):
    """y = x @ W (+ bias) for one EXL3 linear, output trimmed to its logical out_features.

    Args:
      x: float [..., d] with in_features <= d <= k (narrower inputs are zero-extended); fp32,
        or bf16 / fp16 (the fp16 boundary: module docstring).
      weight: an ``Exl3Weight`` without stack axes.
    Returns:
      float32 [..., out_features] (callers cast to their activation dtype).
    """
    if weight.stack_shape:
        raise ValueError(f"trellis_matmul takes one linear; got stack axes {weight.stack_shape}")
    x = pad_input(x, weight.k)
    if resolve_backend(backend) == "gpu":
        from ..ffi import trellis_gemm
        y = trellis_gemm.trellis_matmul_gpu(x, weight)
    else:
        y = _reference_matmul(x, weight)
    return y[..., :weight.out_features]


def trellis_matmul_group(x, weights, *, backend: str | None = None):
    """[x @ W_i (+ bias_i)] for linears that read the same x (q/k/v, gate/up).

    On the GPU, members with one padded k, K and codebook at a decode-plan m run as one group:
    one input transform, one decode launch and one output transform instead of three launches
    each (a decode step is launch-bound: bench/NOTES.md). Otherwise, and on the reference
    backend, each member is one ``trellis_matmul``.

    Args:
      x: float [..., d] (d <= every member's padded k).
      weights: sequence of ``Exl3Weight`` without stack axes.
    Returns:
      list of float32 [..., out_features_i].
    """
    weights = list(weights)
    if resolve_backend(backend) == "gpu" and len({w.k for w in weights}) == 1:
        from ..ffi import trellis_gemm
        xp = pad_input(x, weights[0].k)
        m = math.prod(xp.shape[:-1])
        if m and not any(w.stack_shape for w in weights) and \
                trellis_gemm.group_supported(weights, m):
            ys = trellis_gemm.trellis_matmul_group_gpu(xp, weights)
            return [y[..., :w.out_features] for y, w in zip(ys, weights)]
    return [trellis_matmul(x, w, backend=backend) for w in weights]
