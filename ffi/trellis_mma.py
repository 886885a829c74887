"""Trellis GEMM kernel: decode EXL3 tiles in registers straight into mma.sync fragments.

    partial[s, m, n] = sum over this split's k16 tiles of  xh[m, k16 tile] @ W_hat[k16 tile, n]

xh is the already-rotated fp16 activation (x * suh, Hadamard-128), W_hat the rotated-basis weight
decoded from the native int16 trellis viewed as uint32 words (no repacking). The caller sums the
K-split partials and applies the output transform (Hadamard-128, * svh, + bias).

Why this shape of kernel:
  * The EXL3 in-tile order is the m16n8k16 fragment order, so lane l decodes t = 8l..8l+7 of a
    tile and those 8 fp16 values are its MMA registers with no shuffles. Weights take the A
    operand (16 output columns x 16 input rows; the register pairs are a permutation of the
    decoded pairs, see trellis_geometry.A_OPERAND_PAIRS) and 8 tokens take the 8-wide B operand,
    so a decode step pays one MMA per 8 tokens instead of padding tokens to 16.
  * Decode is the floor (bench/anchors.md): each tile is decoded once per CTA, by one warp,
    and reused for all the CTA's token groups (m_tile tokens).
  * The ALU pipe is the decode's bottleneck (81-83% busy for mcg on the H200), so 3inst / mcg
    with one token group run "split pairs" (MmaTiling.split_pairs): one weight per register,
    the A operand of an MMA over only the even (then the odd) k rows. The register holds the
    codebook value's two fp16 summands as the lop3 leaves them (cute_ops.decode_halves) and the
    B word holds the activation in both halves, so the MMA adds lo*x + hi*x: no PRMT to pack
    two weights (4.1 -> 3.1 ALU ops per weight at K3) and no HADD2 to sum the halves, for a
    second MMA per tile. mul1 runs split pairs too (the MMA multiplies an integer, and
    mul1_affine finishes the codebook's affine map), which drops its PRMT and HFMA2.
    Those B words come in B-fragment order from the input transform, so a lane's 4 B
    registers of a step are one 16-byte load (512 contiguous bytes per warp); row-major B costs
    8 L1 wavefronts per load (8 token rows).
  * Direct loads (dense_k_loop): each lane reads its 2 (K <= 4, 2.5), 4 (K = 3.5, 5, 6, 8) or 8
    (K = 7) ring words straight from global memory; all 32 lanes hit the same 32*K-byte tile,
    so the loads coalesce. A warp works in chunks of ``unroll`` k16 steps and issues every load
    of a chunk (weights and activations) before decoding any of it (ptxas keeps about one step
    of them in flight: 30 registers at m = 1).
  * The cp.async ring (ring_k_loop, MmaConfig.ring: one token past 2^26 weights): the same
    chunks copied by cp.async into a per-warp ring of shared-memory slots, two chunks in flight
    while one decodes from shared memory; 4-17% faster at those shapes (H100, session 24),
    slower with 2+ token groups (their B fragments fill the slots) and under a register cap.
  * The warps of a CTA share the same n16 tiles and interleave over k16 tiles; their partial sums
    are folded in shared memory, so K-splitting across CTAs (grid y) is only needed to fill the
    GPU and its fp32 partial traffic stays small.

Layout contract (flat, row-major views; all sizes static at compile time):
  xw:  uint32 [m_pad, k/2]        fp16 pairs of xh (row-major), or with split pairs
       uint32 [m_pad * k]          one fp16 per word, in both halves, in B-fragment order
                                  (trellis_geometry.b_fragment_slot); m_pad = m_blocks * m_tile,
                                  zero padded rows; with one_token (m = 1) only row 0 is read:
       uint32 [k]                  split pairs, trellis_geometry.token_fragment_word order
  tw:  uint32 [k/16, n/16, W/2]   the trellis words (int16 pairs, little endian)
  out: float32 [splits, m_pad, n] partial sums (padded rows too: they are zero, or copies of row
                                  0 with one_token; keeping m out of the compile key lets m =
                                  2..8 share one binary)
A linear group (``_trellis_mma_group_kernel``, MmaConfig.members = (n_0, .., n_{G-1})) takes G
trellis tensors tw_i [k/16, n_i/16, W/2] and the words of the [m_pad, G * k] activation whose
row segment i is x rotated by member i's suh; out has n = sum(n_i) columns, member i's after
those of members < i.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int64, Uint32

from exl3_jax.trellis.codebook import MUL1_K_BIAS, MUL1_K_INV, MUL1_RESIDUAL

from .cute_ops import (LOP3_CODEBOOKS, bytesum_ones, cp_async_16, cp_async_commit,
                       cp_async_wait, cta_thread_ids, decode_words, decode_words_split,
                       half_in_both, inline_ptx, lane_funnels, lane_pieces, lane_states,
                       load_shared_words_v2, load_shared_words_v4, load_tile_words,
                       load_words_v2, load_words_v4, mma_m16n8k16_f16_f32,
                       mul1_bytesum_operand)
from .trellis_geometry import (A_OPERAND_PAIRS, B_REGS, LANES, P_REGS, KSplitShape,
                               b_fragment_word, lane_geometry, pair_fragment_word,
                               token_fragment_word)

MAX_MEMBERS = 3        # linears per group kernel (q/k/v); the kernel takes this many trellis args
RING_SMEM_BYTES = 96 * 1024   # a ring larger than this would leave fewer than 2 CTAs per SM


def member_tile_ranges(ns) -> tuple:
    """(first n16 tile, n16 tiles) of each of the output widths ``ns`` laid side by side."""
    starts = [0]
    for n in ns:
        starts.append(starts[-1] + n // 16)
    return tuple((starts[i], n // 16) for i, n in enumerate(ns))


def check_group_members(members, n: int) -> None:
    """A linear group: 2..MAX_MEMBERS members whose widths sum to n."""
    if not 2 <= len(members) <= MAX_MEMBERS or sum(members) != n:
        raise ValueError(f"a linear group needs 2..{MAX_MEMBERS} members summing to "
                         f"n={n}, got {members}")


class MmaTiling(KSplitShape):
    """Derived sizes and tiling checks shared by the dense (MmaConfig) and grouped MoE
    (trellis_moe.GroupedMmaConfig) kernel configs; needs fields k, n, m_tile, n_tiles, warps,
    splits, unroll."""

    one_token = False     # MmaConfig's field; the other configs always read their own rows
    pair_fragments = False  # MmaConfig's field: packed kernels of 2+ token groups read "pairs"

    @property
    def m_groups(self) -> int:
        return self.m_tile // 8

    @property
    def x_k16(self) -> int:
        """k16 steps per row of the activation words (a linear group reads one row segment of
        k per member, MmaConfig.members)."""
        return self.k16

    @property
    def threads(self) -> int:
        return 32 * self.warps

    # mul1 split pairs need the affine epilogue (mul1_affine) that only the dense kernels apply.
    mul1_split = False
    mul1_bytesum = False  # MmaConfig's field: mul1 through the byte-sum MMA (cute_ops)
    # K = 4 states by LaneGeometry.nibble_plan (3.4% fewer instructions, 3 of 11 extraction ops
    # moved off the ALU pipe). Session 28, H100, against the session-27 tree, mcg K4 (us, two
    # runs each): the MoE layer (Qwen3-30B-A3B) m = 1 24.7 -> 23.8, m = 4 60.0 -> 57.6; the
    # dense ring kernel 8192x28672 m = 1 63.4 / 63.5 -> 63.8 / 63.8, m = 16 89.6 / 89.9 ->
    # 90.5 / 90.6 (4096x14336 m = 16 -2%); the row linear (4096x14336 m = 1) 23.7 / 23.7 -> 25.7
    # / 25.0. So the grouped MoE kernels take it and the others keep ``extraction``.
    nibble_extraction = False
    split_groups = 1    # MmaConfig's field: token groups up to which the kernel splits pairs

    @property
    def split_pairs(self) -> bool:
        """One weight per A register (cute_ops.decode_halves) and two MMAs per tile and token
        group: up to ``split_groups`` token groups (at least one). For 3inst / mcg that
        trades the two PRMTs per weight pair of packing (ALU pipe, the bottleneck there) and
        the HADD2 that sums the codebook's halves for a second MMA (the tensor pipe is mostly
        idle): -8% (K3) and -10% (K4) at 8192x28672 m=1 on the H200. mul1 (where
        ``mul1_split``) drops the PRMT and the HFMA2 per weight pair for the affine epilogue
        (mul1_affine: one more MMA per k16 step and token group sums the group's x; 2+ groups
        only where EXL3_JAX_SPLIT_GROUPS says: slower at m = 16, session 26). With 2 token
        groups split pairs measured +20% at m=16 (session 11, before the leaner decodes);
        with today's decodes 3 groups ran 9-12% faster than packed pairs at K4 m = 16 and tied
        at K3 (session 23, H100; K4 mcg per 4 tiles: 92 -> 60 ALU ops, 60 -> 72 registers), so
        3inst / mcg at K4 take them up to 3 groups (trellis_gemm.SPLIT_GROUPS_BY_K)."""
        groups = self.m_groups <= max(1, self.split_groups)
        if self.codebook in LOP3_CODEBOOKS:
            return groups
        return self.codebook == "mul1" and self.mul1_split and groups and not self.bytesum

    @property
    def reads_one_token(self) -> bool:
        """Whether every lane reads one token's activation words (layout "token", or "quads"
        with one_token): one row of them, and the padding tokens' columns copy token 0's."""
        return self.x_layout == "token" or (self.x_layout == "quads" and self.one_token)

    @property
    def bytesum(self) -> bool:
        """mul1 decoded by the byte-sum MMA (cute_ops.mul1_bytesum_operand): one packed f16
        MMA per tile and token group of h = 1024 + bytesum, mul1_affine finishing the map."""
        return self.codebook == "mul1" and self.mul1_bytesum

    @property
    def x_layout(self) -> str:
        """How xw is laid out: B-fragment order with split pairs (one 16-byte load per lane
        and k16 step, no ALU work; "token" for one token: the same from one token's words,
        trellis_geometry.token_fragment_word), else row-major fp16 pairs (the grouped
        MoE kernel overrides it: always rows), or with ``pair_fragments`` and 2+ token groups
        packed pairs in B-fragment order ("pairs"). Measured on the H200 (session 12): packed
        pairs from B-fragment order took 3-8 more registers, which cost a CTA per SM and made
        8192x28672 K3 mul1 m=1 18% slower; with 2+ token groups, where row-major loads touch
        8 lines per warp load, "pairs" ran 0-15% faster (m = 16, H100, session 26). The
        byte-sum mul1 kernels read "quads" (trellis_geometry.quad_fragment_index: each token
        group's k16 step its 8 rows' 16 values back to back, one 8-byte load per lane; one
        token: its row)."""
        if self.bytesum:
            return "quads"
        if not self.split_pairs:
            return "pairs" if self.pair_fragments and self.m_groups > 1 else "rows"
        return "token" if self.one_token else "fragments"

    @property
    def acc_regs(self) -> int:
        """fp32 accumulators per lane."""
        return self.m_groups * self.n_tiles * 4

    def check_tiling(self) -> None:
        """k, n multiples of 128; n16 / k16 divisible by n_tiles / splits; each split's k16
        tiles a whole number of chunks (warps * unroll)."""
        if self.k % 128 or self.n % 128:
            raise ValueError(f"k={self.k}, n={self.n} must be multiples of 128")
        if self.n16 % self.n_tiles:
            raise ValueError(f"n16={self.n16} is not a multiple of n_tiles={self.n_tiles}")
        if self.k16 % self.splits:
            raise ValueError(f"k16={self.k16} is not a multiple of splits={self.splits}")
        if self.k_per_split % (self.warps * self.unroll):
            raise ValueError(f"k16 per split {self.k_per_split} is not a multiple of "
                             f"warps*unroll={self.warps * self.unroll}")


@dataclasses.dataclass(frozen=True)
class MmaConfig(MmaTiling):
    """Every compile-time parameter of one Trellis GEMM instance."""
    mul1_split = True      # dense_k_loop applies mul1_affine (a class attribute, not a field)
    codebook: str
    K: float
    m_blocks: int          # CTA token tiles (grid z); m_pad = m_blocks * m_tile
    k: int
    n: int
    m_tile: int = 8        # tokens per CTA (multiple of 8, <= 32): one B fragment per 8 tokens
    n_tiles: int = 2       # n16 tiles per warp (independent decode chains)
    warps: int = 8         # warps per CTA, interleaved over k16 tiles
    splits: int = 1        # K-splits across CTAs (grid y)
    unroll: int = 4        # k16 steps per chunk whose loads are issued together
    min_ctas: int = 0      # CTAs per SM ptxas must fit (a register cap, nvvm.minctasm); 0 = none
    # A linear group (linears reading the same x, e.g. q/k/v): the n of each member, summing to
    # n. Member i's columns come from its own trellis tensor and read x rotated by its own suh
    # (activation row segment i); () for one linear.
    members: tuple = ()
    # m = 1: the padding tokens' lanes read token 0's activation words (x_base_word, layout
    # "token": one 16-byte word per lane and k16 step), so a warp's B load touches one token's
    # bytes instead of 8 rows' (8x less L1/L2 traffic). The padding rows of the partials are
    # then copies of row 0, which nothing reads.
    one_token: bool = False
    # Packed kernels (2+ token groups) read their B registers in the "pairs" layout
    # (trellis_geometry.pair_fragment_word: one 128-byte line per warp load) instead of
    # row-major pairs (8 token rows' lines per load): H100, session 26, m = 16 against rows:
    # mul1 K4 -15 / -12% (8192x28672 / 4096x14336), K3 -5 / -6%, mcg K3 -1 / 0%; the same
    # instructions, fewer sectors per load. trellis_gemm passes True unless
    # EXL3_JAX_PAIR_FRAGMENTS=0.
    pair_fragments: bool = False
    # Kernels of up to this many token groups run split pairs (MmaTiling.split_pairs;
    # trellis_gemm._split_groups picks it by codebook and K, EXL3_JAX_SPLIT_GROUPS overrides).
    split_groups: int = 1
    # mul1 through the byte-sum MMA (cute_ops.mul1_bytesum_operand, layout "quads") instead of
    # split or packed pairs; trellis_gemm passes EXL3_JAX_MUL1_BYTESUM.
    mul1_bytesum: bool = False
    # Chunk slots of each warp's cp.async ring in shared memory (ring_k_loop; 0: every lane
    # loads its words straight from global memory, dense_k_loop). B words in a fragment order
    # ("token", "fragments", "pairs", "quads"), not row-major pairs.
    ring: int = 0

    @property
    def x_k16(self) -> int:
        return self.k16 * max(1, len(self.members))

    @property
    def member_tiles(self) -> tuple:
        """(first n16 tile, n16 tiles) of each member in the output columns."""
        return member_tile_ranges(self.members)

    @property
    def m_pad(self) -> int:
        return self.m_blocks * self.m_tile

    @property
    def grid(self) -> tuple[int, int, int]:
        return (self.n16 // self.n_tiles, self.splits, self.m_blocks)

    @property
    def warp_chunks(self) -> int:
        """Chunks (``unroll`` k16 steps each) per warp and K-split."""
        return self.k_per_split // (self.warps * self.unroll)

    @property
    def x_step_words(self) -> int:
        """Activation words per k16 step and token group in the ring's layouts: one token's 4
        lanes x 4 registers ("token"), 32 lanes x 4 ("fragments") or x 2 ("pairs", "quads";
        "quads" of one token: its 8 words)."""
        if self.x_layout == "quads":
            return 8 if self.one_token else 64
        return {"token": 4 * B_REGS, "pairs": LANES * P_REGS}.get(self.x_layout,
                                                                  LANES * B_REGS)

    @property
    def ring_weight_words(self) -> int:
        """Weight words of one ring slot: the chunk's unroll x n_tiles tiles back to back."""
        return self.unroll * self.n_tiles * lane_geometry(self.K).words

    @property
    def ring_slot_words(self) -> int:
        """Words of one ring slot: the chunk's weights, then its activation words (token group
        g's unroll steps of x_step_words each)."""
        return self.ring_weight_words + self.m_groups * self.unroll * self.x_step_words

    @property
    def ring_layout_ok(self) -> bool:
        """Whether ring_k_loop serves this kernel: B words in a fragment order, each token
        group's steps contiguous (not row-major pairs)."""
        return self.x_layout in ("token", "fragments", "pairs", "quads")

    @property
    def ring_words(self) -> int:
        return self.warps * self.ring * self.ring_slot_words

    @property
    def ring_bytes(self) -> int:
        """Shared memory of the ring kernel: the ring, whose bytes the warps' fold reuses."""
        return 4 * max(self.ring_words, self.warps * self.acc_regs * 32)

    def validate(self) -> "MmaConfig":
        if self.m_tile % 8 or not 8 <= self.m_tile <= 32:
            raise ValueError(f"m_tile {self.m_tile} must be 8, 16, 24 or 32")
        if self.one_token and (self.m_pad != 8 or self.x_layout not in ("token", "quads")):
            raise ValueError(f"one_token needs one token tile of 8 rows (split pairs or the "
                             f"byte-sum mul1), got m_pad={self.m_pad}, layout "
                             f"{self.x_layout!r}")
        self.check_tiling()
        if self.ring:
            if self.ring < 2 or not self.ring_layout_ok:
                raise ValueError(f"a cp.async ring needs >= 2 slots and B words in a "
                                 f"fragment order, got ring={self.ring}, layout "
                                 f"{self.x_layout!r}")
            if self.ring_bytes > RING_SMEM_BYTES:
                raise ValueError(f"ring of {self.ring} slots x {self.ring_slot_words} words x "
                                 f"{self.warps} warps exceeds {RING_SMEM_BYTES} bytes of "
                                 f"shared memory")
        if self.members:
            check_group_members(self.members, self.n)
            if any(n % (16 * self.n_tiles) for n in self.members):
                raise ValueError(f"every member's n must be a multiple of 16 * n_tiles="
                                 f"{16 * self.n_tiles}, got {self.members}")
        words = self.k16 * self.n16 * lane_geometry(self.K).words
        if max(words, self.m_pad * self.x_k16 * 8, self.splits * self.m_pad * self.n) >= 2**31:
            raise ValueError("tensor too large for 32-bit indexing")
        return self


