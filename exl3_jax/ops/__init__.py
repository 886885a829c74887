"""One dispatch point per hot operation (trellis matmul, MoE): reference or GPU kernel, and plan."""

from .moe import combine_matrix, moe, moe_experts, moe_tiered, stack_w13
from .trellis_matmul import (BACKEND_ENV, BACKENDS, F16_MAX, fp16_operand, pad_input,
                             resolve_backend, trellis_matmul, trellis_matmul_group)

__all__ = ["BACKEND_ENV", "BACKENDS", "F16_MAX", "combine_matrix", "fp16_operand", "moe",
           "moe_experts", "moe_tiered", "pad_input", "resolve_backend", "stack_w13",
           "trellis_matmul", "trellis_matmul_group"]
