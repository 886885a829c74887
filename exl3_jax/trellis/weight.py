"""The one weight type of exl3-jax: an EXL3 linear as a JAX pytree.

Every layer above (nn, ops, ffi kernels, parallel, quant) takes ``Exl3Weight``. Array leaves are
the native checkpoint tensors, unchanged (no repacking at load); everything that decides shapes,
plans or kernels is static metadata, so a jitted function recompiles only when it changes.
Stacked experts use the same type with leading axes on every leaf ([E, k/16, n/16, W], [E, k], ...).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from ..format import spec


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Exl3Weight:
    """One EXL3 linear (or a stack of them along leading axes).

    Leaves:
      trellis: int16 [..., k/16, n/16, W] packed trellis (W = 16K, or 24/40/56 for half rates).
      suh: float16 [..., k] input-channel sign x scale.
      svh: float16 [..., n] output-channel sign x scale.
      bias: float16 [..., n] or None.
    Static:
      codebook: "3inst" | "mcg" | "mul1".
      K: bits per weight (1..8, or 1.5/2.5/3.5 with mul1).
      in_features, out_features: logical sizes before padding (<= k, n).
    The padded k, n come from the trellis shape (``.k``, ``.n``).
    """
    trellis: Any
    suh: Any
    svh: Any
    bias: Any
    codebook: str = dataclasses.field(metadata=dict(static=True))
    K: float = dataclasses.field(metadata=dict(static=True))
    in_features: int = dataclasses.field(metadata=dict(static=True))
    out_features: int = dataclasses.field(metadata=dict(static=True))

    @property
    def k(self) -> int:
        return int(self.trellis.shape[-3]) * spec.TILE

    @property
    def n(self) -> int:
        return int(self.trellis.shape[-2]) * spec.TILE

    @property
    def stack_shape(self) -> tuple[int, ...]:
        """Leading (expert) axes shared by all leaves; () for a single linear."""
        return tuple(self.trellis.shape[:-3])

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized leaves (what a decode kernel streams)."""
        return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                   for x in (self.trellis, self.suh, self.svh, self.bias) if x is not None)

    @classmethod
    def create(cls, trellis, suh, svh, codebook: str, bias=None, *, in_features: int | None = None,
               out_features: int | None = None) -> "Exl3Weight":
        """Validate and build. Shapes/dtypes follow the checkpoint rules (spec 1.3); logical sizes
        default to the padded ones."""
        if codebook not in spec.CODEBOOKS:
            raise ValueError(f"unknown codebook {codebook!r}; expected one of {spec.CODEBOOKS}")
        lead = tuple(trellis.shape[:-3])
        descs = {"trellis": _desc(trellis, 3), "suh": _desc(suh, 1), "svh": _desc(svh, 1)}
        if bias is not None:
            descs["bias"] = _desc(bias, 1)
        if codebook != "3inst":
            descs[codebook] = spec.TensorDesc((), "I32")
        for name, x in (("suh", suh), ("svh", svh), ("bias", bias)):
            if x is not None and tuple(x.shape[:-1]) != lead:
                raise spec.TensorShapeError(f"{name} leading axes {tuple(x.shape[:-1])} differ "
                                            f"from the trellis' {lead}", tensor=name)
        info = spec.check_linear("weight", descs)
        in_features = info.k if in_features is None else int(in_features)
        out_features = info.n if out_features is None else int(out_features)
        if not (0 < in_features <= info.k and 0 < out_features <= info.n):
            raise ValueError(f"logical size ({in_features}, {out_features}) exceeds the padded "
                             f"({info.k}, {info.n})")
        return cls(trellis=trellis, suh=suh, svh=svh, bias=bias, codebook=info.codebook,
                   K=info.K, in_features=in_features, out_features=out_features)

    @classmethod
    def from_checkpoint(cls, ckpt, key: str, *, in_features: int | None = None,
                        out_features: int | None = None, as_jax: bool = True) -> "Exl3Weight":
        """Load one EXL3 linear of an ``exl3_jax.format.Exl3Checkpoint`` (native tensors, no
        repacking; legacy su/sv already expanded by the reader)."""
        arrays = ckpt.read_linear(key)
        if as_jax:
            import jax.numpy as jnp
            arrays = {k: (None if v is None else jnp.asarray(v)) for k, v in arrays.items()}
        return cls.create(arrays["trellis"], arrays["suh"], arrays["svh"],
                          ckpt.linears[key].codebook, arrays["bias"], in_features=in_features,
                          out_features=out_features)


def _desc(x, trailing: int) -> spec.TensorDesc:
    """Descriptor of the per-linear part of ``x``: its last ``trailing`` axes."""
    names = {"int16": "I16", "float16": "F16", "float32": "F32", "bfloat16": "BF16"}
    dt = np.dtype(x.dtype).name
    return spec.TensorDesc(tuple(int(d) for d in x.shape[len(x.shape) - trailing:]),
                           names.get(dt, dt))