def load_chunk(xw, tw, c0, tile0, x_base, funnels, geo, cfg, n16=None):
    """Issue this lane's loads for the ``cfg.unroll`` k16 steps starting at tile row c0:
    weight words of tiles (kt, tile0 + j) for j < n_tiles (tile index kt * n16 + tile0 + j in
    the flat tile sequence of ``tw``, n16 = ``cfg.n16`` unless given (a group member's own);
    tile0 may include an expert's offset) and the B fragments of every token group.

    B fragments by ``cfg.x_layout``:
      * "fragments" (dense kernel, split pairs): x_base is ``b_fragment_word(G0, kt0, 0,
        lane, x_k16)`` of the CTA's first token group (kt0: the member's row segment); a
        lane's 4 words are one 16-byte load, 512 contiguous bytes per warp
        (trellis_geometry.b_fragment_slot).
      * "pairs" (packed kernels with ``pair_fragments``): x_base is ``pair_fragment_word(G0,
        kt0, 0, lane, x_k16)``; 2 words per lane, each load 128 contiguous bytes per warp.
      * "rows": x_base is the lane's word in row-major fp16 pairs, x_base + 8 g (x_k16 * 8) +
        8 kt and + 4; with ``split_pairs`` (grouped MoE kernel) each fp16 is copied into both
        halves of its register (one byte permute per register).
    Returns (wbuf [unroll * n_tiles], bfrag [unroll * m_groups] of per-MMA (b0, b1) pairs).
    Shared by the dense and the grouped (MoE) kernels; plain Python, inlined at trace time."""
    wbuf = []
    bfrag = []
    for u in range(cfg.unroll):
        wbuf += _tile_row_words(tw, c0 + u, tile0, funnels, geo, cfg, n16)
        bfrag += fragments_of_words(_row_words(xw, c0, u, x_base, cfg), cfg)
    return wbuf, bfrag


