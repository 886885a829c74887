"""One dispatch point per hot operation (trellis matmul, MoE): reference or GPU kernel, and plan."""

from .moe import combine_matrix, moe, moe_experts, moe_tiered, stack_w13
from .trellis_matmul import (BACKEND_ENV, BACKENDS, pad_input, resolve_backend, trellis_matmul,
                             trellis_matmul_group)

__all__ = ["combine_matrix", "moe", "moe_experts", "moe_tiered", "stack_w13", "BACKEND_ENV", "BACKENDS", "pad_input", "resolve_backend", "trellis_matmul",
           "trellis_matmul_group"]
