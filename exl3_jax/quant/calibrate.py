"""Hessian capture by running the model layer by layer on calibration text (spec 6.1).

``ModelCalibration`` is the ``HessianProvider`` of ``convert_hf``: for each decoder layer it runs
the layer (whose earlier layers are already quantized) on the current hidden states, records the
inputs of its linears and hands out H = sum x^T x per linear; once the layer's linears are
quantized it swaps them in and re-runs the layer to advance the hidden states, so later layers
calibrate on what the quantized model actually produces (GPTQ-style sequential quantization).
Linears that share an input share one H (q/k/v; gate/up). MoE experts fall back to no Hessian.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

import jax.numpy as jnp
import numpy as np

from ..nn import Exl3Linear, Linear, advance
from ..trellis.weight import Exl3Weight

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def calibration_rows(ids: Sequence[int], seq_len: int) -> np.ndarray:
    """Cut a token stream into full rows: int32 [rows, seq_len] (a short tail is dropped)."""
    rows = len(ids) // seq_len
    if rows == 0:
        raise ValueError(f"calibration text has {len(ids)} tokens, fewer than one row of "
                         f"{seq_len}")
    return np.asarray(ids[:rows * seq_len], np.int32).reshape(rows, seq_len)


class _Recorder:
    """Stands in for a linear during a capture run: records its input (the array itself, so
    linears fed the same array are recognised as sharing it), then calls it."""

    def __init__(self, inner, sink: list):
        self.inner, self.sink = inner, sink

    def __call__(self, x):
        self.sink.append(x)
        return self.inner(x)


def input_hessian(chunks: list) -> tuple[np.ndarray, int]:
    """H = sum x^T x (float64 accumulation, stored float32) over the rows of the recorded inputs
    [..., k], and the row count; rows with inf/nan are dropped."""
    x = np.concatenate([np.asarray(c, np.float32).reshape(-1, c.shape[-1]) for c in chunks])
    x = x.astype(np.float64)
    x = x[np.all(np.isfinite(x), axis=1)]
    return (x.T @ x).astype(np.float32), int(x.shape[0])


def _resolve(module, path: str):
    parent_path, _, attr = path.rpartition(".")
    parent = module
    for part in parent_path.split(".") if parent_path else []:
        parent = getattr(parent, part)
    return parent, attr


class ModelCalibration:
    """HessianProvider backed by an unquantized ``CausalLM`` (models.decoder.load_model).

    Args:
      model: the unquantized model in float32 (its linears are replaced in place as layers get
        quantized, so pass a model used only for calibration).
      tokens: int [rows, seq_len] calibration token rows (see ``calibration_rows``).
    """

    def __init__(self, model, tokens: np.ndarray):
        self.model = model
        tokens = jnp.asarray(tokens, jnp.int32)
        cache = model.init_cache(tokens.shape[0], tokens.shape[1])
        self._write_slot = cache.slot
        self._positions, self._mask, _ = advance(cache, jnp.ones(tokens.shape, bool))
        self._cache = cache
        self._x = model.embed_tokens(tokens, "float32")        # [rows, T, H]
        self._hessians: dict[str, tuple[np.ndarray, int]] = {}
        self._captured_layer = -1
        self.rows = int(tokens.size)

    def _run_layer(self, i: int, capture: dict[str, list] | None = None):
        layer = self.model.layers[i]
        swapped = []
        if capture is not None:
            for path, sink in capture.items():
                parent, attr = _resolve(layer, path)
                swapped.append((parent, attr, getattr(parent, attr)))
                object.__setattr__(parent, attr, _Recorder(getattr(parent, attr), sink))
        try:
            x, _, _ = layer(self._x, self._positions, self._mask, self._cache.k[i],
                            self._cache.v[i], self._write_slot)
        finally:
            for parent, attr, inner in swapped:
                object.__setattr__(parent, attr, inner)
        return x

    def _linear_paths(self, i: int) -> list[str]:
        layer = self.model.layers[i]
        paths = []
        for block in ("self_attn", "mlp"):
            sub = getattr(layer, block, None)
            for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                         "down_proj"):
                if isinstance(getattr(sub, name, None), (Linear, Exl3Linear)):
                    paths.append(f"{block}.{name}")
        return paths

    def _capture(self, i: int) -> None:
        sinks = {path: [] for path in self._linear_paths(i)}
        self._run_layer(i, sinks)
        computed: list[tuple[list, tuple[np.ndarray, int]]] = []
        for path, chunks in sinks.items():
            # q/k/v (and gate/up) are called on the same array: one H for all of them
            h = next((h for seen, h in computed if len(seen) == len(chunks)
                      and all(a is b for a, b in zip(seen, chunks))), None)
            if h is None:
                h = input_hessian(chunks)
                computed.append((chunks, h))
            self._hessians[f"model.layers.{i}.{path}"] = h
        self._captured_layer = i

    def hessian(self, key: str) -> tuple[np.ndarray, int] | None:
        if key == "lm_head":
            h = np.asarray(self.model.norm(self._x), np.float64).reshape(-1, self._x.shape[-1])
            return (h.T @ h).astype(np.float32), int(h.shape[0])
        m = LAYER_KEY.match(key)
        if m is None:
            return None
        i = int(m.group(1))
        if i != self._captured_layer:
            self._capture(i)
        return self._hessians.get(key)

    def layer_done(self, layer: int, quantized: dict[str, Exl3Weight]) -> None:
        block = self.model.layers[layer]
        for key, weight in quantized.items():
            m = LAYER_KEY.match(key)
            if m is None or int(m.group(1)) != layer:
                continue
            try:
                parent, attr = _resolve(block, m.group(2))
                old = getattr(parent, attr)
            except AttributeError:
                continue                          # e.g. MoE experts, quantized by the fallback
            if isinstance(old, (Linear, Exl3Linear)):
                new = Exl3Linear(weight)
                new.cache_dequantized()
                setattr(parent, attr, new)
        self._x = self._run_layer(layer)
        self._hessians = {k: v for k, v in self._hessians.items()
                          if not k.startswith(f"model.layers.{layer}.")}


def load_calibration(source: str | Path, text: str, *, seq_len: int = 256) -> ModelCalibration:
    """A ModelCalibration for an HF-layout model directory and a calibration text."""
    from tokenizers import Tokenizer

    from ..models.decoder import load_model

    source = Path(source)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    ids = tok.encode(text).ids
    model = load_model(source, dtype="float32")
    return ModelCalibration(model, calibration_rows(ids, seq_len))