def load_chunk_weights(tw, c0, tile0, funnels, geo, cfg, n16=None):
    """load_chunk's weight words alone (wbuf): issued before a programmatic-dependent kernel
    waits for its activations, since the weights are the layer's own."""
    return [w for u in range(cfg.unroll)
            for w in _tile_row_words(tw, c0 + u, tile0, funnels, geo, cfg, n16)]


def load_chunk_x_words(xw, c0, x_base, cfg, keep=None, lanes: int = 32, shared: bool = False):
    """load_chunk's activation words alone, raw (fragments_of_words makes bfrag of them);
    keep: a predicate, False zeroes every word (a chunk this warp does not own adds 0);
    lanes, shared: see _row_words."""
    words = [w for u in range(cfg.unroll)
             for w in _row_words(xw, c0, u, x_base, cfg, lanes, shared)]
    if keep is not None:
        words = [cutlass.select_(keep, w, Uint32(0)) for w in words]
    return words


def _x_words_per_group(cfg) -> int:
    """Activation words per lane, token group and k16 step: the B fragment's registers, or a
    row-major word pair."""
    return P_REGS if cfg.x_layout in ("rows", "pairs", "quads") else B_REGS


def fragments_of_words(words, cfg):
    """bfrag (see load_chunk) of the raw words of load_chunk_x_words."""
    per = _x_words_per_group(cfg)
    out = []
    for i in range(0, len(words), per):
        w = words[i:i + per]
        if cfg.x_layout in ("fragments", "token"):
            out.append(((w[0], w[1]), (w[2], w[3])))
        elif cfg.split_pairs:
            out.append(((half_in_both(w[0], False), half_in_both(w[1], False)),
                        (half_in_both(w[0], True), half_in_both(w[1], True))))
        else:
            out.append(((w[0], w[1]),))
    return out


