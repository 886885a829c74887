"""HF-layout safetensors model -> EXL3 checkpoint in exllamav3's layout (spec 1, 6.1).

What is quantized: every 2-D ``model.layers.N.<...>.<name>_proj.weight`` (attention q/k/v/o, MLP
gate/up/down, MoE experts' projections) at ``bits``, and ``lm_head`` at ``head_bits`` (loaded from
``model.embed_tokens.weight`` when the model ties them, and stored separately either way; 16 keeps
it fp16). Everything else (embeddings, norms, routers) is copied, fp32 -> fp16, bf16 kept.
Tokenizer and generation files are copied; config.json gets ``quantization_config`` and
``tie_word_embeddings = False``. The writer stages the directory and renames it on success, so an
interrupted conversion leaves nothing that looks like a checkpoint.

Calibration: the reference quantizes layer by layer with Hessians H = X^T X captured by running
the (partly quantized) model (spec 6.1). That needs the Flax model, so it is a plug-in: pass a
``HessianProvider``. Without one every linear uses the no-Hessian fallback (plain tile quantization
of the regularised weight).
"""

from __future__ import annotations

import dataclasses
import json
import re
import time
import zlib
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np

from ..format import Exl3Writer, TensorStore
from ..format.spec import TILE
from ..trellis.weight import Exl3Weight
from .ldlq import LinearInput, QuantizeInfo, padded, quantize_linears
from .regularize import estimate_search_tiles
from .viterbi import check_rate

LAYER_LINEAR = re.compile(r"^(?P<prefix>.*\blayers\.(?P<layer>\d+)\.)(?P<path>.*_proj)\.weight$")
EMBED_KEY = "model.embed_tokens.weight"
HEAD_KEY = "lm_head"
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model",
              "added_tokens.json", "chat_template.jinja", "chat_template.json",
              "preprocessor_config.json")
# linears that read the same input share a Hessian and the input sign flips (spec 6.1)
SHARED_INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in",
                "gate_proj": "mlp_in", "up_proj": "mlp_in", "w1": "mlp_in", "w3": "mlp_in"}


class HessianProvider(Protocol):
    """Calibration plug-in (spec 6.1), called in layer order.

    ``hessian(key)`` returns (sum of x^T x [in, in] float, row count) for the input of the linear
    ``key`` in the current (already partly quantized) model, or None for the fallback.
    ``layer_done(layer, quantized)`` is called after every linear of a layer is quantized, with
    key -> Exl3Weight, so the provider can advance its hidden states through the quantized layer.
    """

    def hessian(self, key: str) -> tuple[np.ndarray, int] | None: ...

    def layer_done(self, layer: int, quantized: dict[str, Exl3Weight]) -> None: ...


