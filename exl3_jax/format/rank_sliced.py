"""Rank-sliced ("hybrid_tr3_tail") MoE checkpoints: metadata, tensor names, per-rank loading.

Spec: shared/spec/exl3_format.md section 7. Such checkpoints store the routed experts of the MoE
layers sliced for a fixed tensor-parallel size *before* encoding: rank r owns gate/up output
columns and down input rows ``[r*I_r, (r+1)*I_r)`` of every expert, each slice an independently
encoded EXL3 tensor under ``model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{field}``. The rank
payloads are not slices of a common tensor, so the serving TP must equal the checkpoint's ``tp``.

Metadata lives in ``config.json["hybrid_tr3_tail"]`` (top level) and fails closed: anything the
loader does not understand is rejected with a ``RankSlicedConfigError`` naming the field.

``RankSlicedCheckpoint(directory, tp=, tp_rank=)`` reads only the safetensors headers at open and,
per MoE layer and projection, only the local rank's tensors (``load_experts``), stacked per K
tier into ``Exl3Weight``s. This module uses numpy + safetensors; jax only when ``as_jax=True``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import numpy as np

from . import spec
from .errors import (CodebookMarkerError, Exl3FormatError, MissingFileError,
                     MissingTensorError, TensorShapeError)
from .reader import TensorStore, read_json

METADATA_KEY = "hybrid_tr3_tail"
FORMAT = "exl3-trellis"
CODEBOOK = "mcg"
TENSOR_SCHEMA = "model.layers.{L}.mlp.experts.{E}.{proj}.rank{r}.{trellis|suh|svh|mcg}"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
ALLOWED_K = (3, 4, 5, 6)
PER_EXPERT = "per_expert_v1"
SHARED_H = "shared_h_v1"
ROTATION_LAYOUTS = (PER_EXPERT, SHARED_H)
TAIL_TR3_FIELD = "tail_tr3"

# which vector of a projection is on the hidden side (shared under shared_h_v1)
HIDDEN_SIDE = {"gate_proj": "suh", "up_proj": "suh", "down_proj": "svh"}

_RANK_NAME = re.compile(r"^(?P<prefix>.+)\.rank(?P<rank>\d+)\.(?P<field>trellis|suh|svh|mcg|mul1)$")


class RankSlicedConfigError(Exl3FormatError):
    """config.json's hybrid_tr3_tail metadata (or its tier bitmap) is missing or invalid."""


class TensorParallelMismatchError(RankSlicedConfigError):
    """The runtime tensor-parallel size (or rank) does not fit the checkpoint's slicing."""


@dataclasses.dataclass(frozen=True)
class RankSlicedConfig:
    """Validated ``hybrid_tr3_tail`` metadata.

    bits: K of every expert (uniform) or "mixed"; k_values: the declared K values ((bits,) when
    uniform); bits_per_expert: (file, field) of the tier bitmap when mixed, else None;
    moe_layers: inclusive (first, last); rotation_layout: "per_expert_v1" or "shared_h_v1".
    """
    tp: int
    experts_per_layer: int
    moe_layers: tuple[int, int]
    bits: int | str
    k_values: tuple[int, ...]
    bits_per_expert: tuple[str, str] | None
    rotation_layout: str
    shared_h_tensor_schema: str | None
    codebook: str = CODEBOOK
    tensor_schema: str = TENSOR_SCHEMA

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe_layers[0] <= layer <= self.moe_layers[1]

    @property
    def layers(self) -> range:
        return range(self.moe_layers[0], self.moe_layers[1] + 1)


# --------------------------------------------------------------------------------------------
# metadata

