"""Grouped Trellis GEMM for the MoE: route-packed blocks, each block of block_m rows multiplied by
its own expert's trellis, decoded in registers into mma.sync fragments.

    part[s, p, r, :] = xh[p, r, k split s] @ W_hat[p, expert(block(r))][k split s, :]

p is the projection plane (FC1: 0 = gate, 1 = up, both in one launch over w13 [2, E, ...];
FC2: one plane over w2 [E, ...]). Rows are the route-packed rows of exl3_jax.ops.moe_routing;
blocks with expert -1 skip the k loop and write zeros; padding rows are zero in xh, so they
produce zeros (per-route blocks instead read only their row 0: one_row). The decode/MMA inner
loop (load_chunk / mma_chunk) is the dense kernel's (ffi/trellis_mma.py); only the block ->
expert lookup, the plane axis and the output rows differ.

Pipeline of one MoE layer on the GPU (``moe_gpu``): one XLA custom call (``moe_layer`` ->
``launch_moe_layer``) that launches these kernels on the stream:
  0. route packing before the call (pack_for): XLA's counting sort
     (exl3_jax.ops.moe_routing.pack_routes, a few fusions), or where pack_in_kernel() (up
     to 4096 routes by default) one launch of ffi/route_pack.py's kernel (same tables); none
     for per-route plans, whose kernels derive every row from the flat ids (KernelRoutes);
  1. rotate_in: gather of each packed row's token, * suh of its expert (gate and up planes),
     the row's fp16-boundary scale, Hadamard-128, fp16 (1 launch). Per-route plans (one
     token, one route per block: decode at few routes per expert) do this inside FC1 instead
     (GroupedMmaConfig.rotate_in: each FC1 CTA rotates its route's row into shared memory while
     its first weight words load), so they launch 4 kernels. With EXL3_JAX_MOE_CLUSTER=auto
     (GroupedMmaConfig.cluster; off until timed on a GPU) FC1 runs in thread-block clusters
     of up to 8 CTAs of one plane and route, each rotating its share of the row into every
     CTA's shared memory;
  2. FC1: gate and up grouped GEMM over w13 in one launch (this file's mma.sync kernel, or for
     "wgmma" plans on Hopper the grouped form of ffi/trellis_wgmma.py's kernel, which
     decodes each block's expert once per CTA into wgmma's A registers; the same for FC2);
  3. activation: K-split sum, FC1 output Hadamard, * svh * FC1 row scale (* x_scale),
     silu(gate) * up, * down suh, FC2 row scale, FC2 input Hadamard, fp16 (1 launch; the two
     Hadamards act on the same 128-column blocks, so one warp does the whole chain);
  4. FC2 grouped GEMM (1 launch);
  5. combine: K-split sum, FC2 output Hadamard, * svh * FC2 row scale, top-k weighted sum in
     fp32 in slot order per token (deterministic, no atomics) (1 launch).
Kernels 2-5 are programmatic dependent launches (EXL3_JAX_MOE_PDL=0: ordinary launches): each
loads the layer's own tables (and FC1 / FC2 their first weight chunk) before
griddepcontrol.wait. Measured on the H200 (bench/NOTES.md, sessions 13-14): the launch
chaining saves 2.6-3.6 us per layer at one token (with and without XLA command buffers; session
13's first timing saw no change); the software-pipelined k loop <= 0.6 us; rotate_in inside FC1
~3.6 us. Not kept: the activation inside FC2 (each of FC2's n-tile CTAs recomputing it after the
wait: +2-11 us), FC2's tiles decoded into shared memory before the wait (+2-10 us: FC2's
CTAs fit only as FC1's leave), and the activation and combine in FC1's and FC2's tails behind
arrival counters (session 15: neutral for Qwen3 at m = 1, +1.6 to +5 us for GLM-5.2 TP4 and
GLM-4.5-Air: FC1 needed 79 registers instead of 64), and the decode plans' FC1 with its warps
side by side over n and the K-split across CTAs, so each CTA rotates only its split's part of
the row (session 41: +1 to +12 us for Qwen3 at m = 1..8; the per-CTA rotation it removes is
worth at most 2.2 us at m = 1, 5.2 at m = 4, but the activation then sums 8 splits for every
packed row; scripts/gpu_calls/fc1_warps_over_n.patch). Not built: the persistent cooperative kernel
with grid barriers of issue #6 (the phases stay separate kernels). Mixed-bitrate
experts (``tiers``) share the same launches: one packing over the global expert ids, the glue
kernels on rotation tables in global expert order, and grouped GEMMs that hold one k loop per tier
(its own K and codebook) and pick each block's tier and slot from the expert -> (tier, slot)
maps (tiered layers keep the rotate_in kernel); the wgmma plan's GEMMs instead launch the
grouped wgmma kernel once per tier, each launch writing its own tier's blocks. With
EXL3_JAX_MOE_FUSED=0 (or expert biases) steps 1, 3 and 5 run as jnp glue around the plain
Hadamard kernels of ffi/hadamard.py (6 CuTe launches + XLA fusions); kept as a cross-check.

Layout contract (flat row-major, sizes static):
  xw:   uint32 [planes, rows, k/2]             fp16 pairs of the rotated rows
  tw:   uint32 [planes, E, k/16, n/16, W/2]    the native stacked trellis words (tiers: one
                                               such slab per tier, E_t experts, its own W)
  bexp: int32  [blocks]                        expert per block, -1 (or >= E) = unused
  etier, eslot: int32 [E]                      tiers only: tier and slot of each global expert
  out:  float32 [splits, planes, rows, n]      partial sums (every element written)
"""

from __future__ import annotations

import dataclasses
import os

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp
import numpy as np
from cutlass import Float16, Float32, Int32, Uint32

from exl3_jax.ops.moe_plans import MoeGemmPlan, MoePlan, moe_plan
from exl3_jax.ops.moe_routing import (PackedRoutes, combine_routes, gather_expert_rows,
                                      gather_rows, pack_routes, pack_routes_per_route)
from exl3_jax.trellis import Exl3Weight

from . import trellis_gemm as tg
from .cute_ops import (block_row_col, cluster_arrive, cluster_rank, cluster_wait,
                       cta_thread_ids, hadamard128_lane, lane_funnels)
from .hadamard import SCALE as HAD_SCALE
from .hadamard import (WARPS, HadamardConfig, abs_max, cta_max, power_of_two_inverse,
                       rotation_inputs, row_blocks, row_scale, store_rotated,
                       store_rotated_cluster)
from .trellis_geometry import B_REGS, lane_geometry, supported_rates, token_fragment_word
from .trellis_mma import (MmaTiling, chunk_operands, chunk_registers, fold_warp_partials,
                          fragments_of_words,
                          load_chunk, load_chunk_weights, load_chunk_x_words, mma_chunk,
                          mul1_affine, mul1_sums, store_chunk, summed_fragment,
                          zero_accumulators)
from .trellis_wgmma import WgmmaGemmConfig, launch_grouped_wgmma

PLAN_ENV = "EXL3_JAX_MOE_PLAN"
FUSED_ENV = "EXL3_JAX_MOE_FUSED"     # "0": the unfused glue (jnp + Hadamard kernels)
MAX_TOP_K = 32                       # combine: one warp per route slot, <= 1024 threads
MAX_TIERS = 3                        # expert tiers one grouped launch serves (tw0..tw2)
PACK_ENV = "EXL3_JAX_MOE_PACK"       # "kernel" | "xla": how the sorted plans pack routes
PDL_ENV = "EXL3_JAX_MOE_PDL"         # "0": the layer's kernels as ordinary stream-ordered launches
# Tuning: "fc1=n_tiles,warps,splits,unroll;fc2=..." replaces the plan's CTA shape of that
# projection (either may be left out); checked by GroupedMmaConfig.validate at trace time.
GEMM_ENV = "EXL3_JAX_MOE_GEMM"
# FC1 of per-route plans: CTAs per cluster sharing a route's rotation ("auto": the largest of
# 8, 4, 2 that GroupedMmaConfig.validate accepts; "1", the default until it is timed on a GPU
# (bench/NOTES.md, session 43; call 98): every CTA rotates its row itself).
CLUSTER_ENV = "EXL3_JAX_MOE_CLUSTER"
CLUSTER_DEFAULT = "1"


