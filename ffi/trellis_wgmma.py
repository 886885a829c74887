"""Trellis GEMM on Hopper's warpgroup MMA (wgmma, sm_90a only): weights decoded in registers
straight into wgmma's A operand, token tiles of 32-256 staged in shared memory (the "wgmma" plan).

    partial[s, m, n] = sum over split s's k16 steps of  xh[m, k16 step] @ W_hat[k16 step, n]

Why: from m ~ 64 up the tensor core, not the decode, is what a Trellis GEMM can be bound by, and
mma.sync reaches about half of the H200's fp16 rate (bench/NOTES.md: the tiles kernel's floor).
wgmma takes A from registers, and its per-warp A fragment (rows 16w..16w+15 of the 64 for warp
w of the warpgroup) has mma.sync m16n8k16's layout, i.e. the EXL3 in-tile order: each warp
decodes one 16x16 trellis tile per k16 step into its 4 A registers with the decode kernels'
arithmetic (cute_ops.decode_words, packed pairs), and one wgmma multiplies the warpgroup's 64
output columns into all m_tile tokens of the CTA. Decoding per CTA (not per 8 tokens) makes the
decode ALU cost m_tile / 8 times smaller per multiply-add than the decode plan's.

Tiling (WgmmaGemmConfig): a CTA of ``warpgroups`` warpgroups owns 64 * warpgroups output columns
(warp w: n16 tile bx * 4 * warpgroups + w), m_tile tokens (wgmma's N) and one K-split; a chunk is
K_CHUNK = 4 k16 steps. Everything a chunk reads arrives by cp.async, which has no destination
register for ptxas to sink next to its first use (session 18's register-staged loop asked for
chunk c + 1's loads during chunk c, and ptxas moved them to the end of chunk c; the copies
took 4-17% off at m >= 32 on the H200: bench/NOTES.md, session 20):
  * activations two chunks ahead into a ring of ACTIVATION_STAGES = 4 shared-memory stages (64 k
    per token: one 128-byte row, the canonical K-major 128-byte-swizzle layout that wgmma's B
    descriptor reads). Chunk c + 2 lands in the stage chunk c - 2 read: a warpgroup keeps at
    most K_CHUNK wgmmas in flight, so every wgmma reading it retired before its warpgroup passed
    chunk c - 1's barrier;
  * each warp's weight words (its K_CHUNK tiles, one 16-byte copy per lane at K = 4)
    weight_ring - 1 chunks ahead into its private ring of weight_ring chunk slots, which the
    decode reads back (LDS); chunk c + R - 1 lands in the slot chunk c - 1 read.
Chunk c + 2's activations and chunk c + R - 1's weights form one cp.async group issued at the top
of chunk c; at its end wait_group 1 (chunk c + 1's group is older than the newest) then
fence.proxy.async and one barrier.

Option: ``fused_out`` (one K-split, two warpgroups: the CTA's 128 columns are one Hadamard
block) applies the output transform in the epilogue and writes y instead of partials.

Grouped (``experts`` > 0: the MoE's prefill GEMMs, ffi/trellis_moe.py): the token tiles are the
route-packed blocks of m_tile rows, each multiplied by the trellis of its own expert (bexp
[blocks]) in a stack [planes, experts, k/16, n/16, W/2]; grid z runs over planes x blocks and
the rows of plane p start at p * m_pad. A block without an expert (-1) skips the k loop and
writes zeros. Mixed-bitrate layers (``tier`` >= 0) launch the kernel once per tier slab: bexp
holds the layer's global expert ids, etier / eslot [global_experts] map them to (tier, slot), a
launch multiplies the blocks of its own tier's experts and leaves every other block's partials
to that tier's launch (blocks without an expert: tier 0's, zeros).

Per STEP_BATCH = 2 k16 steps a warp: reads its two tiles' words from its ring slot and decodes
them (overlapping the warpgroup's previous batch, in flight), wgmma.fence, one wgmma
m64n{m_tile}k16 per step (A: the step's 4 registers; B: the stage's descriptor advanced by 32
bytes per step), one commit, wait_group 1. The wait names the previous batch's A registers as
inputs, so they stay allocated until it has read them; the final wait_group 0 ties the
accumulators before the epilogue reads them.

(A from shared memory instead, each chunk decoded one chunk ahead into an A stage with 2 or 4
warpgroups, ran 25-40% slower than register A at m = 128 and 1024 on the H100: bench/NOTES.md,
session 23; removed.)

Layout contract (flat, sizes static):
  xw:  uint32 [m_pad, k/2]        fp16 pairs of xh, row-major, zero padded rows (the input
                                  transform's "rows" layout, as the tiles plan)
  tw:  uint32 [k/16, n/16, W/2]   the trellis words
  out: float32 [splits, m_pad, n] K-split partial sums (the output transform sums them), or
                                  with fused_out y [m_pad, n], the linear's output (padded
                                  rows included; the caller keeps the first m)
  grouped: xw [planes, m_pad, k/2], tw [planes, experts, k/16, n/16, W/2], out [splits,
                                  planes, m_pad, n], bexp int32 [m_blocks] (dense: unread);
                                  tiers: etier, eslot int32 [global_experts]
  svh, bias: float16 [n]; scale: float32 [m_pad] (the input transform's row scales): read by
                                  the fused_out epilogue only
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64, Uint32
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .cute_ops import (cp_async_16, cp_async_commit, cp_async_wait, cta_thread_ids,
                       decode_words, hadamard128_lane, inline_ptx, lane_funnels, lane_pieces,
                       load_tile_words)
from .hadamard import SCALE as HAD_SCALE
from .trellis_geometry import A_OPERAND_PAIRS, lane_geometry
from .trellis_tiles import TokenTiles

ARCH = "sm_90a"        # wgmma exists on Hopper only (sm_120a has mma.sync: the tiles plan)
K_CHUNK = 4            # k16 steps per stage: 64 fp16 = one 128-byte swizzle row per token
ACTIVATION_STAGES = 4  # chunk c + 2 lands in the stage chunk c - 2 read
# k16 steps a warp decodes before it issues their wgmmas (one commit group; one group stays in
# flight while the next batch decodes): two independent decode chains for ptxas to interleave.
# H100, session 29, against one step per group: m = 32 -2 to -6%, m = 128 within +-3%
# (8192x28672, 4096x14336, K4 mcg / mul1); outputs bit for bit equal. The wait keeps an
# in-flight wgmma's A values alive, not its registers: with two groups of two in flight (or four
# of one, session 21) ptxas moved them and reused registers the hardware still reads (CPU SASS,
# K3-K4 mcg / mul1), so one group stays the only depth.
STEP_BATCH = 2
MIN_WEIGHT_RING = 3    # chunk c + R - 1 lands in chunk c - 1's slot; R - 1 >= 2 so the chunk
                       # due next is never in the newest cp.async group
WEIGHT_RING = 4        # measured on the H200 (session 20): 4 and 6 within 2-5%, both ahead of
                       # register staging at m >= 32 (up to -17% at 8192x28672 m = 32)
ROW_BYTES = 128
SWIZZLE_ATOM_BYTES = 8 * ROW_BYTES     # 8 rows of 128 bytes: the descriptor's stride offset
M_TILES = (32, 64, 128, 256)           # wgmma N values used (accumulators: m_tile / 2 per lane)
# Matrix descriptor (PTX ISA, "Matrix Descriptor Format"), high word: stride byte offset 1024 >> 4
# in bits 32..45, swizzle mode 1 (128-byte) in bits 62..63; low word: leading byte offset 1 (not
# used by swizzled K-major layouts) in bits 16..29 and the start address >> 4 in bits 0..13.
DESC_HI = (SWIZZLE_ATOM_BYTES >> 4) | (1 << 30)
DESC_LO_FLAGS = 1 << 16
# fused_out epilogue: fp32 rows of the CTA's 128 columns padded by 4 words, so the D fragments'
# stores (lanes 4 tokens x 8 columns apart) fall into 32 distinct banks.
EPILOGUE_ROW_WORDS = 132
MAX_SMEM_BYTES = 227 * 1024            # sm_90's largest dynamic shared memory per CTA


@dataclasses.dataclass(frozen=True)
class WgmmaGemmConfig(TokenTiles):
    """Every compile-time parameter of the wgmma Trellis GEMM."""
    codebook: str
    K: float
    m_blocks: int          # CTA token tiles (grid z)
    k: int
    n: int
    m_tile: int = 128      # tokens per CTA = wgmma's N (M_TILES)
    warpgroups: int = 2    # 64 output columns each
    splits: int = 1        # K-splits (grid y)
    # Chunk slots of each warp's weight ring (weights weight_ring - 1 chunks ahead).
    weight_ring: int = WEIGHT_RING
    # One K-split: the epilogue applies the output transform (Hadamard-128 over the CTA's 128
    # columns through shared memory, * SCALE * svh * row scale + bias, as
    # hadamard._hadamard_out_kernel) and writes y [m_pad, n] fp32 instead of partials.
    fused_out: bool = False
    biased: bool = False   # fused_out: the linear has a bias
    # Grouped (see the module docstring): experts of the stacked trellis (0: one dense weight)
    # and its planes (the MoE's FC1: gate and up).
    experts: int = 0
    planes: int = 1
    # One tier slab of a mixed-bitrate layer (see the module docstring): its index of
    # tier_count, and the layer's expert count (bexp's range); -1: bexp indexes the stack.
    tier: int = -1
    tier_count: int = 0
    global_experts: int = 0

    chunk_steps = K_CHUNK
    stages = ACTIVATION_STAGES

    @property
    def slot_words(self) -> int:
        """Words of one warp's weight-ring slot: its K_CHUNK tiles."""
        return K_CHUNK * lane_geometry(self.K).words

    @property
    def smem_words(self) -> int:
        """The stage ring and the warps' weight rings after it, or (fused_out) the epilogue's
        fp32 tile if larger (the same buffer: the epilogue starts once every wgmma has retired
        and every copy has landed)."""
        ring = self.stages * self.stage_words \
            + 4 * self.warpgroups * self.weight_ring * self.slot_words
        return max(ring, self.m_tile * EPILOGUE_ROW_WORDS) if self.fused_out else ring

    @property
    def cta_n16(self) -> int:
        return 4 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * self.warpgroups

    @property
    def acc_regs(self) -> int:
        return self.m_tile // 2

    @property
    def stage_words(self) -> int:
        return self.m_tile * ROW_BYTES // 4

    def validate(self) -> "WgmmaGemmConfig":
        if self.m_tile not in M_TILES:
            raise ValueError(f"m_tile {self.m_tile} must be one of {M_TILES}")
        if self.warpgroups not in (1, 2):
            raise ValueError(f"warpgroups {self.warpgroups} must be 1 or 2")
        if self.smem_words * 4 > MAX_SMEM_BYTES:
            raise ValueError(f"{self.smem_words * 4} bytes of shared memory per CTA exceed "
                             f"{MAX_SMEM_BYTES}")
        if self.weight_ring < MIN_WEIGHT_RING:
            raise ValueError(f"weight_ring {self.weight_ring} must be at least "
                             f"{MIN_WEIGHT_RING} chunk slots")
        if self.fused_out and (self.splits != 1 or self.warpgroups != 2):
            raise ValueError("fused_out needs one K-split and two warpgroups (a CTA's 128 "
                             "columns are one Hadamard block)")
        if self.experts < 0 or self.planes < 1 or (self.planes > 1 and not self.experts):
            raise ValueError(f"experts {self.experts} / planes {self.planes}: planes need a "
                             f"grouped (experts > 0) config")
        if self.experts and self.fused_out:
            raise ValueError("a grouped config writes partials (no fused_out)")
        if self.tier >= 0 and not (self.experts and self.global_experts >= 1
                                   and self.tier < self.tier_count):
            raise ValueError(f"tier {self.tier} of {self.tier_count} needs a grouped config and "
                             f"the layer's expert count (global_experts {self.global_experts})")
        self.check_token_tiling()
        return self