def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _integral_k(v: Any, *, where: str, file) -> int:
    """A K value that must be an integer 3..6 (integral floats such as 3.0 accepted)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RankSlicedConfigError(f"{where} must be a number, got {v!r}", file=file)
    if isinstance(v, float) and (not math.isfinite(v) or v != int(v)):
        raise RankSlicedConfigError(f"{where} = {v!r} is not integral (rank-sliced experts use "
                                    f"whole bits {ALLOWED_K})", file=file)
    if int(v) not in ALLOWED_K:
        raise RankSlicedConfigError(f"{where} = {v!r} is outside the supported {ALLOWED_K}",
                                    file=file)
    return int(v)


def _check_schema_template(schema: Any, *, file) -> str:
    """A shared_h tensor schema: placeholders {L}, {proj}, {r} and one final field group."""
    if not isinstance(schema, str):
        raise RankSlicedConfigError(f"shared_h_tensor_schema must be a string, got {schema!r}",
                                    file=file)
    groups = re.findall(r"\{([^{}]*)\}", schema)
    named = {"L", "proj", "r"}
    if not named <= set(groups) or len([g for g in groups if g not in named | {"E"}]) != 1:
        raise RankSlicedConfigError(
            f"shared_h_tensor_schema {schema!r} must contain {{L}}, {{proj}}, {{r}} and one "
            f"field group such as {{suh|svh}}", file=file)
    return schema


def parse_rank_sliced_config(config: Mapping[str, Any], *, file: str | os.PathLike | None = None
                             ) -> RankSlicedConfig | None:
    """Validate ``config["hybrid_tr3_tail"]`` (spec 7.2). None when the key is absent.

    Raises RankSlicedConfigError naming the field for: format other than "exl3-trellis"; bits
    neither an integral 3..6 nor "mixed"; mixed without k_values (a subset of 3..6) or without
    bits_per_expert "file.json:field"; codebook other than "mcg"; experts_per_layer not a
    positive int; moe_layers not [first, last] with 0 <= first <= last; tensor_schema other than
    the exact schema; tp not a positive int; an unknown rotation_layout; shared_h_v1 without
    shared_h_tensor_schema.
    """
    if METADATA_KEY not in config:
        return None
    meta = config[METADATA_KEY]
    if not isinstance(meta, Mapping):
        raise RankSlicedConfigError(f"{METADATA_KEY} must be an object, got {type(meta).__name__}",
                                    file=file)

    def need(key: str) -> Any:
        if key not in meta:
            raise RankSlicedConfigError(f"{METADATA_KEY}.{key} is required", file=file)
        return meta[key]

    fmt = need("format")
    if fmt != FORMAT:
        raise RankSlicedConfigError(f"{METADATA_KEY}.format is {fmt!r}; only {FORMAT!r} is "
                                    f"supported", file=file)
    codebook = need("codebook")
    if codebook != CODEBOOK:
        raise RankSlicedConfigError(f"{METADATA_KEY}.codebook is {codebook!r}; rank-sliced "
                                    f"checkpoints must use the MCG codebook ('mcg')", file=file)

    bits = need("bits")
    bits_per_expert = None
    if bits == "mixed":
        k_values = meta.get("k_values")
        if not isinstance(k_values, (list, tuple)) or not k_values:
            raise RankSlicedConfigError(f"{METADATA_KEY}.bits is 'mixed' but k_values (a "
                                        f"non-empty list, subset of {ALLOWED_K}) is missing",
                                        file=file)
        k_values = tuple(sorted({_integral_k(k, where=f"{METADATA_KEY}.k_values entry",
                                             file=file) for k in k_values}))
        spec_str = meta.get("bits_per_expert")
        if not isinstance(spec_str, str) or spec_str.count(":") != 1:
            raise RankSlicedConfigError(f"{METADATA_KEY}.bits is 'mixed' but bits_per_expert "
                                        f"is {spec_str!r}; expected 'file.json:field'",
                                        file=file)
        bitmap_file, field = spec_str.split(":")
        path = PurePosixPath(bitmap_file)
        if not bitmap_file or not field or path.is_absolute() or ".." in path.parts:
            raise RankSlicedConfigError(f"{METADATA_KEY}.bits_per_expert {spec_str!r} must name "
                                        f"a file inside the checkpoint and a field", file=file)
        bits_per_expert = (bitmap_file, field)
    elif isinstance(bits, str):
        raise RankSlicedConfigError(f"{METADATA_KEY}.bits is {bits!r}; expected a number in "
                                    f"{ALLOWED_K} or 'mixed'", file=file)
    else:
        bits = _integral_k(bits, where=f"{METADATA_KEY}.bits", file=file)
        k_values = (bits,)

    experts = need("experts_per_layer")
    if not _is_int(experts) or experts < 1:
        raise RankSlicedConfigError(f"{METADATA_KEY}.experts_per_layer must be a positive "
                                    f"integer, got {experts!r}", file=file)
    layers = need("moe_layers")
    if (not isinstance(layers, (list, tuple)) or len(layers) != 2
            or not all(_is_int(v) for v in layers) or layers[0] < 0):
        raise RankSlicedConfigError(f"{METADATA_KEY}.moe_layers must be [first, last] "
                                    f"(non-negative integers, inclusive), got {layers!r}",
                                    file=file)
    if layers[0] > layers[1]:
        raise RankSlicedConfigError(f"{METADATA_KEY}.moe_layers {list(layers)} is reversed "
                                    f"(first > last)", file=file)
    schema = need("tensor_schema")
    if schema != TENSOR_SCHEMA:
        raise RankSlicedConfigError(f"{METADATA_KEY}.tensor_schema is {schema!r}; only "
                                    f"{TENSOR_SCHEMA!r} is supported", file=file)
    tp = need("tp")
    if not _is_int(tp) or tp < 1:
        raise RankSlicedConfigError(f"{METADATA_KEY}.tp must be a positive integer, got {tp!r}",
                                    file=file)

    layout = meta.get("rotation_layout")
    layout = PER_EXPERT if layout is None else layout
    if layout not in ROTATION_LAYOUTS:
        raise RankSlicedConfigError(f"{METADATA_KEY}.rotation_layout {layout!r} is not "
                                    f"supported; expected one of {ROTATION_LAYOUTS}", file=file)
    shared_schema = None
    if layout == SHARED_H:
        if "shared_h_tensor_schema" not in meta:
            raise RankSlicedConfigError(f"{METADATA_KEY}.rotation_layout is {SHARED_H!r} but "
                                        f"shared_h_tensor_schema is missing", file=file)
        shared_schema = _check_schema_template(meta["shared_h_tensor_schema"], file=file)

    return RankSlicedConfig(tp=tp, experts_per_layer=experts, moe_layers=(layers[0], layers[1]),
                            bits=bits, k_values=k_values, bits_per_expert=bits_per_expert,
                            rotation_layout=layout, shared_h_tensor_schema=shared_schema)


def is_rank_sliced(config: Mapping[str, Any]) -> bool:
    """True when config.json declares an EXL3 rank-sliced checkpoint (spec 7.2 detection)."""
    meta = config.get(METADATA_KEY)
    return isinstance(meta, Mapping) and meta.get("format") == FORMAT


def expert_bits(cfg: RankSlicedConfig, directory: str | os.PathLike) -> dict[int, tuple[int, ...]]:
    """K of every expert of every MoE layer: {layer: (K_0, ..., K_{E-1})}.

    Uniform bits: all equal. Mixed: from the tier bitmap ``file.json`` mapping str(layer) ->
    {field: [K per expert]}; an entry without ``field`` but with ``tail_tr3`` (one entry per
    expert) means all experts are K3 (GLM-5.2 MTP overlay quirk). K values outside k_values are
    rejected.
    """
    E = cfg.experts_per_layer
    if cfg.bits_per_expert is None:
        return {L: (int(cfg.bits),) * E for L in cfg.layers}
    fname, field = cfg.bits_per_expert
    path = Path(directory) / fname
    try:
        bitmap = read_json(path)
    except MissingFileError:
        raise RankSlicedConfigError(f"tier bitmap {fname!r} named by {METADATA_KEY}."
                                    f"bits_per_expert is missing", file=path) from None
    if not isinstance(bitmap, Mapping):
        raise RankSlicedConfigError("tier bitmap must be a JSON object keyed by layer",
                                    file=path)
    out = {}
    for L in cfg.layers:
        entry = bitmap.get(str(L))
        if not isinstance(entry, Mapping):
            raise RankSlicedConfigError(f"tier bitmap has no entry for MoE layer {L}", file=path)
        if field in entry:
            ks = entry[field]
        elif TAIL_TR3_FIELD in entry and isinstance(entry[TAIL_TR3_FIELD], list):
            ks = [3] * len(entry[TAIL_TR3_FIELD])       # tail_tr3 quirk: all experts K3
        else:
            raise RankSlicedConfigError(f"tier bitmap entry for layer {L} has neither "
                                        f"{field!r} nor {TAIL_TR3_FIELD!r}", file=path)
        if not isinstance(ks, list) or len(ks) != E:
            raise RankSlicedConfigError(f"tier bitmap entry for layer {L} must list one K per "
                                        f"expert ({E}), got {ks!r:.80}", file=path)
        layer_ks = []
        for e, k in enumerate(ks):
            kk = _integral_k(k, where=f"K of layer {L} expert {e}", file=path)
            if kk not in cfg.k_values:
                raise RankSlicedConfigError(f"layer {L} expert {e} has K={kk}, not among the "
                                            f"declared k_values {cfg.k_values}", file=path)
            layer_ks.append(kk)
        out[L] = tuple(layer_ks)
    return out


# --------------------------------------------------------------------------------------------
# tensor names

def rank_tensor_name(layer: int, expert: int, proj: str, rank: int, field: str) -> str:
    """The stored name of one rank slice tensor (the tensor_schema of spec 7.3)."""
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}.rank{rank}.{field}"


def shared_h_tensor_name(schema: str, layer: int, proj: str, rank: int, field: str) -> str:
    """The stored name of a shared hidden-side row under shared_h_v1, from its schema."""
    name = schema.replace("{L}", str(layer)).replace("{proj}", proj).replace("{r}", str(rank))
    return re.sub(r"\{[^{}]*\}", field, name)


def normalize_rank_sliced_name(name: str, tp_rank: int) -> str | None:
    """``prefix.rank{r}.field`` -> ``prefix.field`` when r == tp_rank, None (dropped) for other
    ranks; names without a rank component pass through unchanged."""
    m = _RANK_NAME.match(name)
    if m is None:
        return name
    if int(m["rank"]) != tp_rank:
        return None
    return f"{m['prefix']}.{m['field']}"


# --------------------------------------------------------------------------------------------
# loading

@dataclasses.dataclass(frozen=True)
class ExpertStack:
    """The experts of one (MoE layer, projection) on one rank, stacked per K tier.

    tiers: K -> Exl3Weight with leaves [n_K, ...] (experts of that K in ascending id order);
    expert_k[e], expert_slot[e]: the tier and the index inside it of expert e.
    """
    tiers: dict[int, Any]
    expert_k: tuple[int, ...]
    expert_slot: tuple[int, ...]

    @property
    def num_experts(self) -> int:
        return len(self.expert_k)

    @property
    def uniform(self):
        """The single stacked Exl3Weight [E, ...] of a uniform-K projection."""
        if len(self.tiers) != 1:
            raise ValueError(f"projection has {len(self.tiers)} K tiers {sorted(self.tiers)}; "
                             f"use .tiers")
        return next(iter(self.tiers.values()))

    def expert(self, e: int):
        """Expert e as a single (unstacked) Exl3Weight."""
        w = self.tiers[self.expert_k[e]]
        s = self.expert_slot[e]
        return dataclasses.replace(w, trellis=w.trellis[s], suh=w.suh[s], svh=w.svh[s],
                                   bias=None if w.bias is None else w.bias[s])


class RankSlicedCheckpoint:
    """One rank's view of a rank-sliced checkpoint.

    Args:
      directory: the checkpoint (config.json with hybrid_tr3_tail, safetensors shards).
      tp, tp_rank: the runtime tensor-parallel size and this process' rank; tp must equal the
        checkpoint's ``tp`` (TensorParallelMismatchError otherwise).
      num_experts: the model's experts per layer, checked against experts_per_layer.
    Attributes: ``config`` (config.json), ``meta`` (RankSlicedConfig), ``expert_bits``
    ({layer: K per expert}), ``store`` (TensorStore, headers only).
    """

    def __init__(self, directory: str | os.PathLike, *, tp: int, tp_rank: int,
                 num_experts: int | None = None):
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        self.config = read_json(config_path)
        if not isinstance(self.config, Mapping):
            raise RankSlicedConfigError("config.json must hold a JSON object", file=config_path)
        meta = parse_rank_sliced_config(self.config, file=config_path)
        if meta is None:
            raise RankSlicedConfigError(f"config.json has no {METADATA_KEY}: not a rank-sliced "
                                        f"checkpoint", file=config_path)
        if tp != meta.tp:
            raise TensorParallelMismatchError(
                f"checkpoint is sliced for tp={meta.tp} but the runtime tensor-parallel size is "
                f"{tp}; rank slices are encoded independently and cannot be re-sliced",
                file=config_path)
        if not 0 <= tp_rank < tp:
            raise TensorParallelMismatchError(f"tp_rank {tp_rank} is outside [0, {tp})",
                                              file=config_path)
        if num_experts is not None and num_experts != meta.experts_per_layer:
            raise RankSlicedConfigError(f"{METADATA_KEY}.experts_per_layer is "
                                        f"{meta.experts_per_layer} but the model has "
                                        f"{num_experts} experts per layer", file=config_path)
        self.meta = meta
        self.tp, self.tp_rank = tp, tp_rank
        self.expert_bits = expert_bits(meta, self.directory)
        self.store = TensorStore(self.directory)
        self._local: dict[str, str] = {}        # normalised name -> stored name (this rank)
        for stored in self.store.names():
            local = normalize_rank_sliced_name(stored, tp_rank)
            if local is not None:
                if local in self._local:
                    raise Exl3FormatError("two stored tensors normalise to the same name "
                                          f"({self._local[local]!r})",
                                          file=self.store.file_of(stored), tensor=stored)
                self._local[local] = stored

    def names(self) -> list[str]:
        """Tensor names this rank sees: its own slices renamed to prefix.field, other ranks'
        slices dropped, everything else unchanged."""
        return list(self._local)

    def __contains__(self, name: str) -> bool:
        return name in self._local

    def read(self, name: str) -> np.ndarray:
        """Read a tensor by its normalised name (only this rank's slices are reachable)."""
        if name not in self._local:
            raise MissingTensorError(f"tensor not found for rank {self.tp_rank}",
                                     file=self.directory, tensor=name)
        return self.store.read(self._local[name])

    def _hidden_row_name(self, layer: int, proj: str) -> str:
        field = HIDDEN_SIDE[proj]
        return shared_h_tensor_name(self.meta.shared_h_tensor_schema, layer, proj, self.tp_rank,
                                    field)

    def _expert_linear(self, layer: int, expert: int, proj: str, expected_k: int):
        """Validate one expert's slice; returns (LinearInfo, {field: stored name})."""
        key = f"model.layers.{layer}.mlp.experts.{expert}.{proj}"
        members = {f: self._local[f"{key}.{f}"] for f in ("trellis", "suh", "svh", "mcg", "mul1")
                   if f"{key}.{f}" in self._local}
        stored_key = f"{key}.rank{self.tp_rank}"
        file = str(self.store.file_of(members["trellis"])) if "trellis" in members else None
        if "trellis" not in members:
            raise MissingTensorError(f"rank {self.tp_rank} slice is missing",
                                     file=self.directory, tensor=f"{stored_key}.trellis")
        if self.meta.rotation_layout == SHARED_H:
            side = HIDDEN_SIDE[proj]
            if side in members:
                raise TensorShapeError(f"{SHARED_H} checkpoints keep the hidden-side {side} once "
                                       f"per (layer, projection, rank), not per expert",
                                       file=file, tensor=members[side])
            members[side] = self._stored_shared(layer, proj)
        descs = {f: self.store.desc(n) for f, n in members.items()}
        markers = {cb: int(self.store.read(members[cb])) for cb in ("mcg", "mul1")
                   if cb in members and descs[cb].shape == () and descs[cb].dtype == "I32"}
        info = spec.check_linear(stored_key, descs, markers, file=file)
        if info.codebook != CODEBOOK:
            raise CodebookMarkerError(f"rank-sliced experts must carry the mcg marker, this one "
                                      f"decodes as {info.codebook}", file=file,
                                      tensor=f"{stored_key}.mcg")
        if info.K != expected_k:
            raise TensorShapeError(f"trellis holds K={info.K} but the metadata says K="
                                   f"{expected_k} for layer {layer} expert {expert}", file=file,
                                   tensor=f"{stored_key}.trellis")
        return info, members

    def _stored_shared(self, layer: int, proj: str) -> str:
        name = self._hidden_row_name(layer, proj)
        local = normalize_rank_sliced_name(name, self.tp_rank)
        if local is None or local not in self._local:
            raise MissingTensorError(f"{SHARED_H} shared hidden-side row is missing",
                                     file=self.directory, tensor=name)
        return self._local[local]

    def load_experts(self, layer: int, proj: str, *, as_jax: bool = True) -> ExpertStack:
        """This rank's slices of every expert of one MoE layer and projection, stacked per K.

        gate/up: trellis [n_K, H/16, I_r/16, 16K], suh [n_K, H], svh [n_K, I_r];
        down: trellis [n_K, I_r/16, H/16, 16K], suh [n_K, I_r], svh [n_K, H]. Under shared_h_v1
        the hidden-side row is broadcast to every expert. Reads only this rank's tensors.
        """
        from ..trellis import Exl3Weight          # jax-dependent; format stays importable alone
        if proj not in PROJECTIONS:
            raise ValueError(f"unknown projection {proj!r}; expected one of {PROJECTIONS}")
        if not self.meta.is_moe_layer(layer):
            raise RankSlicedConfigError(f"layer {layer} is not an EXL3 MoE layer (moe_layers "
                                        f"{list(self.meta.moe_layers)})",
                                        file=self.directory / "config.json")
        ks = self.expert_bits[layer]
        infos = [self._expert_linear(layer, e, proj, ks[e]) for e in range(len(ks))]
        shapes = {(i.k, i.n) for i, _ in infos}
        if len(shapes) != 1:
            raise TensorShapeError(f"experts of layer {layer} {proj} on rank {self.tp_rank} "
                                   f"have different (k, n): {sorted(shapes)}",
                                   file=self.directory)
        shared_cache: dict[str, np.ndarray] = {}

        def read(name: str) -> np.ndarray:
            if name not in shared_cache:
                shared_cache[name] = self.store.read(name)
            return shared_cache[name]

        tiers, slots = {}, []
        for K in sorted(set(ks)):
            members = [m for (i, m), k in zip(infos, ks) if k == K]
            arrays = {f: np.stack([read(m[f]) for m in members]) for f in ("trellis", "suh",
                                                                            "svh")}
            if as_jax:
                import jax.numpy as jnp
                arrays = {f: jnp.asarray(a) for f, a in arrays.items()}
            tiers[K] = Exl3Weight.create(arrays["trellis"], arrays["suh"], arrays["svh"],
                                         CODEBOOK)
        counters = {K: 0 for K in tiers}
        for k in ks:
            slots.append(counters[k])
            counters[k] += 1
        return ExpertStack(tiers=tiers, expert_k=tuple(ks), expert_slot=tuple(slots))

    def load_layer(self, layer: int, *, as_jax: bool = True) -> dict[str, ExpertStack]:
        """gate_proj/up_proj/down_proj stacks of one MoE layer on this rank, shape-checked
        against each other (gate/up [H -> I_r], down [I_r -> H])."""
        out = {p: self.load_experts(layer, p, as_jax=as_jax) for p in PROJECTIONS}
        g, u, d = (out[p].expert(0) for p in PROJECTIONS)
        if not (g.k == u.k == d.n and g.n == u.n == d.k):
            raise TensorShapeError(f"layer {layer} rank {self.tp_rank}: gate {g.k}x{g.n}, up "
                                   f"{u.k}x{u.n} and down {d.k}x{d.n} do not form an MLP",
                                   file=self.directory)
        return out


__all__ = [
    "ALLOWED_K", "CODEBOOK", "FORMAT", "METADATA_KEY", "PROJECTIONS", "ROTATION_LAYOUTS",
    "TENSOR_SCHEMA", "ExpertStack", "RankSlicedCheckpoint", "RankSlicedConfig",
    "RankSlicedConfigError", "TensorParallelMismatchError", "expert_bits", "is_rank_sliced",
    "normalize_rank_sliced_name", "parse_rank_sliced_config", "rank_tensor_name",
    "shared_h_tensor_name",
]
