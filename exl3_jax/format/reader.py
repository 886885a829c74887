"""Lazy reading of safetensors model directories and EXL3 checkpoints (numpy + safetensors).

``TensorStore`` indexes the tensors of a directory (one file, or shards named by
model.safetensors.index.json) from the headers alone and reads single tensors on demand.
``Exl3Checkpoint`` adds config.json / quantization_config, enumerates EXL3 linears (spec 1.7),
quantized embeddings (1.6.5 addendum 2.2) and plain tensors, and validates every module when it
opens, so a bad checkpoint fails at open with an error that names the file and tensor.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterator

import numpy as np
from safetensors import SafetensorError, safe_open

from . import spec
from .errors import (CorruptFileError, Exl3FormatError, MissingFileError, MissingTensorError,
                     TensorDtypeError, TensorShapeError, UnsupportedQuantMethodError)

INDEX_FILE = "model.safetensors.index.json"
NGRAM_FILE = "ngram_embedding.safetensors"


def read_json(path: Path) -> Any:
    """Parse a JSON file; a missing or malformed file raises an error naming it."""
    if not path.is_file():
        raise MissingFileError("required file is missing", file=path)
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"invalid JSON: {e}", file=path) from None


class TensorStore:
    """Tensors of a safetensors directory, indexed by name, read lazily one at a time.

    Only the headers are parsed at construction. A tensor named by the index but absent from its
    shard, a shard the index names but that is missing, a tensor present in two files, and a
    truncated or corrupt file all raise errors naming the file.
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise MissingFileError("model directory does not exist", file=self.directory)
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        self._desc: dict[str, spec.TensorDesc] = {}

        index_path = self.directory / INDEX_FILE
        if index_path.exists():
            index = read_json(index_path)
            weight_map = index.get("weight_map") if isinstance(index, dict) else None
            if not isinstance(weight_map, dict):
                raise CorruptFileError("index has no 'weight_map' object", file=index_path)
            files = sorted(set(weight_map.values()))
            for fname in files:
                if not (self.directory / fname).is_file():
                    raise MissingFileError(f"shard {fname!r} named by {INDEX_FILE} is missing",
                                           file=self.directory / fname)
            for fname in files:
                self._add_file(self.directory / fname)
            for name, fname in weight_map.items():
                if self._where.get(name) != self.directory / fname:
                    raise MissingTensorError(f"{INDEX_FILE} places this tensor in {fname!r} but "
                                             f"that shard does not contain it",
                                             file=self.directory / fname, tensor=name)
        else:
            files = sorted(p for p in self.directory.glob("*.safetensors")
                           if p.name != NGRAM_FILE)
            if not files:
                raise MissingFileError("no *.safetensors files", file=self.directory)
            for path in files:
                self._add_file(path)

    def _add_file(self, path: Path) -> None:
        try:
            handle = safe_open(str(path), framework="numpy")
            names = list(handle.keys())
            for name in names:
                sl = handle.get_slice(name)
                desc = spec.TensorDesc(tuple(int(d) for d in sl.get_shape()), sl.get_dtype())
                if name in self._where:
                    raise CorruptFileError(f"tensor also stored in {self._where[name].name}",
                                           file=path, tensor=name)
                self._where[name] = path
                self._desc[name] = desc
        except SafetensorError as e:
            raise CorruptFileError(f"cannot read safetensors file: {e}", file=path) from None
        self._handles[path] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def __len__(self) -> int:
        return len(self._where)

    def names(self) -> list[str]:
        return list(self._where)

    def desc(self, name: str) -> spec.TensorDesc:
        if name not in self._desc:
            raise MissingTensorError("tensor not found", file=self.directory, tensor=name)
        return self._desc[name]

    def file_of(self, name: str) -> Path:
        return self._where[name]

    def nbytes(self, name: str) -> int:
        d = self._desc[name]
        item = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2,
                "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8,
                "F64": 8}.get(d.dtype, 0)
        return int(np.prod(d.shape, dtype=np.int64)) * item

    def read(self, name: str) -> np.ndarray:
        """Read one tensor into memory as a numpy array (bf16 as ml_dtypes.bfloat16)."""
        path = self._where.get(name)
        if path is None:
            raise MissingTensorError("tensor not found", file=self.directory, tensor=name)
        try:
            return self._handles[path].get_tensor(name)
        except SafetensorError as e:
            raise CorruptFileError(f"cannot read tensor: {e}", file=path, tensor=name) from None


