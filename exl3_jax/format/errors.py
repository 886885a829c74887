"""One exception hierarchy for everything wrong with an EXL3 checkpoint.

Every error names the file (and, where there is one, the tensor) it is about, so a user can find the
bad piece without a debugger. All of them derive from ``Exl3FormatError``, itself a ``ValueError``.
"""

from __future__ import annotations

import os


class Exl3FormatError(ValueError):
    """A checkpoint (or something about to be written as one) breaks the EXL3 format."""

    def __init__(self, message: str, *, file: str | os.PathLike | None = None,
                 tensor: str | None = None):
        self.file = os.fspath(file) if file is not None else None
        self.tensor = tensor
        where = []
        if self.file is not None:
            where.append(f"file {self.file}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)


class MissingFileError(Exl3FormatError):
    """A file the checkpoint needs (config.json, a shard named by the index) does not exist."""


class CorruptFileError(Exl3FormatError):
    """A file exists but cannot be parsed (truncated or corrupt safetensors, invalid JSON)."""


class UnsupportedQuantMethodError(Exl3FormatError):
    """config.json's quantization_config is missing or names a method other than exl3."""


class MissingTensorError(Exl3FormatError):
    """A tensor required by an EXL3 module (suh/svh, a tensor listed in an index) is absent."""


class TensorShapeError(Exl3FormatError):
    """A tensor's shape is invalid or disagrees with the other tensors of its module."""


class TensorDtypeError(Exl3FormatError):
    """A tensor has a dtype the format does not allow for it."""


class CodebookMarkerError(Exl3FormatError):
    """Codebook marker tensors are contradictory, malformed or carry a non-standard multiplier."""