def chunk_registers(geo, cfg):
    """Register tensors (wreg, xreg) that hold one chunk's loads (weight words, raw activation
    words) across iterations of a dynamic k loop, so the loop can issue chunk c + 1's loads
    before decoding chunk c (software pipelining: the loads' latency overlaps the decode and
    the MMAs). Tensors, not Python objects: the DSL carries them through the loop."""
    nw = cfg.unroll * cfg.n_tiles * geo.groups * 2
    nx = cfg.unroll * cfg.m_groups * _x_words_per_group(cfg)
    return cute.make_rmem_tensor((nw,), Uint32), cute.make_rmem_tensor((nx,), Uint32)


def store_chunk(wreg, xreg, wbuf, xwords):
    """Hold a chunk's loads (load_chunk_weights, load_chunk_x_words) in chunk_registers."""
    for i, v in enumerate(v for tile in wbuf for pair in tile for v in pair):
        wreg[i] = v
    for i, v in enumerate(xwords):
        xreg[i] = v


def chunk_operands(wreg, xreg, geo, cfg):
    """(wbuf, bfrag) of the chunk held in chunk_registers, as load_chunk returns them."""
    g = geo.groups
    tiles = cfg.unroll * cfg.n_tiles
    wbuf = [[(wreg[(t * g + q) * 2], wreg[(t * g + q) * 2 + 1]) for q in range(g)]
            for t in range(tiles)]
    return wbuf, fragments_of_words([xreg[i] for i in range(xreg.shape[0])], cfg)


def _tile_row_words(tw, kt, tile0, funnels, geo, cfg, n16):
    """Weight words of tiles (kt, tile0 + j), j < n_tiles."""
    n16 = cfg.n16 if n16 is None else n16
    return [load_tile_words(tw, (kt * n16 + tile0 + j) * geo.words, funnels, geo)
            for j in range(cfg.n_tiles)]