def stage_unit(cfg: WgmmaGemmConfig, unit):
    """(token row, 16-byte segment of its 128-byte chunk row) of copy unit ``unit``. Plain
    integer arithmetic (DSL integers in the kernel, numpy in the tests)."""
    return unit // (ROW_BYTES // 16), unit % (ROW_BYTES // 16)


def swizzled_word(row, seg):
    """First uint32 word, within a stage, of 16-byte segment ``seg`` of token ``row``: the
    128-byte swizzle puts segment s of row r at segment s ^ (r % 8) (address bits 4..6 XOR bits
    7..9, as wgmma applies it to the 1024-byte aligned stage)."""
    return row * (ROW_BYTES // 4) + (seg ^ (row % 8)) * 4


def d_fragment_position(warp, lane, i):
    """(token within the tile, column within the CTA's 128) of accumulator register i of
    ``lane`` in ``warp`` (0..7): wgmma m64nNk16's D fragment (warp w % 4 of a warpgroup holds
    rows 16 (w % 4) + lane // 4 (+ 8 for registers 2, 3 of each 4), register 4j + r at column
    8j + 2 (lane % 4) + r % 2), with D's rows the weight's output columns (warpgroup w // 4
    at 64 (w // 4)) and its columns the tokens. Plain integer arithmetic."""
    return (8 * (i // 4) + 2 * (lane % 4) + i % 2, 16 * warp + lane // 4 + 8 * ((i % 4) // 2))


def descriptor_lo(stage_address, kk=0):
    """Low word of the B descriptor of k16 step kk of the stage at shared address
    ``stage_address`` (1024-byte aligned): the start address advances 32 bytes per step inside
    the swizzle row, the hardware swizzles the rest. Shared addresses are below 2^18, so the
    start field never carries into the flags: the kernel adds stage and step offsets (in 16-byte
    units) to one chunk's word instead of recomputing it."""
    return ((stage_address >> 4) + 2 * kk) | DESC_LO_FLAGS


@dsl_user_op
def _st_shared_f32(address, v, *, loc=None, ip=None) -> None:
    llvm.inline_asm(None, [Int32(address).ir_value(loc=loc, ip=ip),
                           Float32(v).ir_value(loc=loc, ip=ip)],
                    "st.shared.f32 [$0], $1;", "r,f,~{memory}", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def _ld_shared_v4_f32(address, *, loc=None, ip=None) -> list:
    res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * 4),
                          [Int32(address).ir_value(loc=loc, ip=ip)],
                          "ld.shared.v4.f32 {$0, $1, $2, $3}, [$4];", "=f,=f,=f,=f,r,~{memory}",
                          has_side_effects=True, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(4)]


def wgmma_fence():
    inline_ptx("wgmma.fence.sync.aligned;")


def wgmma_commit():
    inline_ptx("wgmma.commit_group.sync.aligned;")


def proxy_fence_shared():
    """Ordinary shared-memory stores made visible to the async proxy (wgmma's operand reads)."""
    inline_ptx("fence.proxy.async.shared::cta;")


def _wgmma_async(acc, a_words, b_desc_lo, loc, ip) -> list:
    """One wgmma.mma_async m64nNk16 (N = 2 * len(acc), fp32 accumulators tied in and out) with
    B from its K-major 128-byte-swizzled descriptor's low word and A from 4 f16x2 registers."""
    n_acc = len(acc)
    d = ", ".join(f"${i}" for i in range(n_acc))
    ai = 2 * n_acc                     # operands: outputs, the tied accumulators, then these
    a_text = "{" + ", ".join(f"${ai + i}" for i in range(4)) + "}"
    body = (f"{{\n .reg .pred p;\n .reg .b64 db;\n .reg .b32 hi;\n"
            f" setp.ne.b32 p, ${ai + 5}, 0;\n"
            f" mov.b32 hi, {DESC_HI};\n"
            f" mov.b64 db, {{${ai + 4}, hi}};\n"
            f" wgmma.mma_async.sync.aligned.m64n{2 * n_acc}k16.f32.f16.f16 {{{d}}}, "
            f"{a_text}, db, p, 1, 1, 0;\n}}")
    operands = ([Float32(v).ir_value(loc=loc, ip=ip) for v in acc]
                + [Uint32(v).ir_value(loc=loc, ip=ip) for v in a_words]
                + [Uint32(b_desc_lo).ir_value(loc=loc, ip=ip), Uint32(1).ir_value(loc=loc, ip=ip)])
    constraints = ",".join(["=f"] * n_acc + [str(i) for i in range(n_acc)] + ["r"] * 6)
    res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * n_acc), operands, body,
                          constraints + ",~{memory}", has_side_effects=True,
                          is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n_acc)]


