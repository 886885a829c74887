"""Reading and writing EXL3 checkpoints (numpy + safetensors; no jax).

See shared/spec/exl3_format.md section 1 and exl3_format_165.md section 2.
"""

from .errors import (CodebookMarkerError, CorruptFileError, Exl3FormatError, MissingFileError,
                     MissingTensorError, TensorDtypeError, TensorShapeError,
                     UnsupportedQuantMethodError)
from .rank_sliced import (RankSlicedCheckpoint, RankSlicedConfigError,
                          TensorParallelMismatchError, is_rank_sliced, parse_rank_sliced_config)
from .reader import EmbeddingInfo, Exl3Checkpoint, TensorStore, read_json
from .spec import (CODEBOOKS, HALF_RATES, INTEGER_RATES, MCG_MULTIPLIER, MUL1_MULTIPLIER,
                   LinearInfo, marker_as_int32, rate_from_width, width_from_rate)
from .writer import Exl3Writer, staging_dir

__all__ = [
    "CODEBOOKS", "HALF_RATES", "INTEGER_RATES", "MCG_MULTIPLIER", "MUL1_MULTIPLIER",
    "CodebookMarkerError", "CorruptFileError", "EmbeddingInfo", "Exl3Checkpoint",
    "Exl3FormatError", "Exl3Writer", "LinearInfo", "MissingFileError", "MissingTensorError",
    "TensorDtypeError", "TensorShapeError", "TensorStore", "UnsupportedQuantMethodError",
    "marker_as_int32", "rate_from_width", "read_json", "staging_dir", "width_from_rate",
]