@dataclasses.dataclass(frozen=True)
class GroupedMmaConfig(MmaTiling):
    """Every compile-time parameter of one grouped Trellis GEMM instance (the dense kernel's
    tiling, MmaTiling, with blocks of block_m rows in place of its token tiles)."""
    codebook: str
    K: float
    experts: int
    planes: int
    k: int
    n: int
    block_m: int           # rows per block (multiple of 8, <= 64)
    blocks: int
    n_tiles: int = 2
    warps: int = 8
    splits: int = 1
    unroll: int = 1
    # Mixed-bitrate experts served by this one launch: ((codebook, K, experts of the tier), ..)
    # per tier, each tier its own stacked slab (tw0..tw2) and global expert e at slot eslot[e]
    # of tier etier[e]; () for one slab of ``experts`` experts. With tiers, codebook and K are
    # tier 0's and ``experts`` is the layer's global E.
    tiers: tuple = ()
    # FC1 of a per-route plan (route r alone in block r, its token r // top_k): the kernel
    # rotates its route's token row itself (rotate_in's arithmetic, into shared memory, and
    # the row scales), so the layer launches no rotate_in kernel and the rotation's latency
    # overlaps the first weight loads. One slab, two planes.
    rotate_in: bool = False
    top_k: int = 0
    # rotate_in only: CTAs per thread-block cluster along the n-tile axis (grid x). The CTAs
    # of a cluster share a plane and a route, so they share one rotation: each rotates 1 /
    # cluster of the row's 128-blocks and stores it into every CTA's shared memory (sm_90
    # distributed shared memory), instead of every CTA rotating the whole row (session 41:
    # the repeated rotation costs up to 2.2 us of the Qwen3-30B-A3B layer at m = 1). 1: none.
    cluster: int = 1
    # Per-route plans (route r alone in block r, the block's rows 1.. padding): every lane
    # reads row 0's activation words, so a warp load touches one row's line instead of 8 rows'
    # (7 of them padding); the padding rows' partials are then copies of row 0's, never read.
    one_row: bool = False

    mul1_split = True        # the k loops apply trellis_mma.mul1_affine
    nibble_extraction = True  # K = 4 by LaneGeometry.nibble_plan (MmaTiling: -4% at m = 1, 4)
    wgmma = False            # launch_moe_layer: this kernel, not the grouped wgmma one

    @property
    def x_layout(self) -> str:
        """Row-major fp16 pairs (the route-packed rows; a split-pair B register costs a byte
        permute, the fp16 into both halves), except where a block is one route (per-route
        plans, one slab: FC1 with rotate_in, FC2 with one_row): the block's row in the dense
        kernel's one-token order (trellis_geometry.token_fragment_word, each fp16 in both
        halves), held in shared memory (FC1 rotates it there; FC2 copies it from the
        activation kernel's output, written in that order: GlueConfig.token). One 16-byte load
        per lane and k16 step, no permutes; every lane reads token 0's words, so the padding
        rows' partials are copies of row 0's, which the activation kernel zeroes (FC1) and the
        combine never reads (FC2)."""
        if self.rotate_in or (self.one_row and not self.tiers and self.split_pairs):
            return "token"
        return "rows"

    @property
    def m_tile(self) -> int:
        return self.block_m

    @property
    def rows(self) -> int:
        return self.blocks * self.block_m

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.n16 // self.n_tiles, self.splits, self.planes * self.blocks)

    def tier_config(self, i: int) -> "GroupedMmaConfig":
        """The single-slab config of tier i (its codebook, K and expert count; same tiling)."""
        codebook, K, experts = self.tiers[i]
        return dataclasses.replace(self, codebook=codebook, K=K, experts=experts, tiers=())

    def slab_configs(self) -> list:
        """One single-slab config per trellis tensor the kernel reads."""
        return [self.tier_config(i) for i in range(len(self.tiers))] if self.tiers else [self]

    def cluster_fits(self, size: int) -> bool:
        """Whether clusters of ``size`` CTAs can share this FC1's rotation: rotate_in, 2, 4 or
        8 CTAs (portable cluster sizes) dividing both the n-tile CTAs (grid x) and the row's
        128-blocks (each rank rotates whole blocks)."""
        return (self.rotate_in and size in (2, 4, 8) and self.grid[0] % size == 0
                and (self.k // 128) % size == 0)

    def validate(self) -> "GroupedMmaConfig":
        if self.block_m % 8 or not 8 <= self.block_m <= 64:
            raise ValueError(f"block_m {self.block_m} must be a multiple of 8 in [8, 64]")
        if self.rotate_in and (self.tiers or self.planes != 2 or self.top_k < 1
                               or self.blocks % self.top_k or self.k % 128
                               or self.block_m != 8):
            raise ValueError("rotate_in (FC1 of a per-route plan) needs one slab, 2 planes, "
                             "top_k >= 1 dividing the blocks, k a multiple of 128 and "
                             "blocks of 8 rows")
        if self.cluster != 1 and not self.cluster_fits(self.cluster):
            raise ValueError(f"cluster {self.cluster}: needs rotate_in and 2, 4 or 8 CTAs "
                             f"dividing both the n-tile CTAs ({self.grid[0]}) and the row's "
                             f"128-blocks ({self.k // 128})")
        if len(self.tiers) > MAX_TIERS:
            raise ValueError(f"{len(self.tiers)} tiers; one launch serves at most {MAX_TIERS}")
        self.check_tiling()
        words = max(c.planes * c.experts * c.k16 * c.n16 * lane_geometry(c.K).words
                    for c in self.slab_configs())
        if max(words, self.planes * self.rows * self.k // 2,
               self.splits * self.planes * self.rows * self.n) >= 2**31:
            raise ValueError("tensor too large for 32-bit indexing")
        return self


@dataclasses.dataclass(frozen=True)
class GroupedWgmmaConfig(WgmmaGemmConfig):
    """One grouped GEMM of a "wgmma" plan (Hopper): the dense wgmma kernel's grouped form
    (trellis_wgmma: experts > 0), blocks of m_tile rows (32, 64 or 128) as its token tiles,
    row-major activations, fp32 partials [splits, planes, rows, n] as GroupedMmaConfig's.
    Tier slabs (``tiers`` as GroupedMmaConfig's: codebook, K and experts of each; ``experts``
    the layer's global E) take one launch each (launch_configs: the decode's K is a
    compile-time parameter of the kernel), each writing its own tier's blocks."""
    tiers: tuple = ()
    wgmma = True
    rotate_in = False
    x_layout = "rows"

    def launch_configs(self) -> list:
        """The kernel launches of this GEMM: one per tier slab (trellis_wgmma's ``tier``), or
        this config for one slab."""
        if not self.tiers:
            return [self]
        return [WgmmaGemmConfig(**{f.name: getattr(self, f.name)
                                   for f in dataclasses.fields(WgmmaGemmConfig)}
                                | dict(codebook=codebook, K=K, experts=experts, tier=t,
                                       tier_count=len(self.tiers),
                                       global_experts=self.experts))
                for t, (codebook, K, experts) in enumerate(self.tiers)]

    def validate(self) -> "GroupedWgmmaConfig":
        if len(self.tiers) > MAX_TIERS:
            raise ValueError(f"{len(self.tiers)} tiers; at most {MAX_TIERS}")
        if self.tiers:
            for c in self.launch_configs():
                c.validate()
        return super().validate()

    @property
    def block_m(self) -> int:
        return self.m_tile

    @property
    def blocks(self) -> int:
        return self.m_blocks

    @property
    def rows(self) -> int:
        return self.m_pad


@cute.kernel
def _grouped_mma_kernel(xw: cute.Tensor, tw0: cute.Tensor, tw1: cute.Tensor, tw2: cute.Tensor,
                        bexp: cute.Tensor, etier: cute.Tensor, eslot: cute.Tensor,
                        out: cute.Tensor, xin: cute.Tensor, suh: cute.Tensor,
                        scale: cute.Tensor, cfg: cutlass.Constexpr):
    # xin, suh, scale: with cfg.rotate_in, the layer's x [T, k], suh13 [2, E, k] and the row
    # scales it writes [2 * rows] (as rotate_in does); otherwise never read.
    tid, lane, warp, (bx, by, bz) = cta_thread_ids()
    cute.arch.griddepcontrol_launch_dependents()      # see launch_moe_layer
    if cutlass.const_expr(cfg.cluster > 1):
        # Its wait, before the first store into another CTA, proves that every CTA of the
        # cluster has started (CUDA's rule for distributed shared memory); arriving here lets
        # the row's loads and the first weight loads cover the barrier's latency.
        cluster_arrive(release=False)
    plane = bz // cfg.blocks
    blk = bz % cfg.blocks
    expert = Int32(bexp[blk])
    live = (expert >= 0) & (expert < cfg.experts)
    e_safe = cutlass.select_(live, expert, Int32(0))
    tn0 = bx * cfg.n_tiles
    row0 = blk * cfg.block_m
    k0 = by * cfg.k_per_split

    nacc = cfg.acc_regs
    acc = zero_accumulators(cfg)

    x_row_base = (plane * cfg.rows + row0 + (0 if cfg.one_row else lane // 4)) * (cfg.k // 2) \
        + lane % 4
    chunk = cfg.warps * cfg.unroll
    k_end = cutlass.select_(live, k0 + cfg.k_per_split, k0)     # unused block: no k steps
    tile_stride = cfg.k16 * cfg.n16
    if cutlass.const_expr(not cfg.tiers):
        geo = lane_geometry(cfg.K)
        funnels = lane_funnels(geo, lane)
        # Tile (k16 = 0, n16 = tn0) of this plane's expert in the flat tile sequence.
        tile0 = (plane * cfg.experts + e_safe) * tile_stride + tn0
        # The warp's first chunk: its weight words are the layer's own, so they are loaded
        # before the wait for xw (the previous kernel's output) and their latency overlaps
        # it. A warp without a chunk (unused block, or fewer chunks than warps) loads an
        # in-bounds chunk and multiplies it by zero fragments: it adds exactly 0.
        # The loop is software-pipelined: chunk c + 1's loads are issued before chunk c is
        # decoded, so at most one memory latency per warp is exposed, not one per chunk.
        c_first = k0 + warp * cfg.unroll
        c_safe = cutlass.min(c_first, cfg.k16 - cfg.unroll)
        wreg, xreg = chunk_registers(geo, cfg)
        wfirst = load_chunk_weights(tw0, c_safe, tile0, funnels, geo, cfg)
        cute.arch.griddepcontrol_wait()
        x_base = x_row_base
        if cutlass.const_expr(cfg.x_layout == "token"):     # the row, one word per column
            x_base = token_fragment_word(0) + (lane % 4) * B_REGS
        if cutlass.const_expr(cfg.rotate_in):
            # rotate_in's arithmetic for this block's one live row (row 0; rows 1.. are
            # padding: scale 1, their B columns read row 0's words), element for element, so
            # the result is bitwise the separate kernel's: x * suh, the row's power-of-two
            # scale, H128.
            blocks = row_blocks(cfg.k, warp, cfg.warps)
            vals, amax = rotation_inputs(
                xin, suh, (blk // cfg.top_k) * cfg.k + 4 * lane,
                (plane * cfg.experts + e_safe) * cfg.k + 4 * lane,
                cutlass.select_(live, Float32(1.0), Float32(0.0)), blocks)
            s = row_scale(cta_max(amax, warp, cfg.warps))
            if (bx == 0) & (by == 0) & (tid < cfg.block_m):
                scale[plane * cfg.rows + row0 + tid] = cutlass.select_(tid == 0, s,
                                                                       Float32(1.0))
            inv = power_of_two_inverse(s)
            xh = cutlass.memory.SmemAllocator().allocate_tensor(
                Float16, cute.make_layout(2 * cfg.k), 16)
            if cutlass.const_expr(cfg.cluster > 1):
                cluster_wait()
                store_rotated_cluster(vals, blocks, inv, lane, warp, cluster_rank(),
                                      xh.iterator.toint(), cfg.k, cfg.warps, cfg.cluster)
                cluster_arrive()
                cluster_wait()
            else:
                store_rotated(vals, blocks, inv, lane, xh, 0, token_fragment_word)
                cute.arch.sync_threads()
            xs = cute.recast_tensor(xh, Uint32)
        if cutlass.const_expr(cfg.x_layout == "token" and not cfg.rotate_in):
            # FC2: this split's part of the activation kernel's row (already in this order)
            # into shared memory (at the row's own word offsets).
            words = cfg.k_per_split * 16
            first = k0 * 16
            src = (plane * cfg.rows + row0) * cfg.k + first
            xs = cutlass.memory.SmemAllocator().allocate_tensor(Uint32, cute.make_layout(cfg.k),
                                                                16)
            for i in cutlass.range_constexpr(-(-words // cfg.threads)):
                idx = tid + i * cfg.threads
                if idx < words:
                    xs[first + idx] = xw[src + idx]
            cute.arch.sync_threads()
        first_keep = c_first < k_end
        xsum = mul1_sums(cfg)
        if cutlass.const_expr(cfg.x_layout == "token"):
            # The row is in shared memory: each chunk's x words are loaded as the chunk is
            # decoded (a short latency), not carried across iterations as the weights are
            # (CPU-compiled, Qwen3-30B-A3B K4: 54-62 registers; 108-111 when carried, 80 for
            # the row-major row with its byte permutes and padding-row selects).
            store_chunk(wreg, xreg, wfirst, [])
            for c0 in cutlass.range(c_first + chunk, k_end, chunk):
                wnext = load_chunk_weights(tw0, c0, tile0, funnels, geo, cfg)
                wbuf, _ = chunk_operands(wreg, xreg, geo, cfg)
                bfrag = fragments_of_words(
                    load_chunk_x_words(xs, c0 - chunk, x_base, cfg, shared=True), cfg)
                mma_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum)
                store_chunk(wreg, xreg, wnext, [])
            # The chunk left in wreg: the warp's last, or c_safe times zeros if it has none.
            span = cutlass.max(k_end - 1 - c_first, Int32(0))
            c_last = cutlass.min(c_first + span // chunk * chunk, cfg.k16 - cfg.unroll)
            wbuf, _ = chunk_operands(wreg, xreg, geo, cfg)
            bfrag = fragments_of_words(
                load_chunk_x_words(xs, c_last, x_base, cfg, keep=first_keep, shared=True),
                cfg)
            mma_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum)
        else:
            store_chunk(wreg, xreg, wfirst,
                        load_chunk_x_words(xw, c_safe, x_base, cfg, keep=first_keep))
            for c0 in cutlass.range(c_first + chunk, k_end, chunk):
                wnext = load_chunk_weights(tw0, c0, tile0, funnels, geo, cfg)
                xnext = load_chunk_x_words(xw, c0, x_base, cfg)
                wbuf, bfrag = chunk_operands(wreg, xreg, geo, cfg)
                mma_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum)
                store_chunk(wreg, xreg, wnext, xnext)
            wbuf, bfrag = chunk_operands(wreg, xreg, geo, cfg)
            mma_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum)
        mul1_affine(acc, xsum, cfg)
    else:
        tier = Int32(etier[e_safe])
        slot = Int32(eslot[e_safe])
        cute.arch.griddepcontrol_wait()               # xw: the previous kernel's output
        # One copy of the k loop per tier (its own K and codebook), behind a branch uniform over
        # the CTA: a block's expert lives in one tier.
        tws = (tw0, tw1, tw2)
        for i in cutlass.range_constexpr(len(cfg.tiers)):
            tc = cfg.tier_config(i)
            if tier == i:
                geo_t = lane_geometry(tc.K)
                funnels_t = lane_funnels(geo_t, lane)
                tile0 = (plane * tc.experts + slot) * tile_stride + tn0
                xsum = mul1_sums(tc)
                for c0 in cutlass.range(k0 + warp * cfg.unroll, k_end, chunk):
                    wbuf, bfrag = load_chunk(xw, tws[i], c0, tile0, x_row_base, funnels_t,
                                             geo_t, tc)
                    mma_chunk(wbuf, bfrag, acc, funnels_t, geo_t, tc, xsum)
                mul1_affine(acc, xsum, tc)

    red = fold_warp_partials(acc, warp, lane, cfg)
    out_row0 = (by * cfg.planes + plane) * cfg.rows + row0
    per_thread = -(-(nacc * 32) // cfg.threads)
    for e in cutlass.range_constexpr(per_thread):
        idx = tid + e * cfg.threads
        if idx < nacc * 32:
            total, tok, col = summed_fragment(red, idx, tn0, 0, cfg)
            out[(out_row0 + tok) * cfg.n + col] = total


@cute.jit
def launch_grouped_mma(stream, xw: cute.Tensor, tw0: cute.Tensor, tw1: cute.Tensor,
                       tw2: cute.Tensor, bexp: cute.Tensor, etier: cute.Tensor,
                       eslot: cute.Tensor, out: cute.Tensor, cfg: cutlass.Constexpr):
    """cutlass_call entry: one slab passes its trellis as tw0..tw2 and bexp as etier / eslot
    (never read); tiers pass their slabs (the last repeated) and the expert -> tier, slot maps.
    A GroupedWgmmaConfig runs the grouped wgmma kernel (once per tier slab)."""
    _launch_grouped_gemm(xw, (tw0, tw1, tw2), bexp, etier, eslot, out, (xw, xw, xw), cfg,
                         stream)


def _launch_grouped_gemm(xw, tws, bexp, etier, eslot, out, rotate_args, cfg, stream,
                         use_pdl: bool = False):
    """One grouped GEMM on ``stream`` (from a cute.jit launch function, at trace time): the
    grouped wgmma kernel for a GroupedWgmmaConfig (one launch per tier slab, tier t on tws[t];
    ordinary launches, since it has no griddepcontrol of its own), else the mma.sync kernel
    (rotate_args: its xin, suh, scale; use_pdl: a programmatic dependent launch)."""
    if cfg.wgmma:
        for t, c in enumerate(cfg.launch_configs()):
            launch_grouped_wgmma(xw, tws[t], bexp, etier, eslot, out, c, stream)
    else:
        _grouped_mma_kernel(xw, *tws, bexp, etier, eslot, out, *rotate_args, cfg).launch(
            grid=cfg.grid, block=(cfg.threads, 1, 1), stream=stream, use_pdl=use_pdl,
            **({"cluster": (cfg.cluster, 1, 1)} if cfg.cluster > 1 else {}))


# ---------------------------------------------------------------------------------------------
# Fused glue kernels (the Hadamard-128 of ffi/hadamard.py, one warp per 128-column block).
# rotate_in and activation run one CTA per row: each row's fp16-boundary scale (hadamard.py's
# row_scale of the row's max |input|) needs the whole row before any element is rotated.
# Per-route plans run them on each block's row 0 only (GlueConfig.in_grid): FC1 and FC2 read
# only that row (one_row) and the combine only the route's row, so nothing computes the
# padding rows of xh, xh2 and scale2 (whatever they hold is never read).
#
#   rotate_in:  s1[p, r] = row_scale(max |x[token(r)] * suh13[p, expert(r)]|)
#               xh[p, r] = fp16(H128(x[token(r)] * suh13[p, expert(r)]) / s1[p, r])
#               (0 and s1 = 1 for padding rows)
#   activation: g, u = H128(sum_s part1[s, p, r]) * svh13[p, expert(r)] * s1[p, r]
#               (* x_scale[token(r)]); h = silu(g) * u * suh2[expert(r)];
#               s2[r] = row_scale(max |h|); xh2[r] = fp16(H128(h) / s2[r]) (one warp does a
#               block's whole chain: the output Hadamard of FC1 and the input Hadamard of FC2
#               act on the same 128-column blocks, and everything between them is elementwise)
#   combine:    y[t] = sum_j w[t, j] * s2[r] * H128(sum_s part2[s, r]) * svh2[expert(r)],
#               r = route_row[t, j], in slot order j (fixed per token), fp32; invalid routes
#               add exactly 0.

@dataclasses.dataclass(frozen=True)
class GlueConfig(HadamardConfig):
    """A Hadamard-kernel config (one warp per 128-column block of ``rows`` rows: ``blocks``,
    ``grid``) with the MoE fields. rows: planes * packed rows (rotate_in), packed rows
    (activation) or tokens (combine); part_rows: packed rows of the GEMM partials (combine)."""
    experts: int = 0
    planes: int = 1
    valid_cols: int = 0    # activation: logical I (columns beyond are zeroed)
    top_k: int = 1
    scaled: bool = False   # activation: x_scale given
    token: bool = False    # activation: rows in FC2's one-token order (GroupedMmaConfig.x_layout)
    per_route: int = 0     # per-route packing's block_m: rows derived from the flat ids (0: tables)

    @property
    def plane_rows(self) -> int:
        return self.rows // self.planes

    @property
    def row_step(self) -> int:
        """Packed rows per CTA step of rotate_in and activation: per-route packing runs them
        on each block's row 0 only (the block's other rows are padding that FC1, FC2 and the
        combine never read), so one CTA per route, not one per packed row."""
        return self.per_route or 1

    @property
    def in_grid(self) -> tuple[int, int, int]:
        """rotate_in / activation grid (one CTA per row, _per_row): one CTA per live row."""
        assert self.row_ctas == 1, self
        return (self.rows // self.row_step, 1, 1)

    def live_row(self, cta):
        """(plane, packed row in the plane) of rotate_in / activation CTA ``cta``."""
        plane_ctas = self.plane_rows // self.row_step
        return cta // plane_ctas, (cta % plane_ctas) * self.row_step


def _split_sum4(part, base_of_split, splits: int):
    """This lane's 4 consecutive fp32 values summed over the K-split partials (split s at
    part[base_of_split(s) + i]), in split order."""
    v = [Float32(0.0)] * 4
    for s in range(splits):
        base = base_of_split(s)
        v = [v[i] + part[base + i] for i in range(4)]
    return v


def _row_route(cfg, row, rtok, rexp):
    """(token, expert, live) of packed row ``row``: from the packing's tables (rtok, rexp
    [rows]), or with ``cfg.per_route`` from the flat ids (rexp [T * top_k]; route r alone in
    block r, its row r * block_m, the block's other rows padding). Plain Python (trace time)."""
    if cfg.per_route:
        r = row // cfg.per_route
        e = Int32(rexp[r])
        live = (row % cfg.per_route == 0) & (e >= 0) & (e < cfg.experts)
        return r // cfg.top_k, e, live
    tok = Int32(rtok[row])
    e = Int32(rexp[row])
    return tok, e, (tok >= 0) & (e >= 0)


def _slot_route(cfg, t, j, route_row, rexp):
    """(whether route slot j of token t is valid, its packed row, its expert; row and expert 0
    when invalid): from route_row [T * top_k] and rexp [rows], or with ``cfg.per_route`` from
    the flat ids (rexp). Plain Python (trace time)."""
    if cfg.per_route:
        r = t * cfg.top_k + j
        e = Int32(rexp[r])
        ok = (e >= 0) & (e < cfg.experts)
        return (ok, cutlass.select_(ok, r * cfg.per_route, Int32(0)),
                cutlass.select_(ok, e, Int32(0)))
    r = Int32(route_row[t * cfg.top_k + j])
    r0 = cutlass.select_(r >= 0, r, Int32(0))
    return r >= 0, r0, cutlass.max(Int32(rexp[r0]), Int32(0))


@cute.kernel
def _rotate_in_kernel(x: cute.Tensor, suh: cute.Tensor, rtok: cute.Tensor, rexp: cute.Tensor,
                      out: cute.Tensor, scale: cute.Tensor, cfg: cutlass.Constexpr):
    tid, lane, warp, (bx, _, _) = cta_thread_ids()
    cute.arch.griddepcontrol_launch_dependents()
    cute.arch.griddepcontrol_wait()            # the layer's first kernel: a no-op in practice
    plane, row = cfg.live_row(bx)
    tok, e, live = _row_route(cfg, row, rtok, rexp)
    keep = cutlass.select_(live, Float32(1.0), Float32(0.0))
    src = cutlass.select_(live, tok, Int32(0)) * cfg.width + 4 * lane
    srow = (plane * cfg.experts + cutlass.select_(live, e, Int32(0))) * cfg.width + 4 * lane
    blocks = row_blocks(cfg.width, warp)
    vals, amax = rotation_inputs(x, suh, src, srow, keep, blocks)
    # The fp16 boundary (ffi/hadamard.py): s = smallest power of two with max|x * suh| / s <=
    # 2^ROW_LIMIT_LOG2, so no rotated element exceeds 46341; padding rows (all zero) get s = 1.
    s = row_scale(cta_max(amax, warp))
    packed_row = plane * cfg.plane_rows + row
    if tid == 0:
        scale[packed_row] = s
    inv = power_of_two_inverse(s)
    store_rotated(vals, blocks, inv, lane, out, packed_row * cfg.width)


@cute.kernel
def _activation_kernel(part: cute.Tensor, svh13: cute.Tensor, suh2: cute.Tensor,
                       rtok: cute.Tensor, rexp: cute.Tensor, scale1: cute.Tensor,
                       xscale: cute.Tensor, out: cute.Tensor, scale2: cute.Tensor,
                       cfg: cutlass.Constexpr):
    tid, lane, warp, (bx, _, _) = cta_thread_ids()
    cute.arch.griddepcontrol_launch_dependents()
    _, row = cfg.live_row(bx)
    tok, e, live = _row_route(cfg, row, rtok, rexp)
    e0 = cutlass.select_(live, e, Int32(0))
    keep = cutlass.select_(live, Float32(1.0), Float32(0.0))
    blocks = row_blocks(cfg.width, warp)
    # The layer's own tables first (gate / up svh, down suh), then the chain wait, then what
    # FC1 and rotate_in wrote (partials, row scales).
    svs = []
    suhs = []
    for b in cutlass.range_constexpr(len(blocks)):
        col = blocks[b][1] + 4 * lane
        svs.append([[Float32(svh13[(p * cfg.experts + e0) * cfg.width + col + i])
                     for i in range(4)] for p in range(2)])
        suhs.append([Float32(suh2[e0 * cfg.width + col + i]) for i in range(4)])
    cute.arch.griddepcontrol_wait()
    # FC1's row scales (gate plane, up plane) and the optional caller's x_scale.
    rs = [Float32(scale1[p * cfg.rows + row]) for p in range(2)]
    if cutlass.const_expr(cfg.scaled):
        sc = Float32(xscale[cutlass.select_(live, tok, Int32(0))])
        rs = [r * sc for r in rs]
    hs = []
    amax = Float32(0.0)
    for b in cutlass.range_constexpr(len(blocks)):
        col = blocks[b][1] + 4 * lane
        gu = []
        for p in cutlass.range_constexpr(2):
            v = _split_sum4(part, lambda s: ((s * 2 + p) * cfg.rows + row) * cfg.width + col,
                            cfg.splits)
            v = hadamard128_lane(v, lane)
            gu.append([v[i] * Float32(HAD_SCALE) * svs[b][p][i] * rs[p] for i in range(4)])
        g, u = gu
        h = []
        for i in cutlass.range_constexpr(4):
            silu = g[i] / (Float32(1.0) + cute.math.exp(-g[i]))
            m = keep
            if cutlass.const_expr(cfg.valid_cols < cfg.width):
                m = cutlass.select_(col + i < cfg.valid_cols, keep, Float32(0.0))
            h.append(silu * u[i] * m * suhs[b][i])
        amax = abs_max(amax, h)
        hs.append(h)
    # FC2's fp16 boundary, as in rotate_in: SwiGLU outputs of outlier tokens reach the
    # thousands, and the rotation multiplies the largest by up to sqrt(128).
    s = row_scale(cta_max(amax, warp))
    if tid == 0:
        scale2[row] = s
    inv = power_of_two_inverse(s)
    if cutlass.const_expr(cfg.token):
        store_rotated(hs, blocks, inv, lane, out, row * cfg.width * 2, token_fragment_word)
    else:
        store_rotated(hs, blocks, inv, lane, out, row * cfg.width)


@cute.kernel
def _combine_kernel(part: cute.Tensor, svh2: cute.Tensor, rexp: cute.Tensor,
                    route_row: cute.Tensor, weights: cute.Tensor, scale2: cute.Tensor,
                    out: cute.Tensor, cfg: cutlass.Constexpr):
    # One CTA per (token, 128-column block), one warp per route slot j: each warp's loads are
    # a chain of three dependent rounds (route row; its expert, weight, scale and partials;
    # svh), and the top_k chains run side by side in separate warps. One warp walking the
    # routes kept every route's registers live at once (5.6-7.6 us per layer at one token,
    # session 11). The slot terms meet in shared memory and warp 0 adds them in slot order, so
    # a token's sum has a fixed order (deterministic, no atomics).
    tid, lane, j, (bx, _, _) = cta_thread_ids()
    cute.arch.griddepcontrol_launch_dependents()
    t, col = block_row_col(bx, cfg.width, lane)
    ok, r0, e0 = _slot_route(cfg, t, j, route_row, rexp)
    w = cutlass.select_(ok, Float32(weights[t * cfg.top_k + j]), Float32(0.0))
    sv = [Float32(svh2[e0 * cfg.width + col + i]) for i in range(4)]
    cute.arch.griddepcontrol_wait()            # FC2's partials, activation's row scales
    w = w * Float32(scale2[r0])                                   # * FC2 input row scale
    v = _split_sum4(part, lambda s: (s * cfg.part_rows + r0) * cfg.width + col, cfg.splits)
    h = hadamard128_lane(v, lane)
    smem = cutlass.memory.SmemAllocator()
    terms = smem.allocate_tensor(Float32, cute.make_layout(cfg.top_k * 128), 16)
    for i in cutlass.range_constexpr(4):       # [slot, element i, lane]: conflict-free banks
        terms[(j * 4 + i) * 32 + lane] = w * (h[i] * Float32(HAD_SCALE) * sv[i])
    cute.arch.sync_threads()
    if j == 0:
        acc = [Float32(0.0)] * 4
        for jj in cutlass.range_constexpr(cfg.top_k):           # slot order: deterministic
            acc = [acc[i] + terms[(jj * 4 + i) * 32 + lane] for i in range(4)]
        for i in cutlass.range_constexpr(4):
            out[t * cfg.width + col + i] = acc[i]


@dataclasses.dataclass(frozen=True)
class MoeLayerConfig:
    """Every compile-time parameter of one MoE layer's custom call: the configs of its five
    kernels, and whether kernels 2-5 are programmatic dependent launches (pdl)."""
    rotate: GlueConfig
    fc1: GroupedMmaConfig
    act: GlueConfig
    fc2: GroupedMmaConfig
    combine: GlueConfig
    pdl: bool = True


@cute.jit
def launch_moe_layer(stream, x: cute.Tensor, suh13: cute.Tensor, rtok: cute.Tensor,
                     rexp: cute.Tensor, bexp: cute.Tensor, etier: cute.Tensor,
                     eslot: cute.Tensor, t13a: cute.Tensor, t13b: cute.Tensor,
                     t13c: cute.Tensor, svh13: cute.Tensor, suh2: cute.Tensor,
                     xscale: cute.Tensor, t2a: cute.Tensor, t2b: cute.Tensor, t2c: cute.Tensor,
                     svh2: cute.Tensor, route_row: cute.Tensor, weights: cute.Tensor,
                     part1: cute.Tensor, part2: cute.Tensor, y: cute.Tensor, xh: cute.Tensor,
                     scale1: cute.Tensor, xh2: cute.Tensor, scale2: cute.Tensor,
                     cfg: cutlass.Constexpr):
    """cutlass_call entry of one MoE layer: its five kernels on the caller's stream, one XLA
    custom call. Outputs: the GEMM partials part1 and part2 first (cutlass_call hands
    input-aliased outputs over in their inputs' places, and validation aliases NaN-filled
    buffers to exactly these two), then y, then the rest of the scratch the kernels hand each
    other (xh, scale1, xh2, scale2). With cfg.pdl, kernels 2-5 are programmatic dependent
    launches: each is resident while its predecessor runs, reads the layer's own tables, and waits
    (griddepcontrol.wait) only before what an earlier kernel wrote; every kernel lets its
    dependent launch at its own start (launch_dependents), which cannot take an SM slot from
    its own CTAs (the dependent starts once all of them are resident). The first kernel is an
    ordinary launch, so nothing starts before the layer's inputs are complete."""
    if cutlass.const_expr(not cfg.fc1.rotate_in):
        _rotate_in_kernel(x, suh13, rtok, rexp, xh, scale1, cfg.rotate).launch(
            grid=cfg.rotate.in_grid, block=(32 * WARPS, 1, 1), stream=stream)
    _launch_grouped_gemm(cute.recast_tensor(xh, Uint32), (t13a, t13b, t13c), bexp, etier, eslot,
                         part1, (x, suh13, scale1), cfg.fc1, stream,
                         use_pdl=cfg.pdl and not cfg.fc1.rotate_in)
    _activation_kernel(part1, svh13, suh2, rtok, rexp, scale1, xscale, xh2, scale2,
                       cfg.act).launch(
        grid=cfg.act.in_grid, block=(32 * WARPS, 1, 1), stream=stream, use_pdl=cfg.pdl)
    _launch_grouped_gemm(cute.recast_tensor(xh2, Uint32), (t2a, t2b, t2c), bexp, etier, eslot,
                         part2, (x, suh13, scale2), cfg.fc2, stream, use_pdl=cfg.pdl)
    _combine_kernel(part2, svh2, rexp, route_row, weights, scale2, y, cfg.combine).launch(
        grid=(cfg.combine.blocks, 1, 1), block=(32 * cfg.combine.top_k, 1, 1), stream=stream,
        use_pdl=cfg.pdl)


# ---------------------------------------------------------------------------------------------
# JAX side


def _slabs(weights) -> list:
    """An Exl3Weight (one slab) or a sequence of tier slabs, as a list."""
    return [weights] if isinstance(weights, Exl3Weight) else list(weights)


def grouped_config(weights, gp: MoeGemmPlan, plan: MoePlan) -> GroupedMmaConfig:
    """Config for one stacked weight [E] (planes 1) or [2, E] (planes 2), or a sequence of
    tier slabs [E_t] / [2, E_t] (one launch for all; plan.experts is the layer's global E)."""
    slabs = _slabs(weights)
    w = slabs[0]
    stack = w.stack_shape
    planes = stack[0] if len(stack) == 2 else 1
    tiers = () if isinstance(weights, Exl3Weight) else tuple(
        (t.codebook, t.K, t.stack_shape[-1]) for t in slabs)
    if plan.kind == "wgmma":
        return GroupedWgmmaConfig(codebook=w.codebook, K=w.K, m_blocks=plan.blocks, k=w.k,
                                  n=w.n, m_tile=plan.block_m,
                                  experts=plan.experts if tiers else stack[-1], planes=planes,
                                  tiers=tiers).validate()
    return GroupedMmaConfig(codebook=w.codebook, K=w.K,
                            experts=plan.experts if tiers else stack[-1], planes=planes,
                            k=w.k, n=w.n, block_m=plan.block_m, blocks=plan.blocks,
                            n_tiles=gp.n_tiles, warps=gp.warps, splits=gp.splits,
                            unroll=gp.unroll, tiers=tiers).validate()


def _slab_words(weights) -> list:
    """The trellis words of each slab, the last repeated up to MAX_TIERS (the grouped kernel
    always takes tw0..tw2; a single slab's extra copies are never read)."""
    tws = [tg.trellis_words(w.trellis) for w in _slabs(weights)]
    return tws + tws[-1:] * (MAX_TIERS - len(tws))


def _tier_map_args(tier_maps, bexp, tiered: bool) -> list:
    """The kernel's etier / eslot arguments: the expert -> (tier, slot) maps, or (one slab)
    bexp twice as placeholders that are never read."""
    return [jnp.asarray(m, jnp.int32) for m in tier_maps] if tiered else [bexp, bexp]


def grouped_partials(xw, weights, block_expert, cfg: GroupedMmaConfig, out_init=None,
                     tier_maps=None):
    """The grouped kernel: flat fp32 [splits * planes * rows * n] (see the layout contract).
    weights: the slab, or the tier slabs of cfg.tiers with tier_maps = (expert_tier,
    expert_slot) int32 [E]. out_init: optional NaN-poisoned buffer written in place
    (validation)."""
    from cutlass.jax import cutlass_call

    shape = jax.ShapeDtypeStruct((cfg.splits * cfg.planes * cfg.rows * cfg.n,), jnp.float32)
    bexp = jnp.asarray(block_expert, jnp.int32)
    args = [xw, *_slab_words(weights), bexp, *_tier_map_args(tier_maps, bexp, bool(cfg.tiers))]
    if out_init is None:
        return cutlass_call(launch_grouped_mma, output_shape_dtype=shape, cfg=cfg,
                            compile_options=tg._cute_options())(*args)
    return cutlass_call(launch_grouped_mma, output_shape_dtype=shape, cfg=cfg,
                        input_output_aliases={len(args): 0},
                        compile_options=tg._cute_options())(*args, out_init)


def supports(w13, down) -> bool:
    """Whether the grouped kernels serve these experts: one w13 slab [2, E] and down [E], or
    sequences of tier slabs (at most MAX_TIERS, one k and n for all)."""
    w13s, downs = _slabs(w13), _slabs(down)
    if not 1 <= len(w13s) == len(downs) <= MAX_TIERS:
        return False
    return all(a.K in supported_rates() and b.K in supported_rates()
               and len(a.stack_shape) == 2 and a.stack_shape[0] == 2
               and len(b.stack_shape) == 1 and b.stack_shape[0] == a.stack_shape[1]
               and (a.k, a.n, b.k, b.n) == (w13s[0].k, w13s[0].n, downs[0].k, downs[0].n)
               for a, b in zip(w13s, downs))


def plan_for(tokens: int, top_k: int, experts: int, hidden: int, inter: int,
             force: str | None = None) -> MoePlan:
    """The launch plan of one call (padded hidden / intermediate sizes; experts: the layer's
    global E, all tiers of a mixed-bitrate layer together); force: a plan kind, else
    $EXL3_JAX_MOE_PLAN, else auto."""
    force = force or os.environ.get(PLAN_ENV, "auto") or "auto"
    from exl3_jax.ops.moe_plans import WGMMA_AUTO

    from .aot import device_arch
    arch = device_arch()
    if force == "wgmma" and arch != "sm_90a":
        raise ValueError(f"MoE plan 'wgmma' ({PLAN_ENV}) needs Hopper (sm_90a); this device "
                         f"is {arch}")
    plan = moe_plan(tokens, top_k, experts, hidden, inter,
                    kind=None if force == "auto" else force, sms=tg.device_sms(),
                    hopper=WGMMA_AUTO and arch == "sm_90a")
    return with_gemm_override(plan, os.environ.get(GEMM_ENV, ""))


def with_gemm_override(plan: MoePlan, spec: str) -> MoePlan:
    """``plan`` with the CTA shapes named in ``spec`` ("fc1=2,8,1,4;fc2=2,4,1,4", see GEMM_ENV)
    in place of its own; "" leaves it as it is."""
    fields = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        name, _, value = part.partition("=")
        try:
            vals = [int(v) for v in value.split(",")]
        except ValueError:
            vals = []
        if name.strip() not in ("fc1", "fc2") or len(vals) != 4 or min(vals) < 1:
            raise ValueError(f"{GEMM_ENV}: bad entry {part!r}; expected "
                             f"fc1|fc2=n_tiles,warps,splits,unroll (positive integers)")
        fields[name.strip()] = MoeGemmPlan(*vals)
    return dataclasses.replace(plan, **fields) if fields else plan


def _per_row(rows: int, width: int, **fields) -> GlueConfig:
    """A glue kernel with one CTA per row (its row max needs the whole row in one CTA)."""
    return GlueConfig(rows=rows, valid=rows, width=width,
                      per_warp=-(-width // (128 * WARPS)), **fields)


@dataclasses.dataclass(frozen=True)
class KernelRoutes:
    """What the fused MoE kernels read to place routes (not a pytree: built and used inside one
    traced function). For the sorted packing, the tables of ``pack_routes``; for the per-route
    packing (route r alone in block r, MoePlan.packing "per_route") only the flat ids, from
    which the kernels derive each row's token and expert themselves, so the layer has no XLA
    packing ops at all.

      ids: int32 [T, top_k]; packed: the PackedRoutes of the sorted packing, else None.
    """
    ids: jax.Array
    num_experts: int
    block_m: int
    packed: PackedRoutes | None

    @property
    def per_route(self) -> int:
        """GlueConfig.per_route: the block size when rows derive from ids, else 0."""
        return 0 if self.packed is not None else self.block_m

    @property
    def blocks(self) -> int:
        return self.packed.blocks if self.packed is not None else int(self.ids.size)

    @property
    def rows(self) -> int:
        return self.blocks * self.block_m

    def _flat_ids(self):
        return self.ids.reshape(-1)

    @property
    def row_token(self):
        """rotate_in / activation's rtok: the packing's row_token, or the flat ids (unread)."""
        return self._flat_ids() if self.packed is None else self.packed.row_token

    @property
    def row_expert(self):
        """rexp: the packing's row_expert, or the flat ids."""
        return self._flat_ids() if self.packed is None else self.packed.row_expert

    @property
    def block_expert(self):
        """The grouped GEMM's bexp: the packing's block_expert, or the flat ids (route r is
        block r; ids outside [0, E) are unused blocks)."""
        return self._flat_ids() if self.packed is None else self.packed.block_expert

    @property
    def route_row(self):
        """combine's route_row, flat: the packing's, or the flat ids (unread)."""
        return self._flat_ids() if self.packed is None else self.packed.route_row.reshape(-1)

    def as_packed(self) -> PackedRoutes:
        """The same placement as PackedRoutes (emulations and checks)."""
        if self.packed is not None:
            return self.packed
        return pack_routes_per_route(self.ids, self.num_experts, self.block_m)


def kernel_routes(ids, num_experts: int, plan: MoePlan) -> KernelRoutes:
    """The route placement of ``plan`` for the fused kernels (see KernelRoutes)."""
    ids = jnp.asarray(ids, jnp.int32)
    packed = None if plan.packing == "per_route" else pack_for(ids, num_experts, plan)
    return KernelRoutes(ids, num_experts, plan.block_m, packed)


def moe_layer(x, kr: KernelRoutes, w13, down, weights, *, glue, cfg1: GroupedMmaConfig,
              cfg2: GroupedMmaConfig, x_scale=None, tier_maps=None, valid_cols: int,
              poison: bool = False, pdl: bool | None = None):
    """One MoE layer as one custom call (launch_moe_layer: rotate_in, FC1, activation, FC2,
    combine; see the kernels' comments for what each computes).

      x: [T, H] fp32 / bf16 / fp16 (any range: the fp16 boundary is inside); kr: the routes;
      w13, down: the slab (Exl3Weight) or the tier slabs of cfg1.tiers; weights [T, top_k];
      glue: the rotation tables (suh13 [2, E, H], svh13 [2, E, I], suh2 [E, I], svh2 [E, H]),
      in global expert order; x_scale: optional float32 [T, 1] (true input x * x_scale);
      tier_maps: (expert_tier, expert_slot) int32 [E] with tiers; valid_cols: logical I;
      poison: the GEMM partials are NaN-filled buffers the kernels write in place
      (validation); pdl: chain kernels 2-5 by programmatic dependent launch (None:
      $EXL3_JAX_MOE_PDL, default 1).
    Returns float32 [T, H].
    """
    from cutlass.jax import cutlass_call
    T, H = x.shape
    top_k = kr.ids.shape[1]
    if top_k > MAX_TOP_K:
        raise ValueError(f"top_k {top_k} > {MAX_TOP_K}: the combine kernel runs one warp per "
                         f"route slot in a CTA of at most 1024 threads")
    if x.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        x = x.astype(jnp.float32)
    suh13, svh13, suh2, svh2 = (jnp.asarray(t, jnp.float16) for t in glue)
    E, I = svh13.shape[1], suh2.shape[1]
    if pdl is None:
        pdl = (os.environ.get(PDL_ENV, "1") or "1") != "0"
    scaled = x_scale is not None
    xscale = (jnp.asarray(x_scale, jnp.float32).reshape(-1) if scaled
              else jnp.ones((1,), jnp.float32))
    if kr.per_route and not cfg1.tiers:       # FC1 rotates its route's row itself
        cfg1 = rotation_cluster(dataclasses.replace(cfg1, rotate_in=True, top_k=top_k))
    elif kr.per_route:                        # tiers: FC1 reads rotate_in's rows
        cfg1 = dataclasses.replace(cfg1, one_row=True).validate()
    if kr.per_route:
        cfg2 = dataclasses.replace(cfg2, one_row=True).validate()
    fields = dict(experts=E, top_k=top_k, per_route=kr.per_route)
    cfg = MoeLayerConfig(
        rotate=_per_row(2 * kr.rows, H, planes=2, **fields), fc1=cfg1,
        act=_per_row(kr.rows, I, splits=cfg1.splits, valid_cols=valid_cols, scaled=scaled,
                     token=cfg2.x_layout == "token", **fields),
        fc2=cfg2,
        combine=GlueConfig(rows=T, valid=T, width=H, splits=cfg2.splits, part_rows=kr.rows,
                           **fields),
        pdl=bool(pdl))
    bexp = kr.block_expert
    args = [x.reshape(-1), suh13.reshape(-1), kr.row_token, kr.row_expert, bexp,
            *_tier_map_args(tier_maps, bexp, bool(cfg1.tiers)), *_slab_words(w13),
            svh13.reshape(-1), suh2.reshape(-1), xscale, *_slab_words(down), svh2.reshape(-1),
            kr.route_row, jnp.asarray(weights, jnp.float32).reshape(-1)]
    sds = jax.ShapeDtypeStruct
    n1 = cfg1.splits * 2 * kr.rows * I
    n2 = cfg2.splits * kr.rows * H
    nxh = 2 if cfg1.rotate_in else 2 * kr.rows * H      # (FC1 keeps its rotated row on chip)
    shapes = (sds((n1,), jnp.float32), sds((n2,), jnp.float32), sds((T * H,), jnp.float32),
              sds((nxh,), jnp.float16), sds((2 * kr.rows,), jnp.float32),
              sds((kr.rows * I * (2 if cfg2.x_layout == "token" else 1),), jnp.float16),
              sds((kr.rows,), jnp.float32))
    aliases = {}
    if poison:
        aliases = {len(args): 0, len(args) + 1: 1}
        args += [jnp.full((n1,), np.float32(np.nan)), jnp.full((n2,), np.float32(np.nan))]
    out = cutlass_call(launch_moe_layer, output_shape_dtype=shapes, cfg=cfg,
                       input_output_aliases=aliases, compile_options=tg._cute_options())(*args)
    return out[2].reshape(T, H)


def rotation_cluster(cfg: GroupedMmaConfig, spec: str | None = None) -> GroupedMmaConfig:
    """``cfg`` (FC1 with rotate_in) with its rotation cluster: spec (else $EXL3_JAX_MOE_CLUSTER,
    else CLUSTER_DEFAULT) "auto" takes the largest of 8, 4, 2 CTAs that fits
    (GroupedMmaConfig.cluster_fits; 1 where none does), a number that size (checked)."""
    spec = (spec if spec is not None else os.environ.get(CLUSTER_ENV, "")) or CLUSTER_DEFAULT
    if spec == "auto":
        fits = [c for c in (8, 4, 2) if cfg.cluster_fits(c)]
        size = fits[0] if fits else 1
    elif spec.isdigit():
        size = int(spec)
    else:
        raise ValueError(f"{CLUSTER_ENV}={spec!r}: expected 'auto' or a cluster size")
    return dataclasses.replace(cfg, cluster=size).validate()


def fused_glue_default() -> bool:
    return (os.environ.get(FUSED_ENV, "1") or "1") != "0"


def pack_in_kernel(routes: int) -> bool:
    """Whether the sorted plans pack ``routes`` routes with ffi/route_pack.py's kernel (one
    launch) rather than XLA's counting sort: $EXL3_JAX_MOE_PACK ("kernel" | "xla") forces
    either; by default the kernel up to moe_plans.PACK_KERNEL_MAX_ROUTES routes."""
    from exl3_jax.ops.moe_plans import PACK_KERNEL_MAX_ROUTES
    choice = os.environ.get(PACK_ENV, "")
    if choice not in ("", "kernel", "xla"):
        raise ValueError(f"{PACK_ENV}={choice!r}: use 'kernel' or 'xla'")
    return choice == "kernel" or (not choice and routes <= PACK_KERNEL_MAX_ROUTES)


def pack_for(ids, num_experts: int, plan: MoePlan) -> PackedRoutes:
    """The route packing the plan asks for (sorted blocks or one block per route); sorted
    blocks in one kernel launch where pack_in_kernel() and the kernel takes the size (up to
    1024 experts and 65536 routes), else XLA's counting sort (the same tables)."""
    if plan.packing == "per_route":
        return pack_routes_per_route(ids, num_experts, plan.block_m)
    T, top_k = jnp.shape(ids)
    routes = T * top_k
    if pack_in_kernel(routes):
        from .route_pack import PackConfig, pack_routes_gpu
        if PackConfig(routes=routes, experts=num_experts, block_m=plan.block_m,
                      blocks=plan.blocks, top_k=top_k).fits():
            return pack_routes_gpu(ids, num_experts, plan.block_m)
    return pack_routes(ids, num_experts, plan.block_m)


def _rotate_in(xs, rows_total: int):
    """fp32 [rows_total, d] (already * suh) -> (fp16 words of had128(xs) / s, row scales s
    float32 [rows_total]) (Hadamard kernel, hadamard.py's fp16 boundary)."""
    ones = jnp.ones((xs.shape[1],), jnp.float16)
    xh, scale = tg.hadamard_in(xs, ones, rows_total)
    return tg.f16_words(xh), scale


def _rotate_out(part, scale, rows_total: int, splits: int, n: int):
    """Flat fp32 K-split partials and the input's row scales -> fp32 [rows_total, n] =
    had128(sum of splits) * s."""
    ones = jnp.ones((n,), jnp.float16)
    return tg.hadamard_out(part, ones, None, scale, m=rows_total, m_pad=rows_total,
                           splits=splits, n=n)


def moe_gpu(x, ids, weights, w13, down, *, x_scale=None,
            plan: MoePlan | str | None = None, poison: bool = False,
            fused: bool | None = None, tiers=None):
    """Routed SwiGLU experts on the GPU, route-packed and grouped.

    Args:
      x: float [T, d], d <= H (padded hidden of w13).
      ids: int [T, top_k] local expert ids (-1 or out of range = no expert);
      weights: float [T, top_k].
      w13: Exl3Weight stacked [2, E] (plane 0 gate, plane 1 up); down: Exl3Weight [E].
        With ``tiers``: sequences of the tiers' slabs, w13[t] [2, E_t], down[t] [E_t].
      x_scale: optional float32 [T, 1]; the true input is x * x_scale.
      plan: a MoePlan, a plan kind, or None (auto / EXL3_JAX_MOE_PLAN).
      poison: kernels write into NaN-filled buffers (validation).
      fused: True: the fused glue kernels in one custom call (moe_layer: 4-5 launches);
        False: jnp glue + Hadamard kernels (8 launches); None: $EXL3_JAX_MOE_FUSED (default 1).
        Expert biases always take the unfused glue.
      tiers: mixed-bitrate experts in one set of launches: (expert_tier, expert_slot int32 [E],
        glue), global expert e at slot expert_slot[e] of tier expert_tier[e], glue the rotation
        tables in global expert order (exl3_jax.ops.moe.tier_glue: suh13 [2, E, H], svh13
        [2, E, I], suh2 [E, I], svh2 [E, H]). Route packing, the glue kernels and each GEMM
        phase run once for all tiers (fused glue only, no biases).
    Returns:
      float32 [T, down.out_features].
    """
    if not supports(w13, down):
        raise ValueError(f"no grouped MoE kernel for w13 {[w.stack_shape for w in _slabs(w13)]} "
                         f"K={[w.K for w in _slabs(w13)]}, down "
                         f"{[w.stack_shape for w in _slabs(down)]} K={[w.K for w in _slabs(down)]}")
    if (tiers is None) != isinstance(w13, Exl3Weight):
        raise ValueError("tier slabs (sequences of w13 / down) need tiers=(expert_tier, "
                         "expert_slot, glue), and tiers need sequences")
    T = x.shape[0]
    top_k = ids.shape[1]
    w0, d0 = _slabs(w13)[0], _slabs(down)[0]
    if tiers is None:
        E = w0.stack_shape[1]
        suh13, svh13, suh2, svh2 = w13.suh, w13.svh, down.suh, down.svh
        tier_maps = None
    else:
        expert_tier, expert_slot, (suh13, svh13, suh2, svh2) = tiers
        E = int(jnp.shape(expert_tier)[0])
        tier_maps = (expert_tier, expert_slot)
    H, I = w0.k, w0.n
    if not isinstance(plan, MoePlan):
        plan = plan_for(T, top_k, E, H, I, plan)
    rows = plan.rows
    x = _pad(x, H)

    if fused is None:
        fused = fused_glue_default()
    biased = any(w.bias is not None for w in _slabs(w13) + _slabs(down))
    cfg1 = grouped_config(w13, plan.fc1, plan)
    cfg2 = grouped_config(down, plan.fc2, plan)
    if tiers is not None and (biased or not fused):
        raise ValueError("tiers share launches only with the fused glue and no expert biases; "
                         "run each tier on its own (exl3_jax.ops.moe.moe_tiered does)")
    if fused and not biased:
        with jax.named_scope("route_packing"):         # (per-route plans: nothing to pack)
            kr = kernel_routes(ids, E, plan)
        assert kr.blocks == plan.blocks, (kr.blocks, plan.blocks)
        y = moe_layer(x, kr, w13, down, weights, glue=(suh13, svh13, suh2, svh2), cfg1=cfg1,
                      cfg2=cfg2, x_scale=x_scale, tier_maps=tier_maps,
                      valid_cols=w0.out_features, poison=poison)
        return y[:, :d0.out_features]

    with jax.named_scope("route_packing"):
        pr = pack_for(ids, E, plan)
    assert pr.blocks == plan.blocks, (pr.blocks, plan.blocks)

    # FC1: both planes' input rotations, one grouped launch over w13.
    xr = gather_rows(jnp.asarray(x, jnp.float32), pr.row_token)                  # [rows, H]
    suh = jnp.stack([gather_expert_rows(w13.suh[p], pr.row_expert) for p in range(2)])
    xs = (xr[None] * suh.astype(jnp.float32)).reshape(2 * rows, H)              # [2*rows, H]
    xw, scale1 = _rotate_in(xs, 2 * rows)
    init1 = (jnp.full((cfg1.splits * 2 * rows * I,), np.float32(np.nan)) if poison else None)
    init2 = (jnp.full((cfg2.splits * rows * H,), np.float32(np.nan)) if poison else None)
    part1 = grouped_partials(xw, w13, pr.block_expert, cfg1, init1)
    y1 = _rotate_out(part1, scale1, 2 * rows, cfg1.splits, I).reshape(2, rows, I)
    svh = jnp.stack([gather_expert_rows(w13.svh[p], pr.row_expert) for p in range(2)])
    y1 = y1 * svh.astype(jnp.float32)                                             # [2, rows, I]
    if w13.bias is not None:
        y1 = y1 + jnp.stack([gather_expert_rows(w13.bias[p], pr.row_expert)
                             for p in range(2)]).astype(jnp.float32)
    if x_scale is not None:
        y1 = y1 * gather_rows(jnp.asarray(x_scale, jnp.float32), pr.row_token)[None]
    h = jax.nn.silu(y1[0]) * y1[1]                                                # [rows, I]
    if w13.out_features < I:                                                      # padded I
        h = jnp.where(jnp.arange(I) < w13.out_features, h, 0.0)
    h = jnp.where((pr.row_token >= 0)[:, None], h, 0.0)     # padding rows stay exactly zero

    # FC2.
    xs2 = h * gather_expert_rows(down.suh, pr.row_expert).astype(jnp.float32)
    xw2, scale2 = _rotate_in(xs2, rows)
    part2 = grouped_partials(xw2, down, pr.block_expert, cfg2, init2)
    y2 = _rotate_out(part2, scale2, rows, cfg2.splits, down.n)
    y2 = y2 * gather_expert_rows(down.svh, pr.row_expert).astype(jnp.float32)    # [rows, H]
    if down.bias is not None:
        y2 = y2 + gather_expert_rows(down.bias, pr.row_expert).astype(jnp.float32)
    return combine_routes(y2, pr.route_row, weights)[:, :down.out_features]


def _pad(x, k: int):
    d = x.shape[-1]
    if d > k:
        raise ValueError(f"input last axis {d} exceeds the padded hidden size {k}")
    return x if d == k else jnp.pad(x, ((0, 0), (0, k - d)))


__all__ = ["CLUSTER_ENV", "GEMM_ENV", "GroupedMmaConfig", "GroupedWgmmaConfig", "KernelRoutes",
           "MAX_TIERS", "PLAN_ENV", "grouped_config", "grouped_partials", "kernel_routes",
           "launch_grouped_mma", "moe_gpu", "pack_for", "plan_for", "rotation_cluster",
           "round_robin_tiers", "supports", "with_gemm_override"]


# ---------------------------------------------------------------------------------------------
# Compile-only export check (CI): one process per arch, CUTE_DSL_ARCH set before import.


def round_robin_tiers(experts: int, tiers: int):
    """Experts 0..E-1 dealt round-robin to ``tiers`` tier slabs (the test and benchmark layers):
    numpy int32 expert_tier [E], expert_slot [E] and each tier's expert count."""
    expert_tier = (np.arange(experts) % tiers).astype(np.int32)
    expert_slot = (np.arange(experts) // tiers).astype(np.int32)
    return expert_tier, expert_slot, [int((expert_tier == t).sum()) for t in range(tiers)]


def export_moe(E: int, H: int, I: int, K, codebook: str, tokens: int, top_k: int,
               plan: str | None = None, scaled: bool = False, inter_valid: int | None = None,
               tiers=None):
    """jax.export of moe_gpu for platforms=["cuda"] on flat arrays (x, ids, weights, w13 leaves,
    down leaves); compiles every CuTe kernel of the layer for CUTE_DSL_ARCH. scaled: with an
    x_scale operand (the bf16 model path); inter_valid: logical I < padded I. tiers: a list of
    (codebook, K): the E experts dealt round-robin to these tiers and run through
    ops.moe.moe_tiered (auto plan), or moe_gpu with its tier tables (a plan named); one custom
    call either way (K and codebook unused)."""
    from jax import export

    from exl3_jax.format.spec import width_from_rate

    from .aot import disabled_checks

    iv = inter_valid or I
    sds = jax.ShapeDtypeStruct
    f16 = jnp.float16
    if tiers:
        import importlib
        moe_ops = importlib.import_module("exl3_jax.ops.moe")   # (exl3_jax.ops.moe is the function)
        expert_tier, expert_slot, counts = round_robin_tiers(E, len(tiers))

        def tiered(x, ids, wts, *leaves):
            slabs = []
            for t, (cb, Kt) in enumerate(tiers):
                t13, suh13, svh13, t2, suh2, svh2 = leaves[6 * t:6 * t + 6]
                slabs.append((Exl3Weight(t13, suh13, svh13, None, cb, Kt, H, iv),
                              Exl3Weight(t2, suh2, svh2, None, cb, Kt, iv, H)))
            if plan is None:
                return moe_ops.moe_tiered(x, ids, wts, slabs, expert_tier, expert_slot,
                                          backend="gpu")
            maps = (jnp.asarray(expert_tier), jnp.asarray(expert_slot),
                    moe_ops.tier_glue(slabs, expert_tier, expert_slot))
            return moe_gpu(x, ids, wts, [s[0] for s in slabs], [s[1] for s in slabs], plan=plan,
                           tiers=maps)

        args = [sds((tokens, H), jnp.bfloat16), sds((tokens, top_k), jnp.int32),
                sds((tokens, top_k), jnp.float32)]
        for (cb, Kt), n in zip(tiers, counts):
            W = width_from_rate(Kt)
            args += [sds((2, n, H // 16, I // 16, W), jnp.int16), sds((2, n, H), f16),
                     sds((2, n, I), f16), sds((n, I // 16, H // 16, W), jnp.int16),
                     sds((n, I), f16), sds((n, H), f16)]
        return export.export(jax.jit(tiered), platforms=["cuda"],
                             disabled_checks=disabled_checks())(*args)

    W = width_from_rate(K)

    def fn(x, ids, wts, t13, suh13, svh13, t2, suh2, svh2):
        w13 = Exl3Weight(t13, suh13, svh13, None, codebook, K, H, iv)
        down = Exl3Weight(t2, suh2, svh2, None, codebook, K, iv, H)
        scale = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=1, keepdims=True) if scaled else None
        return moe_gpu(x, ids, wts, w13, down, plan=plan, x_scale=scale)

    args = [sds((tokens, H), jnp.bfloat16), sds((tokens, top_k), jnp.int32),
            sds((tokens, top_k), jnp.float32),
            sds((2, E, H // 16, I // 16, W), jnp.int16), sds((2, E, H), f16), sds((2, E, I), f16),
            sds((E, I // 16, H // 16, W), jnp.int16), sds((E, I), f16), sds((E, H), f16)]
    return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=disabled_checks())(
        *args)


def _moe_case(case) -> dict:
    """[codebook, K, tokens, plan, E, H, I, top_k(, scaled, inter_valid)]; a codebook of the
    form "mcg:3+mul1:4" makes it a tiered layer (one tier per codebook:K, K unused)."""
    codebook, K, tokens, plan, E, H, I, top_k = case[:8]
    scaled, inter_valid = (list(case[8:10]) + [False, None])[:2] if len(case) > 8 else (
        False, None)
    tiers = None
    if ":" in codebook:
        tiers = [(cb, float(k) if "." in k else int(k))
                 for cb, k in (t.split(":") for t in codebook.split("+"))]
    return dict(codebook=codebook, K=K, tokens=tokens, plan=plan, E=E, H=H, I=I, top_k=top_k,
                scaled=scaled, inter_valid=inter_valid, tiers=tiers)


def _export_moe_case(c):
    return export_moe(c["E"], c["H"], c["I"], c["K"], c["codebook"], c["tokens"], c["top_k"],
                      c["plan"], c["scaled"], c["inter_valid"], c["tiers"])


if __name__ == "__main__":
    import sys

    from .aot import check_main
    sys.exit(check_main(_moe_case, _export_moe_case,
                        "compile-only export check of the grouped MoE",
                        "JSON list of [codebook, K, tokens, plan, E, H, I, top_k"
                        "(, scaled, inter_valid)]"))
