"""Route packing of the grouped MoE as one CuTe DSL kernel: the tables of
``exl3_jax.ops.moe_routing.pack_routes`` (routes grouped by expert in (token, slot) order,
padded into blocks of block_m rows), bit for bit, from one CTA.

Why: the XLA form (a counting sort from chunked comparisons) is a handful of fusions, and at the
route counts of decode steps and short prompts their launches, not their work, set its time
(14-18 us on the H100 from 64 to 1024 tokens, call 62). One CTA does the same work in one launch.

One CTA of THREADS threads (warp w owns routes [w * S, (w + 1) * S), S = rounds * 32):
  1. each warp ranks its routes round by round: match.any finds the lanes of the round with
     the same expert, the lanes below a route among them give its rank in the round, and the
     warp's running count per expert (shared memory [warp, expert]) its rank before the round;
  2. thread e turns column e of the counts into each warp's offset among expert e's routes and
     e's total, and a block-wide scan of the experts' block counts gives their first rows;
  3. each block's expert is found by a binary search of the experts' block ends (-1 past the
     last used block), each row's expert is its block's, every row's token is set to -1;
  4. each route's row is its expert's first row + its warp's offset + its rank in the warp: the
     route's row in route_row, the route's token in that row of row_token.
The order inside an expert is the routes' flat order, as pack_routes', so every table is equal.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import jax
import jax.numpy as jnp
from cutlass import Int32

from exl3_jax.ops.moe_routing import PackedRoutes, max_blocks

from .cute_ops import cta_thread_ids

THREADS = 1024                 # one CTA; thread e < E owns expert e in step 2
WARPS = THREADS // 32
MAX_ROUNDS = 64                # rounds of 32 routes per warp (65536 routes)
# Up to this many rounds a lane keeps its routes' experts and ranks in registers from step 1 to
# step 4; past it the rank goes through route_row and the expert is read again (1024 threads
# leave 64 registers each: 32 rounds spilled on sm_90a, 8 on sm_120a).
REGISTER_ROUNDS = 4
MAX_SMEM_BYTES = 227 * 1024


@dataclasses.dataclass(frozen=True)
class PackConfig:
    """Every compile-time parameter of the packing kernel."""
    routes: int          # R = T * top_k
    experts: int         # E
    block_m: int
    blocks: int          # the static block bound (moe_routing.max_blocks)
    top_k: int

    @property
    def rounds(self) -> int:
        """Rounds of 32 routes per warp."""
        return -(-self.routes // THREADS)

    @property
    def rows(self) -> int:
        return self.blocks * self.block_m

    @property
    def scan_width(self) -> int:
        """The experts rounded up to a power of two (the scan's and the search's span)."""
        return 1 << max(0, (self.experts - 1).bit_length())

    @property
    def smem_words(self) -> int:
        """Counts [WARPS, E], the scan's two buffers [2, scan_width], first rows [E], the
        blocks' experts [blocks]."""
        return WARPS * self.experts + 2 * self.scan_width + self.experts + self.blocks

    def fits(self) -> bool:
        """Whether one CTA takes this size (experts, routes, shared memory)."""
        return (1 <= self.experts <= THREADS and self.rounds <= MAX_ROUNDS
                and self.smem_words * 4 <= MAX_SMEM_BYTES)

    def validate(self) -> "PackConfig":
        if self.routes < 1 or self.top_k < 1 or self.routes % self.top_k:
            raise ValueError(f"routes {self.routes} / top_k {self.top_k}: need T * top_k routes")
        if not 1 <= self.experts <= THREADS:
            raise ValueError(f"{self.experts} experts; the packing kernel takes 1..{THREADS}")
        if self.rounds > MAX_ROUNDS:
            raise ValueError(f"{self.routes} routes exceed the packing kernel's "
                             f"{MAX_ROUNDS * THREADS}")
        if self.blocks != max_blocks(self.routes, self.experts, self.block_m):
            raise ValueError(f"blocks {self.blocks} is not the static bound "
                             f"{max_blocks(self.routes, self.experts, self.block_m)}")
        if self.smem_words * 4 > MAX_SMEM_BYTES:
            raise ValueError(f"{self.smem_words * 4} bytes of shared memory exceed "
                             f"{MAX_SMEM_BYTES}")
        return self