@dataclasses.dataclass(frozen=True)
class EmbeddingInfo:
    """A trellis-quantized token embedding (exllamav3 1.6.5 ``--embed_bits``)."""
    key: str
    K: int
    rows: int
    groups: int       # G = ceil(hidden / 256) rings per row


def _linear_descs(store: TensorStore, members: dict[str, str]) -> dict[str, spec.TensorDesc]:
    return {suffix: store.desc(name) for suffix, name in members.items()}


class Exl3Checkpoint:
    """An EXL3 model directory, opened lazily and validated.

    Attributes: ``config`` (config.json), ``quantization_config``, ``tensor_storage`` (from the
    optional quantization_config.json, else None), ``linears`` (key -> LinearInfo),
    ``embeddings`` (key -> EmbeddingInfo), ``plain`` (names of all other tensors).
    """

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        config_path = self.directory / "config.json"
        self.config = read_json(config_path)
        if not isinstance(self.config, dict):
            raise CorruptFileError("config.json must hold a JSON object", file=config_path)
        qc = self.config.get("quantization_config")
        if not isinstance(qc, dict):
            raise UnsupportedQuantMethodError("config.json has no quantization_config: not an "
                                              "EXL3 checkpoint", file=config_path)
        if qc.get("quant_method") != "exl3":
            raise UnsupportedQuantMethodError(f"unknown quant_method {qc.get('quant_method')!r}"
                                              f" (expected 'exl3')", file=config_path)
        self.quantization_config = qc

        qc_path = self.directory / "quantization_config.json"
        self.tensor_storage = None
        if qc_path.exists():
            full = read_json(qc_path)
            ts = full.get("tensor_storage") if isinstance(full, dict) else None
            if ts is not None and not isinstance(ts, dict):
                raise CorruptFileError("tensor_storage must be an object", file=qc_path)
            self.tensor_storage = ts

        self.store = TensorStore(self.directory)
        self.ngram_file = (self.directory / NGRAM_FILE
                           if (self.directory / NGRAM_FILE).exists() else None)
        self.linears: dict[str, spec.LinearInfo] = {}
        self.embeddings: dict[str, EmbeddingInfo] = {}
        self._enumerate()
        if self.tensor_storage is not None:
            self._check_tensor_storage(qc_path)

    # -- enumeration ------------------------------------------------------------------------

    def _enumerate(self) -> None:
        owned: set[str] = set()
        for key, members in spec.group_by_module(self.store.names()).items():
            if "trellis" not in members:
                continue
            file = str(self.store.file_of(members["trellis"]))
            if "signs" in members:
                self.embeddings[key] = self._embedding_info(key, members, file)
                owned.update(members[s] for s in ("trellis", "signs"))
                continue
            descs = _linear_descs(self.store, members)
            markers = {cb: int(self.store.read(members[cb]))
                       for cb in ("mcg", "mul1") if cb in members
                       and descs[cb].shape == () and descs[cb].dtype == "I32"}
            info = spec.check_linear(key, descs, markers, file=file)
            self.linears[key] = info
            owned.update(info.tensors)
        self.plain = [n for n in self.store.names() if n not in owned]

    def _embedding_info(self, key: str, members: dict[str, str], file: str) -> EmbeddingInfo:
        t, s = self.store.desc(members["trellis"]), self.store.desc(members["signs"])
        if t.dtype != "I16" or len(t.shape) != 2:
            raise TensorShapeError(f"quantized embedding trellis must be int16 2-D, got "
                                   f"{t.dtype} {list(t.shape)}", file=file,
                                   tensor=members["trellis"])
        if s.dtype != "F16" or len(s.shape) != 2 or s.shape[1] != 256:
            raise TensorShapeError(f"embedding signs must be float16 [G, 256], got {s.dtype} "
                                   f"{list(s.shape)}", file=file, tensor=members["signs"])
        groups = s.shape[0]
        per_group, rem = divmod(t.shape[1], groups) if groups else (0, 1)
        if rem or (per_group - 1) % 16 or not 1 <= (per_group - 1) // 16 <= 8:
            raise TensorShapeError(f"embedding trellis row of {t.shape[1]} words does not split "
                                   f"into {groups} rings of 1 + 16*K words (K in 1..8)",
                                   file=file, tensor=members["trellis"])
        return EmbeddingInfo(key=key, K=(per_group - 1) // 16, rows=t.shape[0], groups=groups)

    def _check_tensor_storage(self, qc_path: Path) -> None:
        """quantization_config.json must agree with the shards about every tensor it lists."""
        for module, entry in self.tensor_storage.items():
            stored = entry.get("stored_tensors", {}) if isinstance(entry, dict) else {}
            for name, meta in stored.items():
                if name not in self.store:
                    raise MissingTensorError("listed in tensor_storage but absent from the "
                                             "shards", file=qc_path, tensor=name)
                shape = tuple(meta.get("shape", ())) if isinstance(meta, dict) else None
                if shape is not None and shape != self.store.desc(name).shape:
                    raise TensorShapeError(f"tensor_storage says shape {list(shape)}, the shard "
                                           f"holds {list(self.store.desc(name).shape)}",
                                           file=qc_path, tensor=name)

    # -- reading ------------------------------------------------------------------------------

    def read_linear(self, key: str) -> dict[str, np.ndarray | None]:
        """Arrays of one EXL3 linear: trellis int16 [k/16, n/16, W], suh fp16 [k], svh fp16 [n],
        bias fp16 [n] or None. Legacy packed su/sv are expanded to +-1 (spec 1.5)."""
        if key not in self.linears:
            raise MissingTensorError("no EXL3 linear with this key", file=self.directory,
                                     tensor=key)
        info = self.linears[key]
        out: dict[str, np.ndarray | None] = {"trellis": self.store.read(f"{key}.trellis")}
        for (full, packed, size), legacy in zip((("suh", "su", info.k), ("svh", "sv", info.n)),
                                                info.legacy_signs):
            out[full] = (spec.expand_sign_bits(self.store.read(f"{key}.{packed}"), size)
                         if legacy else self.store.read(f"{key}.{full}"))
        out["bias"] = (self.store.read(f"{key}.bias").astype(np.float16)
                       if info.has_bias else None)
        return out

    def read_embedding(self, key: str) -> dict[str, np.ndarray]:
        """Arrays of a quantized embedding: trellis int16 [rows, G*(1+16K)], signs fp16 [G, 256]."""
        if key not in self.embeddings:
            raise MissingTensorError("no quantized embedding with this key", file=self.directory,
                                     tensor=key)
        return {"trellis": self.store.read(f"{key}.trellis"),
                "signs": self.store.read(f"{key}.signs")}

    def read_tensor(self, name: str) -> np.ndarray:
        return self.store.read(name)

    def read_ngram_table(self):
        """Hashed n-gram tables (PLE models) are not supported yet."""
        raise NotImplementedError(f"quantized n-gram tables ({self.ngram_file or NGRAM_FILE}) "
                                  f"are not supported by exl3-jax yet")

    def iter_linears(self) -> Iterator[spec.LinearInfo]:
        return iter(self.linears.values())

    def summary(self) -> dict[str, float]:
        """Totals: quantized weights, their bytes, bits per weight, and the size on disk."""
        weights = sum(i.k * i.n for i in self.linears.values())
        qbytes = sum(self.store.nbytes(t) for i in self.linears.values() for t in i.tensors)
        total = sum(self.store.nbytes(n) for n in self.store.names())
        return {"linears": len(self.linears), "weights": weights, "linear_bytes": qbytes,
                "bpw": 8.0 * qbytes / weights if weights else 0.0, "total_bytes": total}


def tensor_desc_of(array: np.ndarray) -> spec.TensorDesc:
    """Descriptor of an in-memory array with safetensors dtype names."""
    names = {"int16": "I16", "uint16": "U16", "float16": "F16", "bfloat16": "BF16",
             "float32": "F32", "int32": "I32", "uint32": "U32", "int64": "I64", "float64": "F64",
             "int8": "I8", "uint8": "U8", "bool": "BOOL"}
    dt = np.asarray(array).dtype
    if dt.name not in names:
        raise TensorDtypeError(f"dtype {dt} cannot be stored in safetensors")
    return spec.TensorDesc(tuple(int(d) for d in np.shape(array)), names[dt.name])


__all__ = ["TensorStore", "Exl3Checkpoint", "EmbeddingInfo", "read_json", "tensor_desc_of",
           "Exl3FormatError"]
