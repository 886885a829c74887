"""Writing EXL3 checkpoints in exllamav3's layout, atomically (numpy + safetensors).

The writer stages everything in a hidden temporary directory next to the destination and renames
it into place only when ``commit()`` finishes, so an interrupted write never leaves a directory that
looks like a finished checkpoint. Tensors are flushed to shards as they accumulate, so memory stays
bounded by the shard size.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

import numpy as np
from safetensors.numpy import save_file

from . import spec
from .errors import Exl3FormatError, TensorDtypeError
from .reader import INDEX_FILE, tensor_desc_of

EXL3_JAX_FORMAT_VERSION = "exl3-jax-0.1"
LEGACY_STAGE_MAX_AGE_S = 24 * 3600


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:          # someone else's live process
        return True
    return True


def _stale_stage(path: Path, prefix: str) -> bool:
    """Whether a staging directory was left by a run that is gone."""
    rest = path.name[len(prefix):]
    owner, sep, _ = rest.partition("-")
    if sep and owner.isdigit():
        return not _pid_alive(int(owner))
    return time.time() - path.stat().st_mtime > LEGACY_STAGE_MAX_AGE_S


def staging_dir(destination: str | os.PathLike) -> Path:
    """A fresh hidden directory next to ``destination`` to build it in, renamed into place when
    complete: ``.NAME.partial-PID-XXXXXXXX`` (mode 0755).

    Staging directories of the same destination left by killed runs are removed first: those
    whose owner process (the PID in the name) no longer exists on this host, and unnamed ones
    from older versions once they are a day old. A live build's directory is never touched."""
    dest = Path(destination)
    dest.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{dest.name}.partial-"
    for old in dest.parent.glob(glob.escape(prefix) + "*"):
        try:
            if old.is_dir() and _stale_stage(old, prefix):
                shutil.rmtree(old, ignore_errors=True)
        except OSError:              # vanished meanwhile (another process cleaned it up)
            continue
    stage = Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-", dir=dest.parent))
    os.chmod(stage, 0o755)           # mkdtemp makes 0700; the result is an ordinary directory
    return stage


