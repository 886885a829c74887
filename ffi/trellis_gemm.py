"""JAX entry point of the GPU Trellis GEMM (used by exl3_jax.ops.trellis_matmul).

    y = had128(had128(x * suh) @ W_hat) * svh + bias            (exl3_format.md 4.1)

Pipeline per call (plan picked at trace time from static shapes, exl3_jax.ops.plans):
  1. input transform kernel (ffi/hadamard.py): xh = fp16(had128(x * suh)), fp32 math;
  2. decode plan (m <= 32): the decode+MMA kernel (ffi/trellis_mma.py) -> fp32 partials per
     K-split; wgmma plan (Hopper, 25 <= m <= 128, or 256 for weights up to 128 Mi): the
     warpgroup-MMA kernel (ffi/trellis_wgmma.py), partials or, with one K-split, y itself
     (step 3 in its epilogue);
  3. output transform kernel: sum of the partials, had128, * svh, + bias, fp32.
Three launches for a decode step. The prefill plan has no transforms: the dequantize kernel
(ffi/trellis_dequant.py) writes the layer's weight itself (both Hadamards, suh and svh folded
in) as fp16 [k, n], and one XLA dot multiplies fp16(x / s) by it (s: prefill_scale). One token
(m = 1, the batch-1 decode step) runs as one custom call of two launches instead
(ffi/trellis_linear.py: each decode-kernel CTA rotates its own k range of the row, and the
output transform is chained behind it).
EXL3_JAX_TRANSFORMS=xla does steps 1 and 3 with jnp instead (the reference arithmetic; kept for
comparison and debugging).

The kernels consume the checkpoint's int16 trellis through a bitcast view as uint32 words; no
repacking. Importing this module does not import cutlass (CPU-only processes stay light); the
kernels are compiled by cutlass.jax.cutlass_call when a jitted function is lowered for CUDA.

Environment:
  EXL3_JAX_PLAN = auto | decode | prefill | tiles | wgmma
                                              force a plan kind (decode needs m <= 32; tiles:
                                              ffi/trellis_tiles.py, never chosen by auto;
                                              wgmma: ffi/trellis_wgmma.py, Hopper only).
  EXL3_JAX_CUTE_OPTIONS = "..."               extra cute.compile options (debugging).
  EXL3_JAX_TRANSFORMS = cute | xla            how the Hadamard transforms run (default cute).
  EXL3_JAX_GROUPS = 1 | 0                     linears sharing an input (q/k/v, gate/up) run as one
                                              group per kernel (default 1; group_supported).
  EXL3_JAX_ROW_LINEAR = 1 | 0 | all           one token as one custom call (default 1, up to
                                              trellis_linear.MAX_WEIGHTS weights; all: any size;
                                              0: the three calls of the decode plan).
  EXL3_JAX_ONE_TOKEN = 1 | 0                  m = 1 decode kernels read one token's activation
                                              words (trellis_mma.MmaConfig.one_token; default 1).
  EXL3_JAX_PAIR_FRAGMENTS = 1 | 0             packed decode kernels of 2+ token groups read
                                              B-fragment-ordered pairs (MmaConfig.pair_fragments;
                                              default 1; 0: row-major pairs, as the MoE reads).
  EXL3_JAX_SPLIT_GROUPS = 1 | 2 | 3 | 4       decode kernels of up to this many token groups run
                                              split pairs (MmaConfig.split_groups; default
                                              SPLIT_GROUPS_BY_K for 3inst / mcg: 3 at K = 4,
                                              else 1; mul1: 1).
  EXL3_JAX_MUL1_BYTESUM = 0 | 1              mul1 decode kernels sum the product's bytes with an
                                              int8 MMA and multiply packed h (MmaConfig.
                                              mul1_bytesum) instead of split / packed pairs
                                              (default 0).
  EXL3_JAX_TILES = m_tile,n_tiles,warps,splits,chunk
                                              the tiles plan's tiling (a tuning aid).
  EXL3_JAX_WGMMA = m_tile,warpgroups,splits[,fused_out[,ring]]
                                              the wgmma plan's tiling (a tuning aid).
  EXL3_JAX_DECODE_RING = off | R,unroll,splits[,min_ctas[,warps]]
                                              the decode plan's loads through a cp.async ring
                                              of R slots (0: direct loads; see DECODE_RING_ENV),
                                              0 = the plan's value for the others; off: direct
                                              loads everywhere (a tuning aid).
  EXL3_JAX_AOT_DIR = <dir>                    use the ahead-of-time artifacts of that directory
                                              (scripts/build_aot.py; see exl3_jax.ffi.aot)
                                              instead of compiling the kernels in this process.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from exl3_jax.ops.plans import DECODE_MAX_M, DEFAULT_SMS, TrellisPlan, select_plan
from exl3_jax.trellis import Exl3Weight, hadamard128

from . import emulate
from .trellis_geometry import lane_geometry, supported_rates

PLAN_ENV = "EXL3_JAX_PLAN"
# Extra cute.compile options passed through cutlass_call. (With 4.8.1, "--keep-ptx" given this
# way wrote no files; scripts/gpu_validate.py --sass compiles with cute.compile for PTX/SASS.)
CUTE_OPTIONS_ENV = "EXL3_JAX_CUTE_OPTIONS"
TRANSFORMS_ENV = "EXL3_JAX_TRANSFORMS"
GROUPS_ENV = "EXL3_JAX_GROUPS"
ROW_LINEAR_ENV = "EXL3_JAX_ROW_LINEAR"
ONE_TOKEN_ENV = "EXL3_JAX_ONE_TOKEN"
PAIR_FRAGMENTS_ENV = "EXL3_JAX_PAIR_FRAGMENTS"
SPLIT_GROUPS_ENV = "EXL3_JAX_SPLIT_GROUPS"
MUL1_BYTESUM_ENV = "EXL3_JAX_MUL1_BYTESUM"
TILES_ENV = "EXL3_JAX_TILES"
WGMMA_ENV = "EXL3_JAX_WGMMA"
# "R,unroll,splits[,min_ctas]": the decode plan's kernel streams its chunks through a cp.async
# ring of R slots per warp (MmaConfig.ring; R = 0: direct loads), unroll k16 steps per chunk,
# splits K-splits, a register cap fitting min_ctas CTAs per SM (0 keeps the plan's); the row
# linear then steps aside at m = 1. "off": the plans as before the ring (direct loads).
DECODE_RING_ENV = "EXL3_JAX_DECODE_RING"

if emulate.enabled():        # before any kernel call traces (scripts call the kernels directly)
    emulate.install()


@functools.lru_cache(maxsize=None)
def _cutlass_jax_ok() -> bool:
    if emulate.enabled():
        emulate.install()
        return True
    try:
        import cutlass.jax
    except Exception:          # ImportError, or a broken CUDA toolkit
        return False
    return bool(cutlass.jax.is_available())


def available() -> bool:
    """True when the CuTe DSL kernels can run in this process: a CUDA backend and either
    cutlass.jax or ahead-of-time artifacts ($EXL3_JAX_AOT_DIR, checked first so an AOT-only
    process never imports the CuTe compiler); or EXL3_JAX_EMULATE=1 (ffi/emulate.py: the
    kernels' PTX interpreted on the CPU)."""
    if emulate.enabled():
        return _cutlass_jax_ok()
    try:
        on_gpu = jax.default_backend() == "gpu"
    except RuntimeError:
        return False
    from . import aot
    return on_gpu and (aot.artifacts() is not None or _cutlass_jax_ok())


def supports(weight: Exl3Weight) -> bool:
    """Whether the kernels handle this weight (rate and codebook); others use the reference."""
    return weight.K in supported_rates() and not weight.stack_shape


def device_sms() -> int:
    try:
        dev = jax.devices()[0]
        return int(getattr(dev, "core_count", 0)) or DEFAULT_SMS
    except Exception:
        return DEFAULT_SMS


def plan_force() -> str | None:
    """The plan kind $EXL3_JAX_PLAN forces, None for auto."""
    force = os.environ.get(PLAN_ENV, "auto") or "auto"
    return None if force == "auto" else force


def plan_for(m: int, weight: Exl3Weight, force: str | None = None) -> TrellisPlan:
    """The plan of one linear on this process's device (its SMs and arch; a CPU process plans
    for $CUTE_DSL_ARCH), ``force`` or $EXL3_JAX_PLAN picking the kind."""
    return plan_for_shape(m, weight.k, weight.n, force, codebook=weight.codebook)


def plan_for_shape(m: int, k: int, n: int, force: str | None = None, *,
                   codebook: str | None = None) -> TrellisPlan:
    """plan_for of an [m, k] @ [k, n] linear (a linear group: n the members' sum) in
    ``codebook``, with the tuning environment ($EXL3_JAX_TILES, _WGMMA, _DECODE_RING)
    applied."""
    from .aot import device_arch
    plan = select_plan(m, k, n, sms=device_sms(), force=force or plan_force(),
                       hopper=device_arch() == "sm_90a", codebook=codebook)
    tiling = os.environ.get({"tiles": TILES_ENV, "wgmma": WGMMA_ENV}.get(plan.kind, ""), "")
    if tiling:
        from exl3_jax.ops.plans import tiled_plan
        plan = tiled_plan(plan.kind, m, k, n, tiling)
    ring = os.environ.get(DECODE_RING_ENV, "")
    if plan.kind == "decode" and ring == "off":
        from exl3_jax.ops.plans import decode_plan
        plan = decode_plan(m, k, n, sms=device_sms(), ring=False)
    elif plan.kind == "decode" and ring:
        try:
            slots, unroll, splits, *more = (int(v) for v in ring.split(","))
            if len(more) > 2:
                raise ValueError
        except ValueError:
            raise ValueError(f"{DECODE_RING_ENV} must be 'slots,unroll,splits[,min_ctas"
                             f"[,warps]]', got {ring!r}") from None
        cap, warps = (more + [0, 0])[:2]
        plan = dataclasses.replace(plan, ring=slots, unroll=unroll or plan.unroll,
                                   splits=splits or plan.splits, min_ctas=cap or plan.min_ctas,
                                   warps=warps or plan.warps)
    return plan


# ---------------------------------------------------------------------------------------------
# Views and transforms


def trellis_words(trellis) -> jax.Array:
    """int16 [k/16, n/16, W] -> flat uint32 [k/16 * n/16 * W/2] (U[m] = u[2m] | u[2m+1] << 16);
    a bitcast, no repacking."""
    t = jnp.asarray(trellis, jnp.int16)
    t = t.reshape(*t.shape[:-1], t.shape[-1] // 2, 2)
    return lax.bitcast_convert_type(t, jnp.uint32).reshape(-1)


ROW_LIMIT_LOG2 = 12     # the fp16 boundary: max|x * suh| / s <= 2^12 per row (hadamard.py)


def _power_of_two_scale(amax, limit_log2: int):
    """float32, amax's shape: the smallest power of two s >= amax / 2^limit_log2, at least 1
    (amax >= 0 float32), by exponent arithmetic (round the exponent up, then subtract)."""
    bits = lax.bitcast_convert_type(amax, jnp.int32)
    bits = ((bits + 0x7FFFFF) & 0x7F800000) - (limit_log2 << 23)
    return lax.bitcast_convert_type(jnp.maximum(bits, 0x3F800000), jnp.float32)


def row_scale(x, suh):
    """float32 [m, 1]: each row's power-of-two scale at the fp16 boundary (hadamard.py), the
    smallest s = 2^j >= max|x * suh| / 2^ROW_LIMIT_LOG2 with s >= 1, by exponent arithmetic as
    in the kernel. x [m, k]; suh [k], or a group's G members' suh (a sequence, or their
    concatenation [G * k]): the max over the G copies x * suh_g."""
    if isinstance(suh, (list, tuple)):
        suh = jnp.concatenate([jnp.asarray(v, jnp.float32) for v in suh])
    xf = jnp.asarray(x, jnp.float32)
    xs = jnp.tile(xf, (1, suh.shape[0] // xf.shape[1])) * jnp.asarray(suh, jnp.float32)
    return _power_of_two_scale(jnp.max(jnp.abs(xs), axis=1, keepdims=True), ROW_LIMIT_LOG2)


def input_transform(x, suh):
    """(xh = fp16(had128(x * suh) / s) [m, k], s = row_scale float32 [m, 1])."""
    s = row_scale(x, suh)
    xs = jnp.asarray(x, jnp.float32) * jnp.asarray(suh, jnp.float32) / s
    return hadamard128(xs).astype(jnp.float16), s


def output_transform(y, svh, bias=None, scale=None):
    """had128(y') * svh (* scale) (+ bias), fp32; scale: the row_scale of the input transform."""
    y = hadamard128(y) * jnp.asarray(svh, jnp.float32)
    if scale is not None:
        y = y * scale
    return y if bias is None else y + jnp.asarray(bias, jnp.float32)


def _padded_rows(xh, m_pad: int):
    """fp16 [m, k] -> fp16 [m_pad, k], zero rows appended."""
    m = xh.shape[0]
    xh = jnp.asarray(xh, jnp.float16)
    return xh if m_pad == m else jnp.pad(xh, ((0, m_pad - m), (0, 0)))


def _f16_pairs(xh, m_pad: int):
    """fp16 [m, k] -> flat uint32 [m_pad * k/2], zero-padded rows."""
    return f16_words(_padded_rows(xh, m_pad).reshape(-1))


def b_fragment_words(xh, m_pad: int):
    """fp16 [m, k] -> flat uint32 [m_pad * k], the split-pair B-fragment words of the decode
    kernel (each value in both halves of its word; zero-padded rows;
    trellis_geometry.b_fragment_slot / b_fragment_word as one reshape and transpose). The input
    transform kernel writes the same words directly (hadamard_in layout "fragments")."""
    xh = _padded_rows(xh, m_pad)
    # [G, tok, kt, r, t, h]: k = 16 kt + 8 r + 2 t + h, row = 8 G + tok -> [G, kt, tok, t, h, r].
    x6 = xh.reshape(m_pad // 8, 8, xh.shape[1] // 16, 2, 4, 2)
    return jnp.transpose(_both_halves(x6), (0, 2, 1, 4, 5, 3)).reshape(-1)


def token_fragment_words(xh):
    """fp16 [1, k] -> flat uint32 [k], one token's split-pair B-fragment words (each value in
    both halves; trellis_geometry.token_fragment_word as one reshape and transpose; the input
    transform kernel writes them with layout "token")."""
    # [kt, r, t, h]: k = 16 kt + 8 r + 2 t + h -> [kt, t, h, r] (register 2h + r of lane t).
    x4 = jnp.asarray(xh, jnp.float16).reshape(xh.shape[-1] // 16, 2, 4, 2)
    return jnp.transpose(_both_halves(x4), (0, 2, 3, 1)).reshape(-1)


def _both_halves(x):
    """fp16 [...] -> uint32 [...], each value in both halves of its word (a split-pair B word:
    the MMA adds lo * x + hi * x, cute_ops.decode_halves)."""
    bits = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)
    return bits | (bits << 16)


def pair_fragment_words(xh, m_pad: int):
    """fp16 [m, k] -> flat uint32 [m_pad * k/2], the packed B-fragment words ("pairs",
    trellis_geometry.pair_fragment_word as one reshape and transpose; zero-padded rows)."""
    xh = _padded_rows(xh, m_pad)
    # [G, tok, kt, i, t, h]: k = 16 kt + 8 i + 2 t + h, row = 8 G + tok -> [G, kt, i, tok, t, h].
    x6 = xh.reshape(m_pad // 8, 8, xh.shape[1] // 16, 2, 4, 2)
    return f16_words(jnp.transpose(x6, (0, 2, 3, 1, 4, 5)).reshape(-1))


def quad_fragment_words(xh, rows: int):
    """fp16 [m, k] -> flat uint32 [rows * k/2], the byte-sum kernels' "quads" words
    (trellis_geometry.quad_fragment_index as one reshape and transpose; zero-padded rows; one
    row: row-major)."""
    xh = _padded_rows(xh[:rows], rows)
    g = min(rows, 8)
    # [G, tok, kt, c] -> [G, kt, tok, c]
    x4 = xh.reshape(rows // g, g, xh.shape[1] // 16, 16)
    return f16_words(jnp.transpose(x4, (0, 2, 1, 3)).reshape(-1))


def mma_input_words(xh, cfg):
    """fp16 [m, k] -> the words ``xw`` of the decode kernel ``cfg`` (trellis_mma.MmaConfig)."""
    if cfg.x_layout == "token":
        return token_fragment_words(xh[:1])
    if cfg.x_layout == "fragments":
        return b_fragment_words(xh, cfg.m_pad)
    if cfg.x_layout == "pairs":
        return pair_fragment_words(xh, cfg.m_pad)
    if cfg.x_layout == "quads":
        return quad_fragment_words(xh, x_rows(cfg))
    return _f16_pairs(xh, cfg.m_pad)


def x_rows(cfg) -> int:
    """Rows of the decode kernel's activation words: 1 where it reads one token's (layout
    "token", or "quads" with one_token), else m_pad."""
    return 1 if cfg.reads_one_token else cfg.m_pad


def f16_words(xh_flat):
    """fp16 [2j] -> uint32 [j] (bitcast, no copy)."""
    return lax.bitcast_convert_type(xh_flat.reshape(-1, 2), jnp.uint32)


# ---------------------------------------------------------------------------------------------
# Kernel calls (rotated basis)


def _cute_options() -> str | None:
    return os.environ.get(CUTE_OPTIONS_ENV) or None


def _one_token(plan: TrellisPlan) -> bool:
    return plan.m == 1 and os.environ.get(ONE_TOKEN_ENV, "1") != "0"


def _pair_fragments() -> bool:
    return os.environ.get(PAIR_FRAGMENTS_ENV, "1") == "1"


# 3inst / mcg decode kernels run split pairs up to this many token groups by default, per K
# (H100, session 23, 8192x28672 and 4096x14336 m = 16, mcg: 3 groups against packed pairs
# -9 to -12% at K4, -1 to 0% at K3; other rates not measured). mul1: one group (2 groups,
# which add one MMA per k16 step and group for the sums of x and 17 registers at K4, ran
# +16 / +22% at K4 and +1 / +4% at K3 against packed pairs at m = 16: H100, session 26).
SPLIT_GROUPS_BY_K = {4: 3}


def _split_groups(K, codebook: str) -> int:
    env = os.environ.get(SPLIT_GROUPS_ENV, "")
    if env:
        return int(env)
    return 1 if codebook == "mul1" else SPLIT_GROUPS_BY_K.get(K, 1)


def _mul1_bytesum() -> bool:
    return os.environ.get(MUL1_BYTESUM_ENV, "0") == "1"


def _mma_config(weight: Exl3Weight, plan: TrellisPlan, members: tuple = ()):
    """The decode kernel's MmaConfig for ``weight`` (a group: its first member, and
    ``members`` the members' n)."""
    from .trellis_mma import RING_SMEM_BYTES, MmaConfig
    cfg = MmaConfig(codebook=weight.codebook, K=weight.K, m_blocks=-(-plan.m // plan.m_tile),
                    k=weight.k, n=sum(members) or weight.n, m_tile=plan.m_tile,
                    n_tiles=plan.n_tiles, warps=plan.warps, splits=plan.splits,
                    unroll=plan.unroll, min_ctas=plan.min_ctas, members=members,
                    one_token=_one_token(plan), pair_fragments=_pair_fragments(),
                    split_groups=_split_groups(weight.K, weight.codebook),
                    mul1_bytesum=_mul1_bytesum())
    if plan.ring and cfg.ring_layout_ok:    # else (packed pairs): direct loads
        cfg = dataclasses.replace(cfg, ring=plan.ring)
        # wide tiles (K >= 7 at 8 steps) or 8 tokens' B fragments: shorter chunks until the
        # ring fits its shared memory
        while cfg.ring_bytes > RING_SMEM_BYTES and cfg.unroll > 1:
            cfg = dataclasses.replace(cfg, unroll=cfg.unroll // 2)
    return cfg.validate()


TOKEN_TILE_KINDS = ("tiles", "wgmma")     # plans whose kernel takes row-major f16 pairs


def _tiles_config(weight: Exl3Weight, plan: TrellisPlan):
    """The kernel config of a token-tile plan (kind "tiles" or "wgmma")."""
    if plan.kind == "wgmma":
        from .aot import device_arch
        from .trellis_wgmma import ARCH, WEIGHT_RING, WgmmaGemmConfig
        if (arch := device_arch()) != ARCH:
            raise ValueError(f"the wgmma plan needs a Hopper GPU ({ARCH}); the kernels are "
                             f"built for {arch or 'no CUDA device'}: use the tiles plan there")
        return WgmmaGemmConfig(codebook=weight.codebook, K=weight.K,
                               m_blocks=-(-plan.m // plan.m_tile), k=weight.k, n=weight.n,
                               m_tile=plan.m_tile, warpgroups=plan.warps // 4,
                               splits=plan.splits, fused_out=plan.fused_out,
                               weight_ring=plan.weight_ring or WEIGHT_RING,
                               biased=plan.fused_out and weight.bias is not None).validate()
    from .trellis_tiles import TileGemmConfig
    return TileGemmConfig(codebook=weight.codebook, K=weight.K,
                          m_blocks=-(-plan.m // plan.m_tile), k=weight.k, n=weight.n,
                          m_tile=plan.m_tile, warps=plan.warps, n_tiles=plan.n_tiles,
                          splits=plan.splits, k_chunk=plan.unroll).validate()


def tiles_partials_words(xw, weight: Exl3Weight, plan: TrellisPlan, out_init=None, scale=None):
    """A token-tile kernel (ffi/trellis_tiles.py, or ffi/trellis_wgmma.py for kind "wgmma") on
    row-major activation words xw (f16 pairs [m_pad, k/2]): flat fp32 [splits * m_pad * n]
    partials, or for a wgmma plan with ``fused_out`` y [m_pad * n] (the output transform done
    in the kernel's epilogue with the input transform's row scales ``scale``, float32 [m_pad]).
    out_init: as in mma_partials_words."""
    from cutlass.jax import cutlass_call

    cfg = _tiles_config(weight, plan)
    tw = trellis_words(weight.trellis)
    rows = cfg.m_pad if cfg.fused_out else cfg.splits * cfg.m_pad
    shape = jax.ShapeDtypeStruct((rows * cfg.n,), jnp.float32)
    if plan.kind == "wgmma":
        from .trellis_wgmma import launch_trellis_wgmma as launch
        if scale is None:
            scale = jnp.ones((cfg.m_pad,), jnp.float32)
        svh = jnp.asarray(weight.svh, jnp.float16)
        args = [xw, tw, svh, svh if weight.bias is None else
                jnp.asarray(weight.bias, jnp.float16), jnp.asarray(scale, jnp.float32)]
    else:
        from .trellis_tiles import launch_trellis_tiles as launch
        args = [xw, tw]
    aliases = {}
    if out_init is not None:
        aliases = {len(args): 0}
        args.append(out_init)
    return cutlass_call(launch, output_shape_dtype=shape, input_output_aliases=aliases, cfg=cfg,
                        compile_options=_cute_options())(*args)


def _dequant_config(weight: Exl3Weight, rotate: bool):
    from .trellis_dequant import DequantConfig
    return DequantConfig(codebook=weight.codebook, K=weight.K, k=weight.k, n=weight.n,
                         rotate=rotate).validate()


def mma_partials_words(xw, weight: Exl3Weight, plan: TrellisPlan, out_init=None):
    """Decode+MMA kernel on activation words xw (mma_input_words): flat fp32
    [splits * m_pad * n].

    out_init: optional float32 buffer of that size which the kernel writes in place (aliased),
    e.g. NaN-poisoned by tests so unwritten elements show.
    """
    from cutlass.jax import cutlass_call

    from .trellis_mma import launch_trellis_mma

    cfg = _mma_config(weight, plan)
    tw = trellis_words(weight.trellis)
    shape = jax.ShapeDtypeStruct((cfg.splits * cfg.m_pad * cfg.n,), jnp.float32)
    if out_init is None:
        return cutlass_call(launch_trellis_mma, output_shape_dtype=shape, cfg=cfg,
                            compile_options=_cute_options())(xw, tw)
    return cutlass_call(launch_trellis_mma, output_shape_dtype=shape,
                        input_output_aliases={2: 0}, cfg=cfg,
                        compile_options=_cute_options())(xw, tw, out_init)


def mma_partials(xh, weight: Exl3Weight, plan: TrellisPlan, out_init=None):
    """Decode+MMA kernel on an fp16 [m, k] activation (zero-padded to m_pad here):
    fp32 [splits, m_pad, n] partial sums of xh @ W_hat (rows >= m are 0, or copies of row 0
    with MmaConfig.one_token)."""
    cfg = _mma_config(weight, plan)
    out = mma_partials_words(mma_input_words(xh, cfg), weight, plan, out_init)
    return out.reshape(cfg.splits, cfg.m_pad, cfg.n)


def _as_members(v) -> list:
    """One array (a single linear) or a sequence of the members' arrays -> list."""
    return list(v) if isinstance(v, (list, tuple)) else [v]


def _bias_args(biases, svhs) -> list:
    """The output transform's bias pointers: a member without a bias passes its svh (never
    read: its HadamardConfig.biased entry is False)."""
    return _member_args([b if b is not None else v for b, v in zip(biases, svhs)], jnp.float16)


def _member_args(arrays, dtype=None) -> list:
    """The MAX_MEMBERS kernel pointers of a linear group (or one linear): the members' arrays
    (cast to ``dtype`` if given), unused slots repeating the last."""
    from .trellis_mma import MAX_MEMBERS
    out = [jnp.asarray(a, dtype) for a in arrays]
    return out + [out[-1]] * (MAX_MEMBERS - len(out))


def hadamard_in(x, suh, m_pad: int, layout: str = "rows"):
    """Input transform kernel: x [m, k] -> (flat fp16 had128(x * suh) / s with zero rows beyond
    m, [m_pad * k] row-major (layout "rows"), or [2 * m_pad * k] in the decode kernel's
    split-pair B-fragment order (layout "fragments", see b_fragment_words; "token": m = m_pad
    = 1, token_fragment_words); s float32 [m_pad], the rows' fp16-boundary scales (row_scale;
    1 beyond m)).

    suh: f16 [k], or a linear group's G members' suh (a sequence of G [k] vectors): the result
    is then that of the row [x, ..., x] (G * k wide), copy g rotated with suh[g]."""
    from cutlass.jax import cutlass_call

    from .hadamard import HadamardConfig, launch_hadamard_in

    suhs = _as_members(suh)
    m, k = x.shape
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.float32)
    cfg = HadamardConfig.input(m_pad, m, k * len(suhs), layout=layout, inputs=len(suhs))
    return cutlass_call(launch_hadamard_in, cfg=cfg, compile_options=_cute_options(),
                        output_shape_dtype=(
                            jax.ShapeDtypeStruct((cfg.out_size,), jnp.float16),
                            jax.ShapeDtypeStruct((m_pad,), jnp.float32)))(
        x.reshape(-1), *_member_args(suhs, jnp.float16))


def decode_input_words(x, suh, cfg):
    """The decode plan's input transform: x [m, k] -> (the MMA kernel's activation words for
    ``cfg`` (trellis_mma.MmaConfig; as mma_input_words of the rotated x), row scales float32
    [m_pad]), one launch."""
    xh, scale = hadamard_in(x, suh, x_rows(cfg), cfg.x_layout)
    return f16_words(xh), scale


def _group_config(weights, plan: TrellisPlan):
    return _mma_config(weights[0], plan, tuple(w.n for w in weights))


def mma_group_partials_words(xw, weights, plan: TrellisPlan, out_init=None):
    """The decode kernel over a linear group (``_group_config``) on the group's activation
    words (as mma_input_words of the [m, G * k] row of rotated copies): flat fp32
    [splits * m_pad * sum(n)], member i's columns after those of members < i.
    out_init: as in mma_partials_words."""
    from cutlass.jax import cutlass_call

    from .trellis_mma import MAX_MEMBERS, launch_trellis_mma_group

    cfg = _group_config(weights, plan)
    tws = _member_args([trellis_words(w.trellis) for w in weights])
    shape = jax.ShapeDtypeStruct((cfg.splits * cfg.m_pad * cfg.n,), jnp.float32)
    if out_init is None:
        return cutlass_call(launch_trellis_mma_group, output_shape_dtype=shape, cfg=cfg,
                            compile_options=_cute_options())(xw, *tws)
    return cutlass_call(launch_trellis_mma_group, output_shape_dtype=shape,
                        input_output_aliases={1 + MAX_MEMBERS: 0}, cfg=cfg,
                        compile_options=_cute_options())(xw, *tws, out_init)


def _row_linear_config(weights, plan: TrellisPlan):
    """The row linear's config (ffi/trellis_linear.py) for one linear or a group (a list of
    2..3 weights) when ``plan`` is a one-token decode plan, or None: another plan, no row
    tiling fits (trellis_linear.row_plan), or $EXL3_JAX_ROW_LINEAR is 0."""
    from .hadamard import HadamardConfig
    mode = os.environ.get(ROW_LINEAR_ENV, "1")
    if mode == "0" or plan.kind != "decode" or plan.m != 1 or plan.ring:
        return None
    from . import trellis_linear
    weights = _as_members(weights)
    w0 = weights[0]
    members = tuple(w.n for w in weights) if len(weights) > 1 else ()
    max_weights = None if mode == "all" else trellis_linear.MAX_WEIGHTS
    mma = trellis_linear.row_plan(w0.codebook, w0.K, w0.k, sum(w.n for w in weights), members,
                                  sms=device_sms(), max_weights=max_weights)
    if mma is None:
        return None
    out = HadamardConfig(rows=1, valid=1, width=mma.n, splits=mma.splits, part_rows=1,
                         members=members, biased=tuple(w.bias is not None for w in weights))
    return trellis_linear.RowLinearConfig(mma=mma, out=out)


def row_linear(x_row, weights, cfg, *, poison: bool = False):
    """One token through one linear or a linear group as one custom call
    (ffi/trellis_linear.py). x_row: float [1, k]; weights: an Exl3Weight or 2..3 of them (one
    k, K, codebook); cfg: _row_linear_config's. poison: the partials are a NaN-filled buffer
    the kernel writes in place. Returns float32 [1, sum(n)] including bias."""
    from cutlass.jax import cutlass_call

    from .trellis_linear import launch_row_linear

    weights = _as_members(weights)
    x = x_row.reshape(-1)
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.float32)
    c = cfg.mma
    nparts = c.splits * c.n
    args = [x, *_member_args([w.suh for w in weights], jnp.float16),
            *_member_args([trellis_words(w.trellis) for w in weights]),
            *_member_args([w.svh for w in weights], jnp.float16),
            *_bias_args([w.bias for w in weights], [w.svh for w in weights]),
            jnp.ones((1,), jnp.float32)]
    shapes = (jax.ShapeDtypeStruct((nparts,), jnp.float32),
              jax.ShapeDtypeStruct((c.n,), jnp.float32))
    aliases = {}
    if poison:
        aliases = {len(args): 0}
        args.append(jnp.full((nparts,), np.float32(np.nan)))
    _, y = cutlass_call(launch_row_linear, output_shape_dtype=shapes, cfg=cfg,
                        input_output_aliases=aliases, compile_options=_cute_options())(*args)
    return y.reshape(1, c.n)


def hadamard_out(part, svh, bias, scale, *, m: int, m_pad: int, splits: int, n: int):
    """Output transform kernel: flat fp32 partials [splits * m_pad * n] and the input
    transform's row scales (float32 [m_pad], or None for 1) -> y fp32 [m, n].

    svh / bias: f16 [n] and f16 [n] or None for one linear; for a linear group, sequences of
    the members' svh [n_g] and bias [n_g] or None (sum n_g = n)."""
    from cutlass.jax import cutlass_call

    from .hadamard import HadamardConfig, launch_hadamard_out

    svhs = _as_members(svh)
    biases = _as_members(bias)
    cfg = HadamardConfig(rows=m, valid=m, width=n, splits=splits, part_rows=m_pad,
                         members=tuple(int(v.shape[0]) for v in svhs),
                         biased=tuple(b is not None for b in biases))
    if scale is None:
        scale = jnp.ones((m_pad,), jnp.float32)
    y = cutlass_call(launch_hadamard_out, cfg=cfg, compile_options=_cute_options(),
                     output_shape_dtype=jax.ShapeDtypeStruct((m * n,), jnp.float32))(
        part, *_member_args(svhs, jnp.float16),
        *_bias_args(biases, svhs),
        jnp.asarray(scale, jnp.float32).reshape(-1))
    return y.reshape(m, n)


PREFILL_LIMIT_LOG2 = 15  # the prefill plan's fp16 operand: max|x| / s <= 2^15 over the batch


def prefill_scale(x):
    """float32 [1]: the smallest power of two s >= max|x| / 2^PREFILL_LIMIT_LOG2 over the whole
    batch, at least 1 (exponent arithmetic as row_scale), so fp16(x / s) cannot overflow. The
    dequantize kernel multiplies the weight by s, so y = fp16(x / s) @ (W * s) needs no pass
    over y; W * s overflows fp16 only where |W| * max|x| exceeds ~2^30."""
    return _power_of_two_scale(jnp.max(jnp.abs(jnp.asarray(x, jnp.float32))).reshape(1),
                               PREFILL_LIMIT_LOG2)


def dequantize_f16(weight: Exl3Weight, *, rotate: bool, scale=None, out_init=None):
    """Dequantize kernel (ffi/trellis_dequant.py): float16 [k, n].

    rotate=False: W_hat, the rotated-basis weight (bit-exact decode); rotate=True: the layer's
    weight diag(suh) had128(W_hat) diag(svh) times ``scale`` (float32 [1], default 1), so that
    x @ it is the linear without its bias. out_init: optional uint32 [k * n/2] buffer written in
    place (validation: NaN-filled, so unwritten elements show)."""
    from cutlass.jax import cutlass_call

    from .trellis_dequant import launch_trellis_dequant

    cfg = _dequant_config(weight, rotate)
    scale = jnp.ones((1,), jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
    svh_words = lax.bitcast_convert_type(
        jnp.asarray(weight.svh, jnp.float16).reshape(cfg.n // 2, 2), jnp.uint32)
    args = (trellis_words(weight.trellis), jnp.asarray(weight.suh, jnp.float16), svh_words,
            scale.reshape(1))
    shape = jax.ShapeDtypeStruct((cfg.k * cfg.n // 2,), jnp.uint32)
    if out_init is None:
        out = cutlass_call(launch_trellis_dequant, output_shape_dtype=shape, cfg=cfg,
                           compile_options=_cute_options())(*args)
    else:
        out = cutlass_call(launch_trellis_dequant, output_shape_dtype=shape,
                           input_output_aliases={4: 0}, cfg=cfg,
                           compile_options=_cute_options())(*args, out_init)
    return lax.bitcast_convert_type(out.reshape(cfg.k, cfg.n // 2), jnp.float16).reshape(
        cfg.k, cfg.n)


def prefill_operand(x2):
    """(fp16(x / s) [m, k], s float32 [1]): the prefill plan's activation operand and its
    batch scale (prefill_scale), from x2 float [m, k]."""
    s = prefill_scale(x2)
    return (jnp.asarray(x2, jnp.float32) / s).astype(jnp.float16), s


def prefill_matmul(x2, weight: Exl3Weight):
    """The prefill plan: y = fp16(x / s) @ (W * s) + bias, float32 [m, n] (x2: float [m, k]).
    One dequantize launch and one XLA dot; no transform kernels."""
    x16, s = prefill_operand(x2)
    w = dequantize_f16(weight, rotate=True, scale=s)
    y = lax.dot_general(x16, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
    return y if weight.bias is None else y + jnp.asarray(weight.bias, jnp.float32)


def rotated_matmul(xh, weight: Exl3Weight, plan: TrellisPlan, *, poison: bool = False):
    """y' = xh @ W_hat, float32 [m, n], with the plan's kernel(s) (xh: fp16 [m, k]).

    poison: the kernels write into NaN-filled buffers (aliased outputs), so any element they
    fail to write shows as NaN (validation)."""
    if plan.kind == "decode":
        init = None
        if poison:
            cfg = _mma_config(weight, plan)
            init = jnp.full((cfg.splits * cfg.m_pad * cfg.n,), np.float32(np.nan))
        return jnp.sum(mma_partials(xh, weight, plan, out_init=init), axis=0)[:plan.m]
    if plan.kind in TOKEN_TILE_KINDS:
        plan = dataclasses.replace(plan, fused_out=False)      # the partials themselves
        cfg = _tiles_config(weight, plan)
        init = (jnp.full((cfg.splits * cfg.m_pad * cfg.n,), np.float32(np.nan)) if poison
                else None)
        part = tiles_partials_words(_f16_pairs(xh, cfg.m_pad), weight, plan, out_init=init)
        return jnp.sum(part.reshape(cfg.splits, cfg.m_pad, cfg.n), axis=0)[:plan.m]
    init = jnp.full((weight.k * weight.n // 2,), np.uint32(0x7E007E00)) if poison else None
    w_hat = dequantize_f16(weight, rotate=False, out_init=init)
    return lax.dot_general(jnp.asarray(xh, jnp.float16), w_hat, (((1,), (0,)), ((), ())),
                           preferred_element_type=jnp.float32)


def _transforms_mode(transforms: str | None) -> str:
    mode = transforms or os.environ.get(TRANSFORMS_ENV, "cute") or "cute"
    if mode not in ("cute", "xla"):
        raise ValueError(f"{TRANSFORMS_ENV} must be 'cute' or 'xla', got {mode!r}")
    return mode


def trellis_matmul_gpu(x, weight: Exl3Weight, *, plan: str | TrellisPlan | None = None,
                       transforms: str | None = None):
    """y = x @ W + bias for one EXL3 linear on the GPU.

    Args:
      x: float [..., k] (already zero-extended to the padded k).
      weight: Exl3Weight without stack axes.
      plan: None (auto / EXL3_JAX_PLAN), a plan kind, or a TrellisPlan.
      transforms: None (EXL3_JAX_TRANSFORMS, default "cute") or "cute" / "xla".
    Returns:
      float32 [..., n] including bias (untrimmed).
    """
    if weight.stack_shape:
        raise ValueError("trellis_matmul_gpu takes one linear")
    if not supports(weight):
        raise ValueError(f"no GPU kernel for K={weight.K}")
    lead = x.shape[:-1]
    m = int(np.prod(lead)) if lead else 1
    if m == 0:
        return jnp.zeros((*lead, weight.n), jnp.float32)
    x2 = jnp.reshape(x, (m, weight.k))
    if not isinstance(plan, TrellisPlan):
        plan = plan_for(m, weight, plan)
    mode = _transforms_mode(transforms)
    from . import aot
    exported = aot.lookup_linear(x2, weight, plan, mode, jit_ok=_cutlass_jax_ok)
    if exported is not None:      # ahead-of-time kernels: inlined into the caller's program
        args = (x2, weight.trellis, weight.suh, weight.svh) + (
            () if weight.bias is None else (weight.bias,))
        return exported.call(*args).reshape(*lead, weight.n)
    if mode == "xla":
        xh, scale = input_transform(x2, weight.suh)
        y = output_transform(rotated_matmul(xh, weight, plan), weight.svh, weight.bias, scale)
    elif (row_cfg := _row_linear_config(weight, plan)) is not None:
        y = row_linear(x2, weight, row_cfg)
    elif plan.kind == "decode":
        cfg = _mma_config(weight, plan)
        xw, scale = decode_input_words(x2, weight.suh, cfg)
        part = mma_partials_words(xw, weight, plan)
        y = hadamard_out(part, weight.svh, weight.bias, scale, m=m, m_pad=cfg.m_pad,
                         splits=cfg.splits, n=weight.n)
    elif plan.kind in TOKEN_TILE_KINDS:
        cfg = _tiles_config(weight, plan)
        xh, scale = hadamard_in(x2, weight.suh, cfg.m_pad)
        if plan.fused_out:
            y = tiles_partials_words(f16_words(xh), weight, plan, scale=scale).reshape(
                cfg.m_pad, weight.n)[:m]
        else:
            part = tiles_partials_words(f16_words(xh), weight, plan)
            y = hadamard_out(part, weight.svh, weight.bias, scale, m=m, m_pad=cfg.m_pad,
                             splits=cfg.splits, n=weight.n)
    else:
        y = prefill_matmul(x2, weight)
    return y.reshape(*lead, weight.n)


def group_supported(weights, m: int) -> bool:
    """Whether linears reading the same [m, k] x can run as one group (trellis_matmul_group_gpu):
    2..3 members with one k, K and codebook and no stack axes, m <= DECODE_MAX_M with no plan
    kind but decode forced (the group kernel is the decode kernel; at m = 25..32 a group stays
    on it on Hopper too, where a single linear takes wgmma: one launch for q/k/v against three,
    two of them narrow, not measured against each other), CuTe transforms, and kernels
    compiled in this process (ahead-of-time artifacts exist per linear only).
    EXL3_JAX_GROUPS=0 turns groups off (each member runs as its own linear)."""
    if os.environ.get(GROUPS_ENV, "1") == "0":
        return False
    from . import aot
    from .trellis_mma import MAX_MEMBERS
    w0 = weights[0]
    return (2 <= len(weights) <= MAX_MEMBERS
            and all(supports(w) and (w.k, w.K, w.codebook) == (w0.k, w0.K, w0.codebook)
                    for w in weights)
            and m <= DECODE_MAX_M and plan_force() in (None, "decode")
            and _transforms_mode(None) == "cute"
            and aot.artifacts() is None and _cutlass_jax_ok())


def trellis_matmul_group(x2, weights, plan: TrellisPlan, *, poison: bool = False):
    """y = [x2 @ W_i + bias_i] as one float32 [m, sum(n_i)] for linears reading the same x2
    [m, k] (q/k/v, gate/up): one input transform (x2 rotated by each member's suh), one decode
    launch over all members' tiles, one output transform (svh, bias and the Hadamard act per
    128-column block, and no block straddles two members). ``plan`` is the decode plan of
    [m, k] @ [k, sum(n_i)]. poison: the decode kernel writes into a NaN-filled buffer."""
    m = x2.shape[0]
    row_cfg = _row_linear_config(weights, plan)
    if row_cfg is not None:
        return row_linear(x2, weights, row_cfg, poison=poison)
    cfg = _group_config(weights, plan)
    xh, scale = hadamard_in(x2, [w.suh for w in weights], x_rows(cfg), cfg.x_layout)
    init = jnp.full((cfg.splits * cfg.m_pad * cfg.n,), np.float32(np.nan)) if poison else None
    part = mma_group_partials_words(f16_words(xh), weights, plan, out_init=init)
    return hadamard_out(part, [w.svh for w in weights], [w.bias for w in weights], scale,
                        m=m, m_pad=cfg.m_pad, splits=cfg.splits, n=cfg.n)


def trellis_matmul_group_gpu(x, weights):
    """[y_i = x @ W_i + bias_i] for linears reading the same x (group_supported must hold).

    Args:
      x: float [..., k] (already zero-extended to the padded k).
      weights: 2..3 Exl3Weight with one k, K and codebook.
    Returns:
      list of float32 [..., n_i] including bias (untrimmed).
    """
    lead = x.shape[:-1]
    m = int(np.prod(lead)) if lead else 1
    k = weights[0].k
    plan = plan_for_shape(m, k, sum(w.n for w in weights), force="decode",
                          codebook=weights[0].codebook)
    y = trellis_matmul_group(jnp.reshape(x, (m, k)), weights, plan)
    starts = np.cumsum([0] + [w.n for w in weights])
    return [y[:, a:b].reshape(*lead, b - a) for a, b in zip(starts[:-1], starts[1:])]


__all__ = ["PLAN_ENV", "TRANSFORMS_ENV", "available", "b_fragment_words", "decode_input_words",
           "dequantize_f16", "group_supported", "hadamard_in", "hadamard_out",
           "input_transform", "mma_group_partials_words", "trellis_matmul_group",
           "trellis_matmul_group_gpu",
           "lane_geometry", "mma_input_words", "quad_fragment_words", "mma_partials",
           "mma_partials_words",
           "output_transform", "pair_fragment_words", "plan_for", "prefill_matmul", "prefill_scale",
           "rotated_matmul", "row_scale",
           "supports",
           "tiles_partials_words", "token_fragment_words", "trellis_matmul_gpu",
           "trellis_words"]