@dataclasses.dataclass(frozen=True)
class LinearJob:
    """One source linear to quantize: module key, source tensor name, layer (-1: head), K, the
    qmap (shared-input group) it belongs to, its logical (in, out) shape."""
    key: str
    source: str
    layer: int
    K: float
    qmap: str
    shape: tuple[int, int]

    @property
    def tiles(self) -> int:
        return (padded(self.shape[0]) // TILE) * (padded(self.shape[1]) // TILE)


def plan(store: TensorStore, bits: float, head_bits: float) -> tuple[list[LinearJob], list[str]]:
    """Split the source tensors into linears to quantize (layer order, then name order) and plain
    tensors to copy. Biases of quantized linears belong to their linear."""
    jobs, quantized_sources = [], set()
    for name in store.names():
        m = LAYER_LINEAR.match(name)
        if m is None or len(store.desc(name).shape) != 2:
            continue
        out_f, in_f = store.desc(name).shape
        key = name[:-len(".weight")]
        leaf = key.rpartition(".")[2]
        group = SHARED_INPUT.get(leaf, leaf)
        qmap = f"{m['prefix']}{m['path'].rpartition('.')[0]}.{group}"
        jobs.append(LinearJob(key, name, int(m["layer"]), bits, qmap, (in_f, out_f)))
        quantized_sources.update({name, f"{key}.bias"})
    jobs.sort(key=lambda j: (j.layer, _module_order(j.key), j.key))
    if head_bits != 16:
        source = "lm_head.weight" if "lm_head.weight" in store else EMBED_KEY
        if source not in store:
            raise ValueError("no lm_head.weight and no model.embed_tokens.weight to tie it to")
        out_f, in_f = store.desc(source).shape
        jobs.append(LinearJob(HEAD_KEY, source, -1, head_bits, HEAD_KEY, (in_f, out_f)))
        quantized_sources.add("lm_head.weight")
    plain = [n for n in store.names() if n not in quantized_sources]
    return jobs, plain


def _module_order(key: str) -> int:
    order = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    leaf = key.rpartition(".")[2]
    return order.index(leaf) if leaf in order else len(order)


def qmap_seed(seed: int, qmap: str) -> list[int]:
    """Per-qmap RNG seed: linears sharing an input get the same su signs (spec 6.2 step 3)."""
    return [seed, zlib.crc32(qmap.encode())]


def plain_tensor(arr: np.ndarray) -> np.ndarray:
    """fp32/fp64 -> fp16 (the reference's storage rule); bf16, fp16 and integers unchanged."""
    if arr.dtype in (np.float32, np.float64):
        return arr.astype(np.float16)
    return arr


def output_config(config: dict[str, Any]) -> dict[str, Any]:
    """config.json for the EXL3 directory: never re-tie the separately quantized head; a source
    quantization_config is kept as original_quantization_config (spec 1.2)."""
    out = dict(config)
    if "quantization_config" in out:
        out["original_quantization_config"] = out.pop("quantization_config")
    out["tie_word_embeddings"] = False
    return out


@dataclasses.dataclass
class LinearReport:
    """One quantized linear: its key, rate, logical (in, out) shape, what ``quantize_linears``
    reported, and the wall time of the group (the layer's linears at one rate) it was quantized
    in."""
    key: str
    K: float
    shape: tuple[int, int]
    info: QuantizeInfo
    group_seconds: float


class Progress(Protocol):
    def start(self, layers: int, tiles: int) -> None: ...
    def layer(self, name: str) -> None: ...
    def tiles(self, n: int) -> None: ...
    def finish(self) -> None: ...


class NullProgress:
    def start(self, layers, tiles): pass
    def layer(self, name): pass
    def tiles(self, n): pass
    def finish(self): pass


class RichProgress:
    """Two bars (layers; tiles with rate and ETA) on a terminal or in a notebook, via rich.

    Elsewhere (output piped to a log file or a CI job) rich draws no live bars, so each finished
    layer prints one line instead: layers and tiles done, elapsed time and ETA."""

    def __init__(self, console=None):
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                   TimeElapsedColumn, TimeRemainingColumn)
        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                             TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                             console=console)
        console = self._bar.console
        self._live = console.is_terminal or console.is_jupyter

    def start(self, layers, tiles):
        self._t0 = time.perf_counter()
        self._bar.start()
        self._layers = self._bar.add_task("layers", total=layers)
        self._tiles = self._bar.add_task("tiles ", total=tiles)

    def layer(self, name):
        self._bar.update(self._layers, advance=1, description=f"layers ({name})")
        if not self._live:
            layers, tiles = (self._bar.tasks[t] for t in (self._layers, self._tiles))
            elapsed = time.perf_counter() - self._t0
            eta = elapsed * (tiles.total - tiles.completed) / max(tiles.completed, 1)
            self._bar.console.print(
                f"layer {int(layers.completed)}/{int(layers.total)} ({name}): "
                f"{int(tiles.completed)}/{int(tiles.total)} tiles, {elapsed:.0f} s, "
                f"eta {eta:.0f} s", highlight=False)

    def tiles(self, n):
        task = self._bar.tasks[self._tiles]
        # the tile total is an estimate (the fast scale search walks as far as its error curve
        # needs): grow it rather than report more tiles done than there are
        self._bar.update(self._tiles, advance=n,
                         total=max(task.total, task.completed + n))

    def finish(self):
        self._bar.update(self._tiles, completed=self._bar.tasks[self._tiles].total)
        self._bar.stop()