@dsl_user_op
def wgmma_rs(acc, a, desc_lo, *, loc=None, ip=None) -> list:
    """acc += A (this warp's 16 rows of 64 x 16, 4 f16x2 registers) @ B (16 x N from the
    K-major 128-byte-swizzled descriptor), N = 2 * len(acc), fp32 accumulators (asynchronous:
    read acc only after wgmma_wait_acc)."""
    return _wgmma_async(acc, list(a), desc_lo, loc, ip)


@dsl_user_op
def wgmma_wait_a(pending: int, a, *, loc=None, ip=None) -> None:
    """wait_group ``pending``; the A registers ``a`` (of the wgmma this wait retires) are inputs,
    so they stay allocated until here."""
    llvm.inline_asm(None, [Uint32(v).ir_value(loc=loc, ip=ip) for v in a],
                    f"wgmma.wait_group.sync.aligned {pending};",
                    ",".join(["r"] * len(a)) + ",~{memory}", has_side_effects=True,
                    is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip)


@dsl_user_op
def wgmma_wait_acc(acc, *, loc=None, ip=None) -> list:
    """wait_group 0 with the accumulators tied through it: their later reads follow it."""
    n_acc = len(acc)
    res = llvm.inline_asm(llvm.StructType.get_literal([T.f32()] * n_acc),
                          [Float32(v).ir_value(loc=loc, ip=ip) for v in acc],
                          "wgmma.wait_group.sync.aligned 0;",
                          ",".join(["=f"] * n_acc + [str(i) for i in range(n_acc)])
                          + ",~{memory}", has_side_effects=True, is_align_stack=False,
                          asm_dialect=llvm.AsmDialect.AD_ATT)
    return [Float32(llvm.extractvalue(T.f32(), res, [i], loc=loc, ip=ip)) for i in range(n_acc)]


