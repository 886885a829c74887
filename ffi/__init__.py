"""GPU custom calls (installed as ``exl3_jax.ffi``): CuTe DSL kernels and their XLA FFI bindings."""