def convert_hf(source: str | Path, output: str | Path, *, bits: float, head_bits: float = 6,
               codebook: str = "mcg", mode: str = "exact", seed: int = 0,
               out_scales: str = "always", hessians: HessianProvider | None = None,
               hessian_scales: bool = False,
               progress: Progress | None = None, overwrite: bool = False,
               log: Callable[[str], None] | None = None) -> list[LinearReport]:
    """Quantize an HF safetensors model directory to an EXL3 checkpoint directory.

    Args:
      source: directory with config.json, *.safetensors (HF names, Linear weights [out, in]).
      output: EXL3 directory to create (atomically; ``overwrite`` to replace an existing one).
      bits: K of every body linear (1..8; 1.5/2.5/3.5 with mul1). No mixed-rate allocation yet.
      head_bits: K of lm_head, or 16 to keep it fp16.
      codebook, mode, seed, out_scales: see ``quantize_linear``.
      hessians: calibration plug-in, or None for the no-Hessian fallback everywhere.
      hessian_scales: rotate Hessians with the full input scales (see ``quantize_linear``).
      progress: progress sink (``RichProgress()`` for a terminal), default silent.
    Returns:
      one LinearReport per quantized linear (proxy error, global scale, time).
    """
    source, output = Path(source), Path(output)
    check_rate(bits, codebook)
    if head_bits != 16:
        check_rate(head_bits, codebook)
    config = json.loads((source / "config.json").read_text())
    store = TensorStore(source)
    jobs, plain = plan(store, bits, head_bits)
    progress = progress or NullProgress()
    layers = sorted({j.layer for j in jobs if j.layer >= 0})
    total_tiles = sum(j.tiles + estimate_search_tiles(padded(j.shape[0]) // TILE,
                                                      padded(j.shape[1]) // TILE,
                                                      mode) for j in jobs)
    reports: list[LinearReport] = []

    progress.start(len(layers) + (1 if any(j.layer < 0 for j in jobs) else 0), total_tiles)
    try:
        with Exl3Writer(output, output_config(config), overwrite=overwrite) as writer:
            for name in plain:
                writer.add_tensor(name, plain_tensor(store.read(name)))
            for fname in SIDE_FILES:
                if (source / fname).is_file():
                    writer.add_file(fname, source / fname)
            for layer in layers + [-1]:
                done: dict[str, Exl3Weight] = {}
                layer_jobs = [j for j in jobs if j.layer == layer]
                for group in lockstep_groups(layer_jobs):
                    for job, (weight, report) in zip(group, quantize_group(
                            store, group, codebook, mode, seed, out_scales, hessians,
                            progress.tiles, hessian_scales)):
                        writer.add_linear(job.key, weight.trellis, weight.suh, weight.svh,
                                          codebook, weight.bias)
                        done[job.key] = weight
                        reports.append(report)
                        if log is not None:
                            log(f"{job.key}: K={job.K:g} {job.shape[0]}x{job.shape[1]} proxy "
                                f"error {report.info.proxy_error:.5f} g={report.info.g:.3f}")
                if hessians is not None and layer >= 0:
                    hessians.layer_done(layer, done)
                if done:
                    progress.layer("lm_head" if layer < 0 else f"layer {layer}")
            writer.set_quantization(
                codebook=codebook, out_scales=out_scales,
                encoder={"name": "exl3-jax", "mode": mode, "seed": seed,
                         "hessian_scales": hessian_scales,
                         "hessian": "none" if hessians is None else type(hessians).__name__})
    finally:
        progress.finish()
    return reports


GROUP_WEIGHTS = 1 << 26      # weights quantized together at most (LDLQ keeps ~20 bytes each)


def lockstep_groups(jobs: list[LinearJob]) -> list[list[LinearJob]]:
    """A layer's linears split into groups quantized together: one rate per group, in job order,
    at most GROUP_WEIGHTS weights each (a large MoE layer is many groups; a lone linear larger
    than that is a group by itself)."""
    groups: list[list[LinearJob]] = []
    for K in dict.fromkeys(j.K for j in jobs):
        group, size = [], 0
        for job in (j for j in jobs if j.K == K):
            weights = job.shape[0] * job.shape[1]
            if group and size + weights > GROUP_WEIGHTS:
                groups.append(group)
                group, size = [], 0
            group.append(job)
            size += weights
        groups.append(group)
    return groups


def quantize_group(store: TensorStore, group: list[LinearJob], codebook: str, mode: str,
                   seed: int, out_scales: str, hessians: HessianProvider | None,
                   tiles_done: Callable[[int], None], hessian_scales: bool = False
                   ) -> list[tuple[Exl3Weight, LinearReport]]:
    """Read, transpose to (in, out) and quantize source linears of one rate together (with their
    biases, if any), via ``quantize_linears``."""
    t0 = time.perf_counter()
    inputs = []
    for job in group:
        w = np.asarray(store.read(job.source), np.float32).T
        bias_name = f"{job.key}.bias"
        bias = (np.asarray(store.read(bias_name), np.float32)
                if job.layer >= 0 and bias_name in store else None)
        h = hessians.hessian(job.key) if hessians is not None else None
        inputs.append(LinearInput(w, None if h is None else h[0], 0 if h is None else h[1],
                                  qmap_seed(seed, job.qmap), bias))
    results = quantize_linears(inputs, group[0].K, codebook, mode=mode, out_scales=out_scales,
                               hessian_scales=hessian_scales, progress=tiles_done)
    seconds = time.perf_counter() - t0
    return [(weight, LinearReport(job.key, job.K, job.shape, info, seconds))
            for job, (weight, info) in zip(group, results)]


__all__ = ["HessianProvider", "LinearJob", "LinearReport", "NullProgress", "RichProgress",
           "convert_hf", "plan", "quantize_group"]