def _experts_through(scan, base: int, b, cfg):
    """Experts whose blocks all end at or before block b: the count of ends[e] <= b, by binary
    search of the experts' inclusive block ends (non-decreasing, scan[base + e]). Plain Python
    (trace time)."""
    lo = Int32(0)
    for s in range(cfg.scan_width.bit_length() - 1, -1, -1):
        probe = lo + (1 << s)
        inside = probe <= cfg.experts
        idx = cutlass.select_(inside, probe, Int32(cfg.experts)) - 1
        lo = cutlass.select_(inside & (scan[base + idx] <= b), probe, lo)
    return lo


@cute.kernel
def _pack_routes_kernel(ids: cute.Tensor, row_token: cute.Tensor, row_expert: cute.Tensor,
                        block_expert: cute.Tensor, route_row: cute.Tensor,
                        num_blocks: cute.Tensor, cfg: cutlass.Constexpr):
    tid, lane, warp, _ = cta_thread_ids()
    E, W = cfg.experts, cfg.scan_width
    smem = cutlass.memory.SmemAllocator()
    count = smem.allocate_tensor(Int32, cute.make_layout(WARPS * E), 16)   # [warp, expert]
    scan = smem.allocate_tensor(Int32, cute.make_layout(2 * W), 16)       # ping-pong [2, W]
    first_row = smem.allocate_tensor(Int32, cute.make_layout(E), 16)
    owners = smem.allocate_tensor(Int32, cute.make_layout(cfg.blocks), 16)
    for i in cutlass.range_constexpr(-(-(WARPS * E) // THREADS)):
        j = tid + i * THREADS
        if j < WARPS * E:
            count[j] = Int32(0)
    cute.arch.sync_threads()

    # 1. Ranks within the warp, round by round (a route of no expert: key -1, never counted).
    keys, ranks = [], []
    below = (Int32(1) << lane) - 1                       # lanes under this one
    for i in cutlass.range_constexpr(cfg.rounds):
        r = warp * (cfg.rounds * 32) + i * 32 + lane
        inside = r < cfg.routes
        e = Int32(ids[cutlass.select_(inside, r, Int32(0))])
        key = cutlass.select_(inside & (e >= 0) & (e < E), e, Int32(-1))
        peers = Int32(cute.arch.match_sync(0xFFFFFFFF, key))
        rank = Int32(cute.arch.popc(peers & below))
        slot = warp * E + cutlass.max(key, Int32(0))
        before = count[slot]
        cute.arch.sync_warp()                            # every lane read before the update
        if (key >= 0) & (rank == 0):                     # the lowest lane of each expert
            count[slot] = before + Int32(cute.arch.popc(peers))
        cute.arch.sync_warp()
        if cutlass.const_expr(cfg.rounds <= REGISTER_ROUNDS):
            keys.append(key)
            ranks.append(before + rank)
        else:
            if inside:
                route_row[r] = before + rank             # step 4 reads it back (this thread)
    cute.arch.sync_threads()

    # 2. Thread e: each warp's offset among expert e's routes, e's block count; the scan.
    blocks_e = Int32(0)
    if tid < E:
        total = Int32(0)
        for w in cutlass.range_constexpr(WARPS):
            c = count[w * E + tid]
            count[w * E + tid] = total
            total = total + c
        blocks_e = (total + cfg.block_m - 1) // cfg.block_m
    if tid < W:
        scan[tid] = blocks_e                             # (experts past E: 0 blocks)
    cute.arch.sync_threads()
    steps = W.bit_length() - 1
    for p in cutlass.range_constexpr(steps):             # Hillis-Steele, inclusive
        src, dst, d = (p % 2) * W, (1 - p % 2) * W, 1 << p
        if tid < W:
            v = scan[src + tid]
            if tid >= d:
                v = v + scan[src + tid - d]
            scan[dst + tid] = v
        cute.arch.sync_threads()
    ends = (steps % 2) * W                               # scan[ends + e]: e's inclusive end
    if tid < E:
        first_row[tid] = (scan[ends + tid] - blocks_e) * cfg.block_m
    if tid == 0:
        num_blocks[0] = scan[ends + E - 1]
    cute.arch.sync_threads()

    # 3. Blocks' experts (a binary search each, kept in shared memory), rows' experts, rows'
    # tokens -1 (step 4 writes the routed rows' tokens after the barrier below).
    for i in cutlass.range(-(-cfg.blocks // THREADS)):
        b = tid + i * THREADS
        if b < cfg.blocks:
            owner = _experts_through(scan, ends, b, cfg)
            owner = cutlass.select_(owner < E, owner, Int32(-1))
            owners[b] = owner
            block_expert[b] = owner
    cute.arch.sync_threads()
    for i in cutlass.range(-(-cfg.rows // THREADS)):
        q = tid + i * THREADS
        if q < cfg.rows:
            row_expert[q] = owners[q // cfg.block_m]
            row_token[q] = Int32(-1)
    cute.arch.sync_threads()

    # 4. Rows of the routes.
    for i in cutlass.range_constexpr(cfg.rounds):
        r = warp * (cfg.rounds * 32) + i * 32 + lane
        if r < cfg.routes:
            if cutlass.const_expr(cfg.rounds <= REGISTER_ROUNDS):
                key_r, rank_r = keys[i], ranks[i]
            else:
                e_r = Int32(ids[r])
                key_r = cutlass.select_((e_r >= 0) & (e_r < E), e_r, Int32(-1))
                rank_r = Int32(route_row[r])
            e0 = cutlass.max(key_r, Int32(0))
            row = first_row[e0] + count[warp * E + e0] + rank_r
            route_row[r] = cutlass.select_(key_r >= 0, row, Int32(-1))
            if key_r >= 0:
                row_token[row] = r // cfg.top_k


@cute.jit
def launch_pack_routes(stream, ids: cute.Tensor, row_token: cute.Tensor,
                       row_expert: cute.Tensor, block_expert: cute.Tensor,
                       route_row: cute.Tensor, num_blocks: cute.Tensor,
                       cfg: cutlass.Constexpr):
    """cutlass_call entry: ids int32 [R] -> row_token [rows], row_expert [rows], block_expert
    [blocks], route_row [R], num_blocks [1] (int32)."""
    _pack_routes_kernel(ids, row_token, row_expert, block_expert, route_row, num_blocks,
                        cfg).launch(grid=(1, 1, 1), block=(THREADS, 1, 1), stream=stream)


def pack_routes_gpu(ids, num_experts: int, block_m: int) -> PackedRoutes:
    """``moe_routing.pack_routes`` in one kernel launch (same tables).

      ids: int [T, top_k] expert ids (outside [0, num_experts): no route); block_m: rows per
      block. -> PackedRoutes."""
    from cutlass.jax import cutlass_call

    from . import trellis_gemm as tg
    ids = jnp.asarray(ids, jnp.int32)
    if ids.ndim != 2:
        raise ValueError(f"ids must be [T, top_k], got shape {ids.shape}")
    T, top_k = ids.shape
    R = T * top_k
    cfg = PackConfig(routes=R, experts=num_experts, block_m=block_m,
                     blocks=max_blocks(R, num_experts, block_m), top_k=top_k).validate()
    sds = jax.ShapeDtypeStruct
    row_token, row_expert, block_expert, route_row, nblk = cutlass_call(
        launch_pack_routes, cfg=cfg, compile_options=tg._cute_options(),
        output_shape_dtype=(sds((cfg.rows,), jnp.int32), sds((cfg.rows,), jnp.int32),
                            sds((cfg.blocks,), jnp.int32), sds((R,), jnp.int32),
                            sds((1,), jnp.int32)))(ids.reshape(-1))
    return PackedRoutes(row_token=row_token, row_expert=row_expert, block_expert=block_expert,
                        route_row=route_row.reshape(T, top_k), num_blocks=nblk[0],
                        block_m=block_m)


__all__ = ["PackConfig", "launch_pack_routes", "pack_routes_gpu"]