def _row_words(xw, c0, u, x_base, cfg, lanes: int = 32, shared: bool = False):
    """Raw activation words of k16 step kt = c0 + u for every token group (see load_chunk;
    u: the unrolled step, a compile-time int, an immediate offset of 16-byte loads). lanes: 32
    for the B-fragment order in global memory (one 16-byte load per lane), or 4 for one
    token's row in the row linear's shared memory (trellis_geometry.row_fragment_slot: lanes
    4..31 read lanes 0..3's words, one 32-bit load per register). shared: the "token" layout
    read from shared memory (the MoE FC1's rotated row) instead of global."""
    kt = c0 + u
    kw = cfg.x_k16 * 8
    words = []
    for g in range(cfg.m_groups):
        if cfg.x_layout == "token":
            load = load_shared_words_v4 if shared else load_words_v4
            words += load(xw, x_base + c0 * 16, 16 * u)
        elif cfg.x_layout == "fragments" and lanes == LANES:
            words += load_words_v4(xw, x_base + (g * cfg.x_k16 + c0) * B_REGS * LANES,
                                   B_REGS * LANES * u)
        elif cfg.x_layout == "fragments":
            w0 = x_base + (g * cfg.x_k16 + kt) * B_REGS * lanes
            words += [Uint32(xw[w0 + lanes * i]) for i in range(B_REGS)]
        elif cfg.x_layout == "pairs":
            w0 = x_base + (g * cfg.x_k16 + kt) * P_REGS * LANES
            words += [xw[w0 + LANES * i] for i in range(P_REGS)]
        elif cfg.x_layout == "quads":
            words += load_words_v2(xw, x_base + (g * cfg.x_k16 + c0) * cfg.x_step_words,
                                   cfg.x_step_words * u)
        else:
            base = x_base + g * 8 * kw + kt * 8
            words += [xw[base], xw[base + 4]]
    return words


