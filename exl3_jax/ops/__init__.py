"""One dispatch point per hot operation (trellis matmul, MoE): reference or GPU kernel, and plan."""

from .trellis_matmul import BACKEND_ENV, BACKENDS, pad_input, resolve_backend, trellis_matmul

__all__ = ["BACKEND_ENV", "BACKENDS", "pad_input", "resolve_backend", "trellis_matmul"]
