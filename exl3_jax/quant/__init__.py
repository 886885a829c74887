"""The EXL3 encoder: Viterbi trellis quantizer, regularisation, LDLQ, converters."""

from .convert import HessianProvider, convert_hf
from .ldlq import QuantizeInfo, quantize_linear
from .viterbi import encode_tiles

__all__ = ["HessianProvider", "QuantizeInfo", "convert_hf", "encode_tiles", "quantize_linear"]