def _copy_stage_async(xw, m0, ks, stage_address, tid, cfg):
    """This thread's copy units of the chunk starting at k16 step ks, by cp.async into the
    stage (one group per call)."""
    src = xw.iterator.toint()
    for i in range(cfg.copy_units):
        row, seg = stage_unit(cfg, tid + i * cfg.threads)
        cp_async_16(stage_address + swizzled_word(row, seg) * 4,
                    src + Int64((m0 + row) * (cfg.k // 2) + ks * 8 + seg * 4) * 4)
    cp_async_commit()


def _copy_chunks_ahead(xw, tw, c, tn, m0, ks0, ring_address, base, tid, lane, geo, cfg):
    """At the top of chunk c, one cp.async group: the warp's weights of chunk c + R - 1 into
    ring slot (c + R - 1) % R, and the CTA's activations of chunk c + 2 into stage
    (c + 2) % ACTIVATION_STAGES. Past the last chunk every copy re-loads it (in bounds, into
    stages and slots never read again). tn: the warp's tile in the flat (k16 = 0) tile
    sequence (grouped: its expert's stack included); m0: the tile's first activation row."""
    last, lead = cfg.chunks - 1, cfg.weight_ring - 1
    _copy_weights_async(tw, ks0 + cutlass.min(c + lead, last) * K_CHUNK, tn,
                        ring_address + ((c + lead) % cfg.weight_ring) * cfg.slot_words * 4,
                        lane, geo, cfg)
    _copy_stage_async(xw, m0, ks0 + cutlass.min(c + 2, last) * K_CHUNK,
                      base + ((c + 2) % ACTIVATION_STAGES) * cfg.stage_words * 4, tid, cfg)


def weight_piece(p, geo):
    """(k16 step within the chunk, 16-byte piece within its tile) of piece p of a warp's
    chunk of weight words (K_CHUNK tiles of geo.words words, each a whole number of 16-byte
    pieces). Plain integer arithmetic."""
    per_tile = geo.words // 4
    return p // per_tile, p % per_tile


def _copy_weights_async(tw, ks, tn, slot_address, lane, geo, cfg):
    """This lane's cp.asyncs of the warp's weight words of the chunk at k16 step ks into the
    ring slot at shared byte address slot_address (piece p of the chunk at slot_address + 16 p:
    the slot holds the K_CHUNK tiles back to back; the pieces split over the lanes as
    cute_ops.lane_pieces does).
    Joins the next cp.async group (committed by the caller)."""
    src = tw.iterator.toint()
    for p in lane_pieces(lane, K_CHUNK * geo.words // 4):
        kk, q = weight_piece(p, geo)
        cp_async_16(slot_address + p * 16,
                    src + Int64(((ks + kk) * cfg.n16 + tn) * geo.words + 4 * q) * 4)


def _ring_weight_words(smem, slot_word, funnels, geo):
    """step kk -> the lane's words of step kk's tile in its weight-ring slot (word index
    slot_word of the kernel's shared buffer), as load_tile_words returns them."""
    return lambda kk: load_tile_words(smem, slot_word + kk * geo.words, funnels, geo)


def _a_fragment(words, funnels, geo, cfg):
    """The 4 A fragment registers (f16x2) of a tile decoded from the lane's ``words``."""
    h = decode_words(words, funnels, geo, cfg.codebook)
    return [h[p[0] // 2] for p in A_OPERAND_PAIRS]


def _mma_chunk(acc, a_prev, step_words, desc_lo, funnels, geo, cfg):
    """The chunk's K_CHUNK steps in batches of STEP_BATCH: decode the warp's tiles of the
    batch (words: ``step_words(kk)``, from its weight-ring slot) into A registers, one wgmma per
    step against the stage whose step-0 descriptor word is ``desc_lo``, one commit group per
    batch, one group in flight while the next decodes (acc; a_prev: the A registers of the
    group in flight, 4 per wgmma: register tensors). Plain Python inlined at trace time, hence
    ``range``: the DSL preprocessor rewrites only the kernels."""
    batch = STEP_BATCH
    regs = 4 * batch                          # A registers per commit group
    for k0 in range(0, K_CHUNK, batch):
        a = []
        for kk in range(k0, k0 + batch):
            a += _a_fragment(step_words(kk), funnels, geo, cfg)
        wgmma_fence()
        for j in range(batch):
            d = wgmma_rs([acc[i] for i in range(cfg.acc_regs)], a[4 * j:4 * j + 4],
                         desc_lo + 2 * (k0 + j))
            for i in range(cfg.acc_regs):
                acc[i] = d[i]
        wgmma_commit()
        wgmma_wait_a(1, [a_prev[i] for i in range(regs)])   # retires the previous batch
        for i in range(regs):
            a_prev[i] = a[i]


def _fused_epilogue(d, base, y, svh, bias, scale, bx, m0, warp, lane, cfg):
    """The output transform of the CTA's 128 columns x m_tile tokens (fused_out): D fragments
    to shared memory as fp32 rows, then per token row (warp w: rows w, w + 8, ..) the lane's
    4 columns through hadamard128_lane, * SCALE * svh * row scale + bias, one 16-byte store
    each; the arithmetic of hadamard._hadamard_out_kernel with one K-split, in its order."""
    cute.arch.sync_threads()                          # every warp is done with the stages
    for i in range(cfg.acc_regs):
        row, col = d_fragment_position(warp, lane, i)
        _st_shared_f32(base + (row * EPILOGUE_ROW_WORDS + col) * 4, d[i])
    cute.arch.sync_threads()
    col = bx * 128 + 4 * lane
    sv = [Float32(svh[col + e]) for e in range(4)]
    bv = [Float32(bias[col + e]) if cfg.biased else Float32(0.0) for e in range(4)]
    for i in range(cfg.m_tile // 8):
        row = warp + 8 * i
        v = hadamard128_lane(_ld_shared_v4_f32(base + (row * EPILOGUE_ROW_WORDS + 4 * lane) * 4),
                             lane)
        rs = scale[m0 + row]
        for e in range(4):
            y[(m0 + row) * cfg.n + col + e] = v[e] * Float32(HAD_SCALE) * sv[e] * rs + bv[e]


@cute.kernel
def _trellis_wgmma_kernel(xw: cute.Tensor, tw: cute.Tensor, out: cute.Tensor,
                          svh: cute.Tensor, bias: cute.Tensor, scale: cute.Tensor,
                          bexp: cute.Tensor, etier: cute.Tensor, eslot: cute.Tensor,
                          cfg: cutlass.Constexpr):
    geo = lane_geometry(cfg.K)
    tid, lane, warp, (bx, by, bz) = cta_thread_ids()
    tn = bx * cfg.cta_n16 + warp
    m0 = bz * cfg.m_tile
    ks0 = by * cfg.k_per_split
    chunks = cfg.chunks
    plane = 0
    writes = True
    if cutlass.const_expr(cfg.experts > 0):
        # Grouped: this block's expert picks its stack of tiles (tn's flat tile index counts
        # the stacks before it; validate keeps every word index below 2^31); a block without
        # one runs no chunks and writes zeros.
        plane = bz // cfg.m_blocks
        blk = bz % cfg.m_blocks
        expert = Int32(bexp[blk])
        if cutlass.const_expr(cfg.tier >= 0):
            # A tier's launch: its own experts' blocks, and (tier 0) the blocks of no tier
            # (no expert, or an expert in no tier: zeros); any other block is another
            # launch's, left unwritten.
            known = (expert >= 0) & (expert < cfg.global_experts)
            g_safe = cutlass.select_(known, expert, Int32(0))
            owner = cutlass.select_(known, Int32(etier[g_safe]), Int32(-1))
            mine = owner == cfg.tier
            writes = mine
            if cutlass.const_expr(cfg.tier == 0):
                writes = mine | (owner < 0) | (owner >= cfg.tier_count)
            expert = cutlass.select_(mine, Int32(eslot[g_safe]), Int32(-1))
        live = (expert >= 0) & (expert < cfg.experts)
        e_safe = cutlass.select_(live, expert, Int32(0))
        tn = (plane * cfg.experts + e_safe) * (cfg.k16 * cfg.n16) + tn
        m0 = plane * cfg.m_pad + blk * cfg.m_tile
        chunks = cutlass.select_(live, Int32(cfg.chunks), Int32(0))
    funnels = lane_funnels(geo, lane)
    smem = cutlass.memory.SmemAllocator().allocate_tensor(
        Uint32, cute.make_layout(cfg.smem_words), SWIZZLE_ATOM_BYTES)
    base = smem.iterator.toint()
    stage_bytes = cfg.stage_words * 4
    desc0 = descriptor_lo(base)                      # stage 0, step 0
    acc = cute.make_rmem_tensor((cfg.acc_regs,), Float32)
    for i in cutlass.range_constexpr(cfg.acc_regs):
        acc[i] = Float32(0.0)
    last = cfg.chunks - 1
    lead = cfg.weight_ring - 1
    slot_bytes = cfg.slot_words * 4
    ring_word = cfg.stages * cfg.stage_words + warp * cfg.weight_ring * cfg.slot_words
    ring_address = base + ring_word * 4                # this warp's weight ring

    # In flight before the loop: weights of chunks 0 .. R - 2 with chunk 0's activations (one
    # group), chunk 1's activations (the next). Past the last chunk every copy re-loads it (in
    # bounds, into stages and slots never read again).
    for j in cutlass.range_constexpr(lead):
        _copy_weights_async(tw, ks0 + cutlass.min(j, last) * K_CHUNK, tn,
                            ring_address + j * slot_bytes, lane, geo, cfg)
    for j in cutlass.range_constexpr(2):
        _copy_stage_async(xw, m0, ks0 + cutlass.min(j, last) * K_CHUNK,
                          base + j * stage_bytes, tid, cfg)
    cp_async_wait(1)
    proxy_fence_shared()
    cute.arch.sync_threads()
    a_prev = cute.make_rmem_tensor((4 * STEP_BATCH,), Uint32)     # A of the batch in flight
    for i in cutlass.range_constexpr(4 * STEP_BATCH):
        a_prev[i] = Uint32(0)
    for c in cutlass.range(chunks):
        _copy_chunks_ahead(xw, tw, c, tn, m0, ks0, ring_address, base, tid, lane, geo, cfg)
        slot_word = ring_word + (c % cfg.weight_ring) * cfg.slot_words
        _mma_chunk(acc, a_prev, _ring_weight_words(smem, slot_word, funnels, geo),
                   desc0 + (c % ACTIVATION_STAGES) * (stage_bytes >> 4), funnels, geo, cfg)
        cp_async_wait(1)                          # chunk c + 1 has landed
        proxy_fence_shared()
        cute.arch.sync_threads()
    # The last copies must land before the epilogue reuses the buffer (fused_out) and before
    # the CTA exits.
    cp_async_wait(0)

    d = wgmma_wait_acc([acc[i] for i in range(cfg.acc_regs)])
    if cutlass.const_expr(cfg.fused_out):
        _fused_epilogue(d, base, out, svh, bias, scale, bx, m0, warp, lane, cfg)
    elif cutlass.const_expr(cfg.tier >= 0):
        if writes:
            _store_partials(d, out, bx, by, m0, warp, lane, cfg)
    else:
        _store_partials(d, out, bx, by, m0, warp, lane, cfg)


def _store_partials(d, out, bx, by, m0, warp, lane, cfg):
    """The accumulators d as fp32 partials (plain Python, inlined at trace time). m0 counts the
    planes before this one (grouped), so by's partials start at by * planes * m_pad rows."""
    for i in range(cfg.acc_regs):
        row, col = d_fragment_position(warp, lane, i)
        out[(by * cfg.planes * cfg.m_pad + m0 + row) * cfg.n + bx * 16 * cfg.cta_n16
            + col] = d[i]


@cute.jit
def launch_trellis_wgmma(stream, xw: cute.Tensor, tw: cute.Tensor, svh: cute.Tensor,
                         bias: cute.Tensor, scale: cute.Tensor, out: cute.Tensor,
                         cfg: cutlass.Constexpr):
    """cutlass_call entry (dense): out is the fp32 partials [splits, m_pad, n], or with
    fused_out y [m_pad, n] (svh f16 [n], bias f16 [n] (any f16 [n] when not biased), scale f32
    [m_pad]: the input transform's row scales; unused without fused_out)."""
    _trellis_wgmma_kernel(xw, tw, out, svh, bias, scale, scale, scale, scale, cfg).launch(
        grid=cfg.grid, block=(cfg.threads, 1, 1), stream=stream)


def launch_grouped_wgmma(xw, tw, bexp, etier, eslot, out, cfg, stream):
    """The grouped kernel on ``stream`` from inside another cute.jit launch function (the MoE
    layer's): partials [splits, planes, m_pad, n] of each block's rows against its expert (with
    cfg.tier >= 0, of the blocks whose expert etier puts in that tier; one slab: etier and
    eslot are never read)."""
    _trellis_wgmma_kernel(xw, tw, out, bexp, bexp, bexp, bexp, etier, eslot, cfg).launch(
        grid=cfg.grid, block=(cfg.threads, 1, 1), stream=stream)


__all__ = ["ACTIVATION_STAGES", "ARCH", "K_CHUNK", "M_TILES",
           "MIN_WEIGHT_RING", "STEP_BATCH", "WEIGHT_RING", "WgmmaGemmConfig",
           "d_fragment_position", "descriptor_lo", "weight_piece",
           "launch_grouped_wgmma", "launch_trellis_wgmma", "stage_unit", "swizzled_word"]