def mma_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum=None):
    """Decode the chunk's tiles and accumulate acc[(g * n_tiles + j) * 4 + r] += W^T x: one
    m16n8k16 MMA per tile and token group with weights packed two per register, or two MMAs
    with ``cfg.split_pairs`` (even-k weights, then odd-k weights, each weight's register
    against B words holding each activation in both halves). xsum (mul1 split pairs): also
    accumulate the sums of x, one MMA per k16 step and token group of that group's B words as
    the A operand against B = ones (see mul1_affine)."""
    if cfg.bytesum:
        _bytesum_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum)
        return
    for u in range(cfg.unroll):
        if xsum is not None:
            for g in range(cfg.m_groups):
                (b0, b1), (b2, b3) = bfrag[u * cfg.m_groups + g]
                c = mma_m16n8k16_f16_f32([b0, b1, b2, b3], [Uint32(0x3C003C00)] * 2,
                                         [xsum[4 * g + r] for r in range(4)])
                for r in range(4):
                    xsum[4 * g + r] = c[r]
        for j in range(cfg.n_tiles):
            words = wbuf[u * cfg.n_tiles + j]
            if cfg.split_pairs:
                e = decode_words_split(words, funnels, geo, cfg.codebook,
                                       cfg.nibble_extraction)
                alist = [[e[p[half]] for p in A_OPERAND_PAIRS] for half in (0, 1)]
            else:
                h = decode_words(words, funnels, geo, cfg.codebook, cfg.nibble_extraction)
                alist = [[h[p[0] // 2] for p in A_OPERAND_PAIRS]]
            for g in range(cfg.m_groups):
                i0 = (g * cfg.n_tiles + j) * 4
                c = [acc[i0], acc[i0 + 1], acc[i0 + 2], acc[i0 + 3]]
                for a, b in zip(alist, bfrag[u * cfg.m_groups + g]):
                    c = mma_m16n8k16_f16_f32(a, b, c)
                for r in range(4):
                    acc[i0 + r] = c[r]


def _bytesum_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum):
    """mma_chunk of the byte-sum mul1 kernels: per tile the byte-sum operand
    (cute_ops.mul1_bytesum_operand) against each token group's "quads" B pair; the sums of x
    one MMA per two k16 steps and token group (the steps' B pairs as A rows against ones)."""
    ones = bytesum_ones(cute.arch.lane_idx())     # loop-invariant: left to ptxas to hoist
    zero = Uint32(0)
    for u in range(0, cfg.unroll, 2):
        for g in range(cfg.m_groups):
            a = list(bfrag[u * cfg.m_groups + g][0])
            a += list(bfrag[(u + 1) * cfg.m_groups + g][0]) if u + 1 < cfg.unroll else [zero] * 2
            c = mma_m16n8k16_f16_f32(a, [Uint32(0x3C003C00)] * 2,
                                     [xsum[4 * g + r] for r in range(4)])
            for r in range(4):
                xsum[4 * g + r] = c[r]
    for u in range(cfg.unroll):
        for j in range(cfg.n_tiles):
            states = lane_states(wbuf[u * cfg.n_tiles + j], funnels, geo, fma_pipe=True,
                                 byte_windows=True, nibbles=True)
            a = mul1_bytesum_operand(states, ones)
            for g in range(cfg.m_groups):
                i0 = (g * cfg.n_tiles + j) * 4
                c = mma_m16n8k16_f16_f32(a, bfrag[u * cfg.m_groups + g][0],
                                         [acc[i0 + r] for r in range(4)])
                for r in range(4):
                    acc[i0 + r] = c[r]


def mul1_sums(cfg):
    """mma_chunk's xsum: 4 fp32 zeros per token group where the kernel runs mul1 split pairs
    or the byte-sum MMA, else None."""
    if not (cfg.codebook == "mul1" and (cfg.split_pairs or cfg.bytesum)):
        return None
    xsum = cute.make_rmem_tensor((4 * cfg.m_groups,), Float32)
    for i in range(4 * cfg.m_groups):
        xsum[i] = Float32(0.0)
    return xsum


def mul1_affine(acc, xsum, cfg):
    """The mul1 split-pair epilogue (nothing where xsum is None): acc holds
    sum (h - MUL1_CENTER) * x (cute_ops.decode_halves) -> k_inv * acc + MUL1_RESIDUAL * sum(x),
    the codebook values' product, in place (before any fold: it is linear). xsum holds, per
    token group g, mma_chunk's D fragment of the group's x words (as A) times ones: token
    tau's sum, twice, split over rows tau and tau + 8, so lane 4 tau + t holds it as
    xsum[4g] + xsum[4g + 2]; the group's acc columns 2t, 2t + 1 (lane 4r + t) take it from
    lanes 8t and 8t + 4 (one token: every lane holds token 0's). The byte-sum kernels
    (cfg.bytesum) multiply h itself, uncentred: k_inv * acc + k_bias * sum(x), their x words
    packed pairs (the sum once, not twice). Plain Python inlined at trace time."""
    if xsum is None:
        return
    group_regs = cfg.n_tiles * 4
    lane = None if cfg.reads_one_token else cute.arch.lane_idx()
    bias = float(MUL1_K_BIAS) if cfg.bytesum else 0.5 * float(MUL1_RESIDUAL)
    for g in range(cfg.m_groups):
        own = (xsum[4 * g] + xsum[4 * g + 2]) * Float32(bias)
        sums = [own, own]
        if lane is not None:
            sums = [cute.arch.shuffle_sync(own, offset=8 * (lane % 4) + 4 * h)
                    for h in (0, 1)]
        for i in range(g * group_regs, (g + 1) * group_regs):
            acc[i] = acc[i] * Float32(float(MUL1_K_INV)) + sums[i % 2]


def zero_accumulators(cfg):
    """This thread's fp32 MMA accumulators, acc_regs registers, all 0 (plain Python inlined at
    trace time, hence ``range``: the DSL preprocessor rewrites only the kernels)."""
    acc = cute.make_rmem_tensor((cfg.acc_regs,), Float32)
    for i in range(cfg.acc_regs):
        acc[i] = Float32(0.0)
    return acc


def fold_warp_partials(acc, warp, lane, cfg, reuse=None):
    """Write this warp's accumulators to shared memory, red[(w * acc_regs + i) * 32 + lane],
    and barrier; returns red (fp32 [warps * acc_regs * 32]). The warps' sums are then read back
    by ``summed_fragment``. ``reuse``: a shared uint32 tensor at least that large that the CTA
    is done with (the decode ring), taken after a barrier instead of more shared memory.
    Plain Python inlined at trace time (so plain ``range``: the DSL preprocessor does not
    rewrite helpers)."""
    nacc = cfg.acc_regs
    if reuse is None:
        smem = cutlass.memory.SmemAllocator()
        red = smem.allocate_tensor(Float32, cute.make_layout(cfg.warps * nacc * 32), 16)
    else:
        cute.arch.sync_threads()              # every warp has read its last ring slot
        red = cute.recast_tensor(reuse, Float32)
    for i in range(nacc):
        red[(warp * nacc + i) * 32 + lane] = acc[i]
    cute.arch.sync_threads()
    return red


def summed_fragment(red, idx, tn0, tok0, cfg):
    """Element idx (< acc_regs * 32: register idx // 32 of lane idx % 32) of the D fragments
    summed over the warps: (total, token tok0 + t, output column). D fragment (16 output columns
    x 8 tokens): regs (0,1) at column lane//4, tokens 2(lane%4) + (0,1); regs (2,3) at column
    lane//4 + 8."""
    nacc = cfg.acc_regs
    i = idx // 32
    src_lane = idx % 32
    total = Float32(0.0)
    for w in range(cfg.warps):
        total = total + red[(w * nacc + i) * 32 + src_lane]
    r = i % 4
    j = (i // 4) % cfg.n_tiles
    g = i // (4 * cfg.n_tiles)
    col = (tn0 + j) * 16 + src_lane // 4 + 8 * (r // 2)
    tok = tok0 + g * 8 + 2 * (src_lane % 4) + r % 2
    return total, tok, col


def launch_bounds(min_ctas: int) -> dict:
    """Launch options asking ptxas to fit ``min_ctas`` CTAs per SM (it caps the registers per
    thread accordingly, spilling if it must); {} for no cap. The carveout is given explicitly
    (-1, the driver's default) because the DSL otherwise queries the device's shared memory
    size at compile time, which fails in CPU-only (compile-only) processes."""
    if not min_ctas:
        return {}
    return dict(min_blocks_per_mp=min_ctas, preferred_smem_carveout=-1)


def _quad_lane_word(lane, cfg):
    """The lane's first word of a "quads" step block: its pair 2 lane, 2 lane + 1 (one token:
    lane t % 4's, of the token's row)."""
    return 2 * (lane % 4 if cfg.one_token else lane)


def x_base_word(m0, kt0, lane, cfg):
    """The lane's first activation word (load_chunk) for the CTA's token tile m0 and the row
    segment starting at k16 step kt0: B-fragment order, one token's fragments (lane % 4's) or
    row-major fp16 pairs (token m0 + 8g + lane//4; k pairs (lane%4) and (lane%4 + 4)), or
    "quads" (words 2 lane, 2 lane + 1 of the step's block; one token: 2 (lane % 4), + 1)."""
    if cfg.x_layout == "quads":
        return x_block_word(m0, kt0, cfg) + _quad_lane_word(lane, cfg)
    if cfg.x_layout == "token":
        return token_fragment_word(kt0 * 16) + (lane % 4) * B_REGS
    if cfg.x_layout == "fragments":
        return b_fragment_word(m0 // 8, kt0, 0, lane, cfg.x_k16)
    if cfg.x_layout == "pairs":
        return pair_fragment_word(m0 // 8, kt0, 0, lane, cfg.x_k16)
    return (m0 + lane // 4) * (cfg.x_k16 * 8) + kt0 * 8 + lane % 4


@cute.jit
def dense_k_loop(xw, tw, tile0, x_base, k0, warp, acc, funnels: list, cfg: cutlass.Constexpr,
                 n16: cutlass.Constexpr = None):
    """This warp's chunks of the split starting at k16 step k0 into acc: chunk c covers k16
    steps k0 + (c * warps + warp) * unroll + u, u < unroll; each chunk's loads are issued
    before any of it is decoded. (A software-pipelined loop, chunk c + 1's loads in flight
    while chunk c decodes, took 2-4x the registers and was no faster at m = 1: session 16;
    the chunk's weights copied by cp.async into shared memory, all in flight at once, were
    no faster either: session 20, bench/NOTES.md; ring_k_loop streams them through a ring of
    slots instead, several chunks per warp, which paid at one token past 2^26 weights.)"""
    geo = lane_geometry(cfg.K)
    step = cfg.warps * cfg.unroll
    xsum = mul1_sums(cfg)
    for c0 in cutlass.range(k0 + warp * cfg.unroll, k0 + cfg.k_per_split, step):
        wbuf, bfrag = load_chunk(xw, tw, c0, tile0, x_base, funnels, geo, cfg, n16)
        mma_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum)
    mul1_affine(acc, xsum, cfg)


def copy_ring_chunk(xw, tw, c0, tile0, x0, slot_address, lane, geo, cfg, n16):
    """This lane's cp.asyncs of the chunk at k16 step c0 into the ring slot at shared byte
    address slot_address (ring_k_loop): the warp's unroll x n_tiles weight tiles (row kt = c0 +
    u holds tiles tile0 .. tile0 + n_tiles - 1 back to back in global memory: one contiguous
    run per row) as piece p -> slot byte 16 p, then the activation words of every token group
    (x0: word of token group 0 at the linear's first k16 step (a group member's row segment);
    group g's chunk is unroll * x_step_words words from x0 + (g * x_k16 + c0) * x_step_words;
    n16: the linear's n16 tiles, a group member's own). The pieces split over the lanes as
    lane_pieces does. Joins the caller's cp.async group. Plain Python inlined at trace time."""
    w_src = tw.iterator.toint()
    x_src = xw.iterator.toint()
    row = cfg.n_tiles * geo.words // 4            # pieces per k16 row
    for p in lane_pieces(lane, cfg.unroll * row):
        u, q = p // row, p % row
        cp_async_16(slot_address + p * 16,
                    w_src + Int64(((c0 + u) * n16 + tile0) * geo.words + 4 * q) * 4)
    group = cfg.unroll * cfg.x_step_words // 4     # pieces per token group
    x_address = slot_address + cfg.ring_weight_words * 4
    for p in lane_pieces(lane, cfg.m_groups * group):
        g, q = p // group, p % group
        cp_async_16(x_address + p * 16,
                    x_src + Int64(x0 + (g * cfg.x_k16 + c0) * cfg.x_step_words + 4 * q) * 4)


def ring_chunk_operands(ring, slot_word, lane, funnels, geo, cfg):
    """(wbuf, bfrag) of the chunk in the ring slot at word slot_word of ``ring`` (the shared
    buffer), as load_chunk returns them: each tile's words by ``load_tile_words``' funnels,
    each step's B registers one 16-byte shared load (lane t % 4's of one token, or the lane's
    own of the token group's fragment block), or with "pairs" two 32-bit loads (register i
    of the step's block at word 32 i + lane), or with "quads" one 8-byte load of the lane's
    pair of words (one token: lane t % 4's)."""
    wbuf = [load_tile_words(ring, slot_word + t * geo.words, funnels, geo)
            for t in range(cfg.unroll * cfg.n_tiles)]
    if cfg.x_layout == "pairs":
        lane_word = lane
    elif cfg.x_layout == "token":
        lane_word = (lane % 4) * B_REGS
    elif cfg.x_layout == "quads":
        lane_word = _quad_lane_word(lane, cfg)
    else:
        lane_word = lane * B_REGS
    x_word = slot_word + cfg.ring_weight_words + lane_word
    per = _x_words_per_group(cfg)
    words = []
    for g in range(cfg.m_groups):
        for u in range(cfg.unroll):
            step = (g * cfg.unroll + u) * cfg.x_step_words      # a compile-time offset
            if cfg.x_layout == "pairs":
                words += [Uint32(ring[x_word + step + LANES * i]) for i in range(P_REGS)]
            elif cfg.x_layout == "quads":
                words += load_shared_words_v2(ring, x_word, step)
            else:
                words += load_shared_words_v4(ring, x_word, step)
    # fragments_of_words takes the words step-major with the groups inside each step
    order = [(g * cfg.unroll + u) * per + r for u in range(cfg.unroll)
             for g in range(cfg.m_groups) for r in range(per)]
    return wbuf, fragments_of_words([words[i] for i in order], cfg)


def x_block_word(m0, kt0, cfg):
    """x0 of copy_ring_chunk: the word of the CTA's token group 0 at k16 step kt0 (a group
    member's row segment starts at kt0 = i * k16)."""
    if cfg.x_layout == "token":
        return token_fragment_word(kt0 * 16)
    if cfg.x_layout == "quads":
        return ((0 if cfg.one_token else m0 // 8) * cfg.x_k16 + kt0) * cfg.x_step_words
    if cfg.x_layout == "pairs":
        return pair_fragment_word(m0 // 8, kt0, 0, 0, cfg.x_k16)
    return b_fragment_word(m0 // 8, kt0, 0, 0, cfg.x_k16)


@cute.jit
def ring_k_loop(xw, tw, ring, tile0, x0, k0, warp, lane, acc, funnels: list,
                cfg: cutlass.Constexpr, n16: cutlass.Constexpr = None):
    """dense_k_loop's chunks (the same k16 steps per warp, in the same order, so the sums are
    bit for bit the same) with every load moved into a cp.async ring of cfg.ring slots per
    warp (``ring``: the CTA's shared buffer, ring_words words; this warp's slots at word
    warp * ring * ring_slot_words): chunks c + 1 .. c + R - 1 are in flight while chunk c is
    decoded from shared memory. The copies of chunk c + R - 1 go into the slot that chunk
    c - 1 was read from, after a warp barrier that follows every lane's reads of it and
    publishes chunk c's landed copies to the whole warp (cp.async.wait_group makes them
    visible to the issuing lane only). Past the last chunk the copies re-load it (in bounds,
    into slots never read again). n16: as dense_k_loop's."""
    geo = lane_geometry(cfg.K)
    n16 = cfg.n16 if n16 is None else n16
    xsum = mul1_sums(cfg)
    last = cfg.warp_chunks - 1
    step = cfg.warps * cfg.unroll
    ring_word = warp * cfg.ring * cfg.ring_slot_words
    base = ring.iterator.toint()
    for j in cutlass.range_constexpr(cfg.ring - 1):
        copy_ring_chunk(xw, tw, k0 + min(j, last) * step + warp * cfg.unroll, tile0,
                        x0, base + (ring_word + j * cfg.ring_slot_words) * 4, lane, geo, cfg,
                        n16)
        cp_async_commit()
    for c in cutlass.range(cfg.warp_chunks):
        cp_async_wait(cfg.ring - 2)                # chunk c's copies by this lane have landed
        inline_ptx("bar.warp.sync -1;")
        ahead = c + cfg.ring - 1
        copy_ring_chunk(xw, tw, k0 + cutlass.min(ahead, last) * step + warp * cfg.unroll,
                        tile0, x0,
                        base + (ring_word + (ahead % cfg.ring) * cfg.ring_slot_words) * 4,
                        lane, geo, cfg, n16)
        cp_async_commit()
        wbuf, bfrag = ring_chunk_operands(ring, ring_word + (c % cfg.ring) * cfg.ring_slot_words,
                                          lane, funnels, geo, cfg)
        mma_chunk(wbuf, bfrag, acc, funnels, geo, cfg, xsum)
    cp_async_wait(0)                               # nothing in flight when the CTA exits
    mul1_affine(acc, xsum, cfg)


@cute.jit
def store_cta_partials(acc, out, tid, lane, warp, tn0, m0, by, cfg: cutlass.Constexpr,
                       reuse=None):
    """The dense kernels' epilogue: fold the warps' accumulators (in ``reuse``, see
    fold_warp_partials) and write every element of the CTA's tiles (padded tokens too) to
    split ``by`` of out."""
    nacc = cfg.acc_regs
    red = fold_warp_partials(acc, warp, lane, cfg, reuse)
    for e in cutlass.range_constexpr(-(-(nacc * 32) // cfg.threads)):
        idx = tid + e * cfg.threads
        if idx < nacc * 32:
            total, tok, col = summed_fragment(red, idx, tn0, m0, cfg)
            out[(by * cfg.m_pad + tok) * cfg.n + col] = total


def ring_buffer(cfg):
    """The CTA's shared buffer of the cp.async ring (ring_bytes: the ring, then the warps' fold
    in the same bytes), or None for direct loads. Plain Python inlined at trace time."""
    if not cfg.ring:
        return None
    return cutlass.memory.SmemAllocator().allocate_tensor(
        Uint32, cute.make_layout(cfg.ring_bytes // 4), 16)


@cute.jit
def cta_k_loop(xw, tw, ring, tile0, m0, kt0, k0, warp, lane, acc, funnels: list,
               cfg: cutlass.Constexpr, n16: cutlass.Constexpr = None):
    """The CTA's k loop over one linear (a group member: its activation row segment from k16
    step kt0, its own n16): through the ring (ring_k_loop) or with direct loads
    (dense_k_loop)."""
    if cutlass.const_expr(cfg.ring):
        ring_k_loop(xw, tw, ring, tile0, x_block_word(m0, kt0, cfg), k0, warp, lane, acc,
                    funnels, cfg, n16)
    else:
        dense_k_loop(xw, tw, tile0, x_base_word(m0, kt0, lane, cfg), k0, warp, acc, funnels,
                     cfg, n16)


@cute.kernel
def _trellis_mma_kernel(xw: cute.Tensor, tw: cute.Tensor, out: cute.Tensor,
                        cfg: cutlass.Constexpr):
    geo = lane_geometry(cfg.K)
    tid, lane, warp, (bx, by, bz) = cta_thread_ids()
    tn0 = bx * cfg.n_tiles
    m0 = bz * cfg.m_tile
    funnels = lane_funnels(geo, lane)                      # tile-independent, once per kernel
    acc = zero_accumulators(cfg)
    ring = ring_buffer(cfg)
    cta_k_loop(xw, tw, ring, tn0, m0, 0, by * cfg.k_per_split, warp, lane, acc, funnels, cfg)

    store_cta_partials(acc, out, tid, lane, warp, tn0, m0, by, cfg, ring)


@cute.kernel
def _trellis_mma_group_kernel(xw: cute.Tensor, tw0: cute.Tensor, tw1: cute.Tensor,
                              tw2: cute.Tensor, out: cute.Tensor, cfg: cutlass.Constexpr):
    """The dense kernel over a linear group: the CTA's n16 tiles lie in one member (every
    member's n16 is a multiple of n_tiles), whose trellis and activation segment it reads.
    One copy of the k loop per member, behind a branch that is uniform over the CTA."""
    geo = lane_geometry(cfg.K)
    tid, lane, warp, (bx, by, bz) = cta_thread_ids()
    tn0 = bx * cfg.n_tiles
    m0 = bz * cfg.m_tile
    k0 = by * cfg.k_per_split
    funnels = lane_funnels(geo, lane)
    acc = zero_accumulators(cfg)
    ring = ring_buffer(cfg)
    tws = (tw0, tw1, tw2)
    for i in cutlass.range_constexpr(len(cfg.members)):
        t0, n16 = cfg.member_tiles[i]
        if tn0 >= t0:
            if tn0 < t0 + n16:
                cta_k_loop(xw, tws[i], ring, tn0 - t0, m0, i * cfg.k16, k0, warp, lane, acc,
                           funnels, cfg, n16)

    store_cta_partials(acc, out, tid, lane, warp, tn0, m0, by, cfg, ring)


@cute.jit
def launch_trellis_mma(stream, xw: cute.Tensor, tw: cute.Tensor, out: cute.Tensor,
                       cfg: cutlass.Constexpr):
    """cutlass_call entry: (stream, inputs..., outputs..., **constexpr). With
    input_output_aliases (a caller-provided, e.g. NaN-poisoned, output buffer) cutlass_call passes
    the aliased input in place of ``out``, so the same launcher serves both."""
    _trellis_mma_kernel(xw, tw, out, cfg).launch(grid=cfg.grid, block=(cfg.threads, 1, 1),
                                                stream=stream, **launch_bounds(cfg.min_ctas))


@cute.jit
def launch_trellis_mma_group(stream, xw: cute.Tensor, tw0: cute.Tensor, tw1: cute.Tensor,
                             tw2: cute.Tensor, out: cute.Tensor, cfg: cutlass.Constexpr):
    """cutlass_call entry of the group kernel (two-member groups pass their last trellis twice;
    the third argument is then never read)."""
    _trellis_mma_group_kernel(xw, tw0, tw1, tw2, out, cfg).launch(
        grid=cfg.grid, block=(cfg.threads, 1, 1), stream=stream, **launch_bounds(cfg.min_ctas))