class Exl3Writer:
    """Collects EXL3 linears and plain tensors and writes a checkpoint directory.

    Use as a context manager: on an exception the staging directory is removed and nothing
    appears at ``directory``.

        with Exl3Writer(out, config) as w:
            w.add_linear("model.layers.0.self_attn.q_proj", trellis, suh, svh, "mcg")
            w.add_tensor("model.norm.weight", norm)
            w.add_file("tokenizer.json", src / "tokenizer.json")
            w.set_quantization(head_bits=6)
    """

    def __init__(self, directory: str | os.PathLike, config: Mapping[str, Any], *,
                 max_shard_bytes: int = 8 << 30, overwrite: bool = False):
        self.directory = Path(directory)
        if self.directory.exists() and not overwrite:
            raise FileExistsError(f"{self.directory} exists (pass overwrite=True to replace it)")
        self.config = dict(config)
        self.overwrite = overwrite
        self.max_shard_bytes = max_shard_bytes
        self._stage = staging_dir(self.directory)
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[str, list[str]]] = []     # (temp file name, tensor names)
        self._names: set[str] = set()
        self._storage: dict[str, dict[str, Any]] = {}
        self._linear_rates: dict[str, tuple[float, int, str]] = {}   # key -> (K, weights, codebook)
        self._quant: dict[str, Any] = {}
        self._done = False

    # -- adding content -----------------------------------------------------------------------

    def add_linear(self, key: str, trellis: np.ndarray, suh: np.ndarray, svh: np.ndarray,
                   codebook: str, bias: np.ndarray | None = None) -> spec.LinearInfo:
        """Add one EXL3 linear: trellis int16 [k/16, n/16, W], suh/svh fp16 [k]/[n], optional
        bias [n] (stored fp16). Validated with the same rules the reader applies."""
        if codebook not in spec.CODEBOOKS:
            raise Exl3FormatError(f"unknown codebook {codebook!r}; use one of {spec.CODEBOOKS}",
                                  tensor=key)
        arrays = {"trellis": np.asarray(trellis), "suh": np.asarray(suh),
                  "svh": np.asarray(svh)}
        if bias is not None:
            arrays["bias"] = np.asarray(bias, dtype=np.float16)
        if codebook != "3inst":
            arrays[codebook] = np.array(spec.marker_as_int32(codebook), dtype=np.int32)
        descs = {s: tensor_desc_of(a) for s, a in arrays.items()}
        info = spec.check_linear(key, descs, {codebook: int(arrays[codebook])}
                                 if codebook != "3inst" else None, file=str(self.directory))
        stored = {}
        for suffix, arr in arrays.items():
            name = spec.linear_tensor_name(key, suffix)
            self._add(name, arr)
            stored[name] = {"shape": list(arr.shape), "n_bytes": int(arr.nbytes),
                            "dtype": _torch_dtype_name(arr)}
        entry: dict[str, Any] = {"stored_tensors": stored, "quant_format": "exl3",
                                 "bits_per_weight": info.K}
        if codebook != "3inst":
            entry[f"{codebook}_multiplier"] = spec.MARKER_MULTIPLIERS[codebook]
        self._storage[key] = entry
        self._linear_rates[key] = (info.K, info.k * info.n, codebook)
        return info

    def add_tensor(self, name: str, array: np.ndarray) -> None:
        """Add a plain (unquantized) tensor under its full name."""
        arr = np.asarray(array)
        self._add(name, arr)
        module = name.rpartition(".")[0] or name
        self._storage.setdefault(module, {"stored_tensors": {}})["stored_tensors"][name] = {
            "shape": list(arr.shape), "n_bytes": int(arr.nbytes), "dtype": _torch_dtype_name(arr)}

    def add_file(self, name: str, source: str | os.PathLike) -> None:
        """Copy a side file (tokenizer.json, generation_config.json, ...) into the checkpoint."""
        shutil.copyfile(source, self._stage / name)

    def set_quantization(self, **fields: Any) -> None:
        """Extra quantization_config fields (head_bits, calibration, encoder mode, ...)."""
        self._quant.update(fields)

    def _add(self, name: str, arr: np.ndarray) -> None:
        if self._done:
            raise RuntimeError("writer already committed")
        if name in self._names:
            raise Exl3FormatError("tensor added twice", tensor=name)
        tensor_desc_of(arr)   # rejects dtypes safetensors cannot store
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)
        self._names.add(name)
        if self._pending and self._pending_bytes + arr.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = arr
        self._pending_bytes += arr.nbytes

    def _flush(self) -> None:
        if not self._pending:
            return
        fname = f"shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, str(self._stage / fname), metadata={"format": "pt"})
        self._shards.append((fname, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    # -- finishing ----------------------------------------------------------------------------

    def quantization_config(self) -> dict[str, Any]:
        body = [(K, w) for key, (K, w, _) in self._linear_rates.items()
                if key.rpartition(".")[2] != "lm_head" and key != "lm_head"]
        bits = round(sum(K * w for K, w in body) / sum(w for _, w in body), 2) if body else 0.0
        head = self._linear_rates.get("lm_head")
        codebooks = sorted({cb for _, _, cb in self._linear_rates.values()})
        qc = {"quant_method": "exl3", "version": EXL3_JAX_FORMAT_VERSION, "bits": bits,
              "head_bits": head[0] if head else 16,
              "codebook": codebooks[0] if len(codebooks) == 1 else "mixed"}
        qc.update(self._quant)
        return qc

    def commit(self) -> Path:
        """Write the remaining shard, the index, config.json and quantization_config.json, then
        move the staged directory into place. Returns the final path."""
        self._flush()
        n = len(self._shards)
        weight_map = {}
        for i, (tmp, names) in enumerate(self._shards):
            final = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self._stage / tmp, self._stage / final)
            weight_map.update({nm: final for nm in names})
        if n > 1:
            total = sum(os.path.getsize(self._stage / f) for f in set(weight_map.values()))
            _write_json(self._stage / INDEX_FILE,
                        {"metadata": {"total_size": total}, "weight_map": weight_map})
        qc = self.quantization_config()
        config = dict(self.config)
        config["quantization_config"] = qc
        _write_json(self._stage / "config.json", config)
        _write_json(self._stage / "quantization_config.json",
                    dict(qc, tensor_storage=self._storage))
        self._done = True
        if self.directory.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{self.directory.name}.old-",
                                          dir=self.directory.parent))
            os.replace(self.directory, trash / "old")
            os.replace(self._stage, self.directory)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self._stage, self.directory)
        return self.directory

    def abort(self) -> None:
        """Discard everything staged; nothing appears at the destination."""
        self._done = True
        shutil.rmtree(self._stage, ignore_errors=True)

    def __enter__(self) -> "Exl3Writer":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.commit()


def _torch_dtype_name(arr: np.ndarray) -> str:
    names = {"int16": "torch.int16", "float16": "torch.float16", "bfloat16": "torch.bfloat16",
             "float32": "torch.float32", "int32": "torch.int32", "int64": "torch.int64",
             "uint8": "torch.uint8", "int8": "torch.int8", "bool": "torch.bool",
             "float64": "torch.float64", "uint16": "torch.uint16", "uint32": "torch.uint32"}
    name = np.asarray(arr).dtype.name
    if name not in names:
        raise TensorDtypeError(f"dtype {name} cannot be stored")
    return names[name]


def _write_json(path: Path, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
