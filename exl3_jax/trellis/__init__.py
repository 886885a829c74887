"""EXL3 math in jax.numpy: codebooks, bitstream, tile permutation, Hadamard, decode, reference.

Pure, jit-able, runs on any JAX backend; the oracle every GPU kernel is tested against.
"""

from .bitstream import is_tail_biting, pack_codes, ring_layout, tile_perm, unpack_states
from .codebook import codebook_table, decode_states
from .decode import decode_trellis, dequantize, linear_reference
from .hadamard import hadamard128, hadamard_matrix
from .rings import decode_embedding, pack_ring, unpack_ring_states
from .weight import Exl3Weight

__all__ = [
    "Exl3Weight", "codebook_table", "decode_embedding", "decode_states", "decode_trellis",
    "dequantize", "hadamard128", "hadamard_matrix", "is_tail_biting", "linear_reference",
    "pack_codes", "pack_ring", "ring_layout", "tile_perm", "unpack_ring_states",
    "unpack_states",
]
