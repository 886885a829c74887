"""Linear layers: ``Exl3Linear`` (trellis-quantized), ``Linear`` (plain) and ``Embedding``.

Both linears map [..., in_features] -> [..., out_features] and return the activation dtype of
their input. ``Exl3Linear`` always goes through ``exl3_jax.ops.trellis_matmul`` unless a
dequantized copy was cached (``cache_dequantized``), which is the CPU reference shortcut: the same
y = x @ W with W decoded once at load instead of every call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from .. import ops
from ..trellis import Exl3Weight, dequantize

_HIGHEST = jax.lax.Precision.HIGHEST


@jax.jit
def _dequantize_weight(weight: Exl3Weight):
    """float32 [..., k, n] original-basis W of an Exl3Weight (stacks allowed)."""
    return dequantize(weight.trellis, weight.suh, weight.svh, weight.codebook)


def dequantize_weight(weight: Exl3Weight):
    """float32 [..., k, n]: W with y = x @ W (padded shape; trim with in/out_features)."""
    return _dequantize_weight(weight)


def _add_bias(y, weight: Exl3Weight):
    if weight.bias is None:
        return y
    return y + weight.bias[:weight.out_features].astype(jnp.float32)


def exl3_forward(x, weight: Exl3Weight, dense=None):
    """y = x @ W (+ bias) for one EXL3 linear under the numerics policy (see ``numerics``).

    Args:
      x: float [..., d], in_features <= d <= k; bf16 or fp32.
      weight: Exl3Weight without stack axes.
      dense: optional cached float32 [k, n] dequantized W (the CPU reference shortcut).
    Returns:
      float32 [..., out_features].
    """
    if dense is None:
        return ops.trellis_matmul(x, weight)
    xp = ops.pad_input(x.astype(jnp.float32), weight.k)
    y = jnp.einsum("...k,kn->...n", xp, dense, precision=_HIGHEST)[..., :weight.out_features]
    return _add_bias(y, weight)


def project(x, linears):
    """[linear(x) for linear in linears] in x's dtype; EXL3 linears without a dequantized cache
    run as one group (``ops.trellis_matmul_group``: one set of GPU launches for q/k/v or
    gate/up)."""
    if len(linears) > 1 and all(isinstance(lin, Exl3Linear) and lin.dense is None
                                for lin in linears):
        ys = ops.trellis_matmul_group(x, [lin.weight for lin in linears])
        return [y.astype(x.dtype) for y in ys]
    return [lin(x) for lin in linears]


class Exl3Linear(nnx.Module):
    """A trellis-quantized linear holding one ``Exl3Weight`` (native checkpoint tensors)."""

    def __init__(self, weight: Exl3Weight):
        if weight.stack_shape:
            raise ValueError(f"Exl3Linear takes one linear, got stack axes {weight.stack_shape}")
        self.weight = nnx.data(weight)
        self.dense = nnx.data(None)

    @property
    def in_features(self) -> int:
        return self.weight.in_features

    @property
    def out_features(self) -> int:
        return self.weight.out_features

    def cache_dequantized(self) -> None:
        """Decode W once and keep it (float32 [k, n]); later calls skip the trellis decode."""
        self.dense = nnx.data(dequantize_weight(self.weight))

    def __call__(self, x):
        """x: [..., d] (in_features <= d <= k) -> [..., out_features] in x's dtype."""
        return exl3_forward(x, self.weight, self.dense).astype(x.dtype)


def dot_f32(spec: str, x, w):
    """float32 einsum(spec, x, w) of an activation x and a plain weight w, exact products.

    x and w of one 16-bit float dtype go into the dot as they are, accumulating in fp32 (their
    products are exact in fp32, so this is the fp32 product up to summation order, at 16-bit
    operand traffic); any other pair is cast to fp32 and multiplied at Precision.HIGHEST."""
    if x.dtype == w.dtype and x.dtype in (jnp.float16, jnp.bfloat16):
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32)
    return jnp.einsum(spec, x.astype(jnp.float32), w.astype(jnp.float32), precision=_HIGHEST)


class Linear(nnx.Module):
    """An unquantized linear, y = x @ w (+ b), stored as w [in, out] (HF weight transposed)."""

    def __init__(self, w, b=None):
        self.w = nnx.Param(jnp.asarray(w))
        self.b = nnx.Param(jnp.asarray(b)) if b is not None else nnx.data(None)

    @property
    def in_features(self) -> int:
        return int(self.w.shape[0])

    @property
    def out_features(self) -> int:
        return int(self.w.shape[1])

    @classmethod
    def from_hf(cls, weight, bias=None) -> "Linear":
        """From an HF-orientation weight [out, in] (and bias [out])."""
        return cls(jnp.asarray(weight).T, bias)

    def forward_f32(self, x):
        """float32 [..., out]; inputs narrower than in_features are not allowed."""
        y = dot_f32("...i,io->...o", x, self.w[...])
        if self.b is not None:
            y = y + self.b[...].astype(jnp.float32)
        return y

    def __call__(self, x):
        return self.forward_f32(x).astype(x.dtype)


class Embedding(nnx.Module):
    """Token embedding table [vocab, hidden] (never quantized in EXL3, spec 1.6)."""

    def __init__(self, table):
        self.table = nnx.Param(jnp.asarray(table))

    def __call__(self, tokens, dtype):
        """tokens int [...] -> dtype [..., hidden]."""
        return jnp.take(self.table[...], tokens, axis=0).astype(dtype)

    def attend(self, x):
        """Tied head: float32 logits [..., vocab] = x @ table.T."""
        return jnp.einsum("...h,vh->...v", x.astype(jnp.float32),
                          self.table[...].astype(jnp.float32), precision=_HIGHEST)
