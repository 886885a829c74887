"""Where a model's tensors come from: an EXL3 checkpoint or an unquantized HF directory.

``WeightSource`` hands out ready modules (``Exl3Linear`` for EXL3 linears, ``Linear`` for plain
ones) and plain tensors, checking every shape against the config so a mismatch names the tensor.
"""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np

from exl3_jax.format import (Exl3Checkpoint, Exl3FormatError, MissingTensorError, TensorShapeError,
                             TensorStore, read_json)
from exl3_jax.nn import Exl3Linear, Linear
from exl3_jax.ops.moe import stack_experts, stack_layout
from exl3_jax.trellis import Exl3Weight

PAD = 128


def _padded(d: int) -> int:
    return -(-d // PAD) * PAD


class WeightSource:
    """Tensors of one model directory. ``quantized`` tells which kind it is."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.config_path = self.directory / "config.json"
        config = read_json(self.config_path)
        if not isinstance(config, dict):
            raise Exl3FormatError("config.json must hold a JSON object", file=self.config_path)
        self.config = config
        self.quantized = isinstance(config.get("quantization_config"), dict)
        if self.quantized:
            self.ckpt = Exl3Checkpoint(self.directory)
            self.store = self.ckpt.store
            if self.ckpt.embeddings:
                raise NotImplementedError(
                    f"trellis-quantized embeddings ({sorted(self.ckpt.embeddings)}) are not "
                    f"supported yet")
        else:
            self.ckpt = None
            self.store = TensorStore(self.directory)

    # -- plain tensors ------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self.store

    def is_exl3(self, key: str) -> bool:
        return self.ckpt is not None and key in self.ckpt.linears

    def tensor(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        """A plain tensor with the expected shape (else TensorShapeError naming it)."""
        if name not in self.store:
            raise MissingTensorError("required tensor is missing", file=self.directory,
                                     tensor=name)
        desc = self.store.desc(name)
        if tuple(desc.shape) != tuple(shape):
            raise TensorShapeError(f"shape {list(desc.shape)} does not match the config's "
                                   f"{list(shape)}", file=self.store.file_of(name), tensor=name)
        return self.store.read(name)

    # -- linears ------------------------------------------------------------------------------

    def exl3_weight(self, key: str, in_features: int, out_features: int) -> Exl3Weight:
        info = self.ckpt.linears[key]
        if (info.k, info.n) != (_padded(in_features), _padded(out_features)):
            raise TensorShapeError(
                f"EXL3 linear is {info.k} x {info.n} (in x out) but the config implies "
                f"{in_features} x {out_features}, padded {_padded(in_features)} x "
                f"{_padded(out_features)}", file=self.store.file_of(f"{key}.trellis"),
                tensor=f"{key}.trellis")
        return Exl3Weight.from_checkpoint(self.ckpt, key, in_features=in_features,
                                          out_features=out_features)

    def linear(self, key: str, in_features: int, out_features: int, *,
               bias: bool = False, dtype=jnp.float32):
        """An Exl3Linear when ``key`` is an EXL3 linear, else a plain Linear from
        ``key.weight`` [out, in] (and ``key.bias`` [out] when ``bias``)."""
        if self.is_exl3(key):
            w = self.exl3_weight(key, in_features, out_features)
            if bias and w.bias is None:
                raise MissingTensorError("the config asks for a bias but the EXL3 linear has "
                                         "none", file=self.directory, tensor=f"{key}.bias")
            return Exl3Linear(w)
        if f"{key}.weight" not in self.store:
            what = "an EXL3 linear (key.trellis/suh/svh) or " if self.quantized else ""
            raise MissingTensorError(f"expected {what}a plain weight", file=self.directory,
                                     tensor=f"{key}.weight")
        w = self.tensor(f"{key}.weight", (out_features, in_features))
        b = self.tensor(f"{key}.bias", (out_features,)) if bias else None
        return Linear(jnp.asarray(w, dtype).T, None if b is None else jnp.asarray(b, dtype))

    def expert_stack(self, keys: list[str], in_features: int, out_features: int):
        """Experts ``keys`` of one projection (``nn.routed_experts`` builds the layer from the
        three projections).

        Returns a stacked Exl3Weight [E] when all experts share K, codebook and bias presence
        (spec 5.1; the single-tier layout), else the E single Exl3Weights in order (mixed-K
        layers, grouped into (K, codebook) tiers by ``ops.expert_tiers``); float32 [E, in, out]
        for plain experts."""
        for key in keys:
            if not self.is_exl3(key) and f"{key}.weight" not in self.store:
                raise MissingTensorError(
                    "expert weight is missing", file=self.directory,
                    tensor=f"{key}.trellis" if self.quantized else f"{key}.weight")
        if all(self.is_exl3(k) for k in keys):
            ws = [self.exl3_weight(k, in_features, out_features) for k in keys]
            if len({stack_layout(w) for w in ws}) == 1:
                return stack_experts(ws)
            return tuple(ws)
        mats = []
        for key in keys:
            if self.is_exl3(key):
                raise Exl3FormatError("expert stack mixes EXL3 and plain experts",
                                      file=self.directory, tensor=key)
            mats.append(np.asarray(self.tensor(f"{key}.weight", (out_features, in_features)),
                                   np.float32).T)
        return jnp.asarray(np.stack(mats))
