"""The PTX interpreter (ffi/ptx_interpreter.py) on hand-written kernels: its arithmetic against
independent NumPy / exact-rational references on random inputs, its wgmma against a NumPy model
of the PTX ISA's fragment and shared-memory layouts, and each hazard it exists to catch, shown
caught (a broken kernel) and not reported on the fixed kernel. No cutlass needed."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from exl3_jax.ffi import ptx_interpreter as pi

HEADER = ".version 8.8\n.target sm_90a\n.address_size 64\n"


def run(body: str, inputs: list[np.ndarray], out_bytes: int, *, threads=32, ctas=1, smem=0,
        regs: str = "", shared_decl: bool = False, cluster=None, **launch_kw):
    """Run ``body`` as kernel k(in0.., out) over ``ctas`` (a count along x, or a grid) x
    ``threads``, in clusters of ``cluster`` CTAs if given; returns the output buffer's
    bytes."""
    params = ", ".join(f".param .u64 p{i}" for i in range(len(inputs) + 1))
    text = HEADER + (".extern .shared .align 1024 .b8 smem[];\n" if shared_decl else "") + \
        f".visible .entry k({params})\n{{\n" + \
        ".reg .pred %p<16>;\n.reg .b16 %h<16>;\n.reg .b32 %r<64>;\n.reg .b64 %rd<32>;\n" + \
        regs + body + "\n}\n"
    module = pi.PtxModule(text)
    mem = pi.GlobalMemory()
    addrs = [mem.alloc(x) for x in inputs] + [mem.alloc(out_bytes)]
    grid = ctas if isinstance(ctas, tuple) else (ctas, 1, 1)
    pi.launch(module, "k", grid, (threads, 1, 1), addrs, mem, smem, cluster=cluster,
              **launch_kw)
    return mem.read(addrs[-1])


# Each thread t reads words a, b, c at in0[3t..3t+2] and writes 22 words out[22t..].
OPS = """
ld.param.u64 %rd1, [p0];
ld.param.u64 %rd2, [p1];
mov.u32 %r1, %tid.x;
mul.wide.u32 %rd3, %r1, 12;
add.s64 %rd4, %rd1, %rd3;
ld.global.u32 %r2, [%rd4];
ld.global.u32 %r3, [%rd4+4];
ld.global.u32 %r4, [%rd4+8];
mul.wide.u32 %rd5, %r1, 88;
add.s64 %rd6, %rd2, %rd5;
lop3.b32 %r10, %r2, %r3, %r4, 0xE8;
st.global.u32 [%rd6], %r10;
prmt.b32 %r11, %r2, %r3, %r4;
st.global.u32 [%rd6+4], %r11;
shf.l.wrap.b32 %r12, %r2, %r3, %r4;
st.global.u32 [%rd6+8], %r12;
shf.r.clamp.b32 %r13, %r2, %r3, %r4;
st.global.u32 [%rd6+12], %r13;
dp4a.u32.u32 %r14, %r2, %r3, %r4;
st.global.u32 [%rd6+16], %r14;
dp4a.s32.s32 %r15, %r2, %r3, %r4;
st.global.u32 [%rd6+20], %r15;
fma.rn.f32 %r16, %r2, %r3, %r4;
st.global.u32 [%rd6+24], %r16;
add.rn.f16x2 %r17, %r2, %r3;
st.global.u32 [%rd6+28], %r17;
fma.rn.f16x2 %r18, %r2, %r3, %r4;
st.global.u32 [%rd6+32], %r18;
mul.hi.u32 %r19, %r2, %r3;
st.global.u32 [%rd6+36], %r19;
mad.lo.s32 %r20, %r2, %r3, %r4;
st.global.u32 [%rd6+40], %r20;
shr.s32 %r21, %r2, %r4;
st.global.u32 [%rd6+44], %r21;
mov.b32 {%h1, %h2}, %r2;
cvt.f32.f16 %r22, %h2;
st.global.u32 [%rd6+48], %r22;
cvt.rn.f16.f32 %h3, %r3;
cvt.f32.f16 %r23, %h3;
st.global.u32 [%rd6+52], %r23;
setp.lt.s32 %p1, %r2, %r3;
selp.b32 %r24, %r2, %r4, %p1;
st.global.u32 [%rd6+56], %r24;
shfl.sync.bfly.b32 %r25, %r2, 5, 31, -1;
st.global.u32 [%rd6+60], %r25;
cvt.u16.u32 %h4, %r2;
cvt.u16.u32 %h5, %r3;
mul.hi.u16 %h6, %h4, %h5;
cvt.u32.u16 %r26, %h6;
st.global.u32 [%rd6+64], %r26;
div.rn.f32 %r27, %r2, %r3;
st.global.u32 [%rd6+68], %r27;
fma.rm.f32 %r28, %r2, %r3, %r4;
st.global.u32 [%rd6+72], %r28;
fma.rp.f32 %r29, %r2, %r3, %r4;
st.global.u32 [%rd6+76], %r29;
cvt.sat.f32.f32 %r30, %r2;
st.global.u32 [%rd6+80], %r30;
mov.b32 {%h7, %h8}, %r3;
add.rn.f16 %h9, %h1, %h7;
mov.b32 %r31, {%h9, %h8};
st.global.u32 [%rd6+84], %r31;
ret;
"""


def _exact_f32(q: Fraction) -> np.float32:
    """q rounded to the nearest fp32, ties to even (candidates around float(q))."""
    f = np.float32(float(q))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    best = min(cands, key=lambda c: (abs(Fraction(float(c)) - q),
                                     int(np.array(c).view(np.uint32)) & 1))
    return np.float32(best)


def _directed_f32(q: Fraction, up: bool) -> np.float32:
    """The fp32 nearest q on one side: the largest <= q (up False) or smallest >= q."""
    f = np.float32(float(q))
    while (Fraction(float(f)) > q) if not up else (Fraction(float(f)) < q):
        f = np.nextafter(f, np.float32(np.inf if up else -np.inf))
    while True:
        g = np.nextafter(f, np.float32(-np.inf if up else np.inf))
        if (Fraction(float(g)) >= q) if up else (Fraction(float(g)) <= q):
            f = g
        else:
            return f


def _f16_round(q: Fraction) -> np.float16:
    f = np.float16(float(q))
    cands = [np.nextafter(f, np.float16(-np.inf)), f, np.nextafter(f, np.float16(np.inf))]
    return min(cands, key=lambda c: (abs(Fraction(float(c)) - q),
                                     int(np.array(c).view(np.uint16)) & 1))


def test_integer_and_float_instructions_match_references(rng):
    n = 32
    words = rng.integers(0, 2**32, size=(n, 3), dtype=np.uint64).astype(np.uint32)
    # Finite floats of similar scale for the fp32 / fp16 rows (some lanes keep random bits).
    f32 = rng.standard_normal((n, 3)).astype(np.float32)
    f32[:, 2] *= np.float32(2.0) ** rng.integers(-30, 30, size=n)
    words[: n // 2] = f32[: n // 2].view(np.uint32)
    halves = rng.standard_normal((n, 3, 2)).astype(np.float16)
    words[n // 2:] = halves[n // 2:].view(np.uint32).reshape(n // 2, 3)
    words[:, 2][::3] = rng.integers(0, 40, size=len(words[::3]))      # shift amounts, some >= 32
    out = run(OPS, [words], n * 88).view(np.uint32).reshape(n, 22)
    for t in range(n):
        a, b, c = (int(v) for v in words[t])
        assert out[t, 0] == (a & b) | (a & c) | (b & c)                  # lop3 0xE8: majority
        both = (b << 32) | a
        want = 0
        for i in range(4):
            nib = (c >> 4 * i) & 0xF
            byte = (both >> 8 * (nib & 7)) & 0xFF
            if nib & 8:
                byte = 0xFF if byte & 0x80 else 0
            want |= byte << 8 * i
        assert out[t, 1] == want
        assert out[t, 2] == ((both << (c & 31)) >> 32) & 0xFFFFFFFF
        assert out[t, 3] == (both >> min(c, 32)) & 0xFFFFFFFF
        ab = [(a >> 8 * i) & 0xFF for i in range(4)]
        bb = [(b >> 8 * i) & 0xFF for i in range(4)]
        assert out[t, 4] == (c + sum(x * y for x, y in zip(ab, bb))) & 0xFFFFFFFF
        sab = [x - 256 if x > 127 else x for x in ab]
        sbb = [x - 256 if x > 127 else x for x in bb]
        sc = c - 2**32 if c >= 2**31 else c
        assert out[t, 5] == (sc + sum(x * y for x, y in zip(sab, sbb))) & 0xFFFFFFFF
        fa, fb, fc = (np.array([v], np.uint32).view(np.float32)[0] for v in (a, b, c))
        if np.isfinite([fa, fb, fc]).all() and t < n // 2:
            want_f = _exact_f32(Fraction(float(fa)) * Fraction(float(fb)) + Fraction(float(fc)))
            assert out[t, 6] == np.array([want_f]).view(np.uint32)[0], (fa, fb, fc)
        if t >= n // 2:
            ha, hb, hc = (np.array([v], np.uint32).view(np.float16) for v in (a, b, c))
            s = [_f16_round(Fraction(float(x)) + Fraction(float(y))) for x, y in zip(ha, hb)]
            assert out[t, 7] == np.array(s, np.float16).view(np.uint32)[0]
            f = [_f16_round(Fraction(float(x)) * Fraction(float(y)) + Fraction(float(z)))
                 for x, y, z in zip(ha, hb, hc)]
            assert out[t, 8] == np.array(f, np.float16).view(np.uint32)[0]
            assert out[t, 12] == np.float32(ha[1]).view(np.uint32)
            h = np.array([_f16_round(Fraction(float(ha[0])) + Fraction(float(hb[0]))), hb[1]],
                         np.float16)
            assert out[t, 21] == h.view(np.uint32)[0]          # scalar fp16 add, high half kept
        assert out[t, 9] == (a * b) >> 32
        sa, sb = (v - 2**32 if v >= 2**31 else v for v in (a, b))
        assert out[t, 10] == (sa * sb + sc) & 0xFFFFFFFF
        assert out[t, 11] == (sa >> min(c, 31)) & 0xFFFFFFFF          # clamps to a sign fill
        assert out[t, 14] == (a if sa < (b - 2**32 if b >= 2**31 else b) else c)
        assert out[t, 15] == words[t ^ 5, 0]
        assert out[t, 16] == ((a & 0xFFFF) * (b & 0xFFFF)) >> 16
        if np.isfinite([fa, fb]).all() and fb != 0 and t < n // 2:
            q = _exact_f32(Fraction(float(fa)) / Fraction(float(fb)))
            assert out[t, 17] == np.array([q]).view(np.uint32)[0], (fa, fb)
        if np.isfinite([fa, fb, fc]).all() and t < n // 2:
            exact = Fraction(float(fa)) * Fraction(float(fb)) + Fraction(float(fc))
            for col, up in ((18, False), (19, True)):
                want_d = _directed_f32(exact, up)
                assert out[t, col] == np.array([want_d]).view(np.uint32)[0], (fa, fb, fc, up)
            sat = min(max(float(fa), 0.0), 1.0)
            assert out[t, 20] == np.array([sat], np.float32).view(np.uint32)[0]
    fb = words[:, 1].view(np.float32)
    np.testing.assert_array_equal(out[:, 13].view(np.float32), fb.astype(np.float16)
                                  .astype(np.float32))


# --- hazards ---------------------------------------------------------------------------------

# 64 threads: warp 0 writes a word to shared memory, warp 1 reads it (BARRIER marks the spot).
SHARE = """
ld.param.u64 %rd1, [p0];
mov.u32 %r1, %tid.x;
mov.b32 %r2, smem;
setp.ge.u32 %p1, %r1, 32;
@%p1 bra $READ;
shl.b32 %r3, %r1, 2;
add.s32 %r4, %r2, %r3;
st.shared.u32 [%r4], %r1;
$READ:
BARRIER
@!%p1 bra $END;
sub.s32 %r5, %r1, 32;
shl.b32 %r3, %r5, 2;
add.s32 %r4, %r2, %r3;
ld.shared.u32 %r6, [%r4];
mul.wide.u32 %rd2, %r5, 4;
add.s64 %rd3, %rd1, %rd2;
st.global.u32 [%rd3], %r6;
$END:
ret;
"""


def test_shared_memory_race_is_caught_and_a_barrier_fixes_it():
    ok = run(SHARE.replace("BARRIER", "bar.sync 0;"), [], 128, threads=64, smem=128,
             shared_decl=True)
    np.testing.assert_array_equal(ok.view(np.uint32), np.arange(32))
    with pytest.raises(pi.PtxError, match="read-after-write"):
        run(SHARE.replace("BARRIER", ""), [], 128, threads=64, smem=128, shared_decl=True)


def test_out_of_bounds_misaligned_and_divergent_barrier_are_caught():
    with pytest.raises(pi.PtxError, match="out-of-bounds shared"):
        run(SHARE.replace("BARRIER", "bar.sync 0;"), [], 128, threads=64, smem=64,
            shared_decl=True)
    load = "ld.param.u64 %rd1, [p0];\nld.global.u32 %r1, [%rd1+OFF];\nret;"
    run(load.replace("OFF", "12"), [np.zeros(4, np.uint32)], 4)
    with pytest.raises(pi.PtxError, match="out-of-bounds global load of 4 bytes at offset 16"):
        run(load.replace("OFF", "16"), [np.zeros(4, np.uint32)], 4)
    with pytest.raises(pi.PtxError, match="misaligned"):
        run(load.replace("OFF", "2"), [np.zeros(4, np.uint32)], 4)
    diverge = ("mov.u32 %r1, %tid.x;\nsetp.lt.u32 %p1, %r1, 16;\n@%p1 bra $SKIP;\n"
               "bar.sync 0;\n$SKIP:\nret;")
    with pytest.raises(pi.PtxError, match="part of a CTA"):
        run(diverge, [], 4)


# cp.async: each of 32 threads copies 16 bytes into shared memory and reads them back.
CP_ASYNC = """
ld.param.u64 %rd1, [p0];
ld.param.u64 %rd2, [p1];
mov.u32 %r1, %tid.x;
mul.wide.u32 %rd3, %r1, 16;
add.s64 %rd4, %rd1, %rd3;
mov.b32 %r2, smem;
shl.b32 %r3, %r1, 4;
add.s32 %r4, %r2, %r3;
cp.async.cg.shared.global [%r4], [%rd4], 16;
cp.async.commit_group;
WAIT
ld.shared.v4.u32 {%r5, %r6, %r7, %r8}, [%r4];
add.s64 %rd5, %rd2, %rd3;
st.global.v4.u32 [%rd5], {%r5, %r6, %r7, %r8};
ret;
"""


def test_cp_async_read_before_its_wait_is_caught(rng):
    src = rng.integers(0, 2**32, size=128, dtype=np.uint64).astype(np.uint32)
    got = run(CP_ASYNC.replace("WAIT", "cp.async.wait_group 0;"), [src], 512, smem=512,
              shared_decl=True)
    np.testing.assert_array_equal(got.view(np.uint32), src)
    with pytest.raises(pi.PtxError, match="before their cp.async landed"):
        run(CP_ASYNC.replace("WAIT", ""), [src], 512, smem=512, shared_decl=True)


def test_bar_warp_sync_orders_a_warp_and_partial_warps_are_refused(rng):
    # Lane t reads the 16 bytes lane t + 1 copied (the staged decode kernels' pattern): a full
    # warp's bar.warp.sync after the wait; a partial member mask or a warp that only partly
    # reaches it is refused.
    src = rng.integers(0, 2**32, size=128, dtype=np.uint64).astype(np.uint32)
    other = ("cp.async.wait_group 0;\nSYNC\nadd.s32 %r9, %r1, 1;\nand.b32 %r9, %r9, 31;\n"
             "shl.b32 %r9, %r9, 4;\nadd.s32 %r4, %r2, %r9;")
    body = CP_ASYNC.replace("WAIT", other)
    got = run(body.replace("SYNC", "bar.warp.sync -1;"), [src], 512, smem=512,
              shared_decl=True)
    np.testing.assert_array_equal(got.view(np.uint32).reshape(32, 4),
                                  np.roll(src.reshape(32, 4), -1, axis=0))
    with pytest.raises(pi.PtxUnsupported, match="partial member mask"):
        run(body.replace("SYNC", "bar.warp.sync 65535;"), [src], 512, smem=512,
            shared_decl=True)
    half = "setp.lt.u32 %p1, %r1, 16;\n@%p1 bra $SKIP;\nbar.warp.sync -1;\n$SKIP:"
    with pytest.raises(pi.PtxError, match="part of a warp"):
        run(body.replace("SYNC", half), [src], 512, smem=512, shared_decl=True)


# One 16-byte unit u = tid + offset of a 64-fp16 (128-byte) row-major matrix at global src,
# stored at shared smem + dst + row * 128 + (segment ^ row % 8) * 16: the 128-byte swizzle.
_STAGE_UNIT = """
add.u32 %r50, %r1, {offset};
mul.wide.u32 %rd20, %r50, 16;
add.s64 %rd21, {src}, %rd20;
ld.global.v4.u32 {{%r3, %r4, %r5, %r6}}, [%rd21];
shr.u32 %r51, %r50, 3;
and.b32 %r52, %r50, 7;
and.b32 %r53, %r51, 7;
xor.b32 %r52, %r52, %r53;
shl.b32 %r51, %r51, 7;
shl.b32 %r52, %r52, 4;
add.s32 %r51, %r51, %r52;
add.s32 %r51, %r51, %r2;
st.shared.v4.u32 [%r51+{dst}], {{%r3, %r4, %r5, %r6}};
"""

# wgmma m64n8k16: threads 0..63 stage B (8 rows x 64 fp16, 128-byte swizzle) in shared memory,
# every thread loads its 4 A registers, one wgmma, D (4 fp32 per thread) to global.
WGMMA = """
ld.param.u64 %rd1, [p0];
ld.param.u64 %rd2, [p1];
ld.param.u64 %rd3, [p2];
mov.u32 %r1, %tid.x;
mov.b32 %r2, smem;
setp.ge.u32 %p1, %r1, 64;
@%p1 bra $STAGED;
""" + _STAGE_UNIT.format(offset=0, src="%rd1", dst=0) + """FENCE
$STAGED:
BARRIER
mul.wide.u32 %rd6, %r1, 16;
add.s64 %rd7, %rd2, %rd6;
ld.global.v4.u32 {%r20, %r21, %r22, %r23}, [%rd7];
mov.b32 %r30, 0;
mov.b32 %r31, 0;
mov.b32 %r32, 0;
mov.b32 %r33, 0;
wgmma.fence.sync.aligned;
shr.u32 %r40, %r2, 4;
cvt.u64.u32 %rd8, %r40;
or.b64 %rd9, %rd8, 0x4000004000010000;
setp.ne.b32 %p2, 0, 0;
wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%r30, %r31, %r32, %r33}, {%r20, %r21, %r22, %r23}, %rd9, %p2, 1, 1, 0;
wgmma.commit_group.sync.aligned;
AFTER
wgmma.wait_group.sync.aligned 0;
add.s64 %rd10, %rd3, %rd6;
st.global.v4.u32 [%rd10], {%r30, %r31, %r32, %r33};
ret;
"""


def _wgmma_inputs(rng):
    b = rng.standard_normal((8, 64)).astype(np.float16)        # B^T rows: n x k (k 0..63)
    a = rng.standard_normal((64, 16)).astype(np.float16)
    # A fragments: thread 32w + l holds rows 16w + l//4 (+8), cols 2(l%4) (+1, +8, +9).
    frag = np.zeros((128, 4, 2), np.float16)
    for tid in range(128):
        w, lane = divmod(tid, 32)
        g, t = divmod(lane, 4)
        for i, (r, c) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                    (g + 8, 2 * t + 8)]):
            frag[tid, i] = a[16 * w + r, c:c + 2]
    return a, b, frag


def _wgmma_expected(a, b):
    d = a.astype(np.float64) @ b[:, :16].astype(np.float64).T          # [64, 8]
    out = np.zeros((128, 4), np.float32)
    for tid in range(128):
        w, lane = divmod(tid, 32)
        g, t = divmod(lane, 4)
        for i, (r, c) in enumerate([(g, 2 * t), (g, 2 * t + 1), (g + 8, 2 * t),
                                    (g + 8, 2 * t + 1)]):
            out[tid, i] = d[16 * w + r, c]
    return out


def _run_wgmma(rng, fence="fence.proxy.async.shared::cta;", barrier="bar.sync 0;", after=""):
    a, b, frag = _wgmma_inputs(rng)
    text = WGMMA.replace("FENCE", fence).replace("BARRIER", barrier).replace("AFTER", after)
    got = run(text, [b, frag], 128 * 16, threads=128, smem=1024, shared_decl=True)
    return got.view(np.float32).reshape(128, 4), _wgmma_expected(a, b)


def test_wgmma_matches_the_isa_layouts(rng):
    got, want = _run_wgmma(rng)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change,message", [
    (dict(fence=""), "without a fence.proxy.async"),
    (dict(barrier=""), "wgmma reads bytes written since"),
    (dict(after="add.s32 %r20, %r20, 1;"), "A register %r20 changed before its wait_group"),
    (dict(after="st.global.u32 [%rd2], %r31;"), "accumulator %r31 accessed before"),
])
def test_wgmma_hazards_are_caught(rng, change, message):
    with pytest.raises(pi.PtxError, match=message):
        _run_wgmma(rng, **change)


# wgmma m64n8k16 with A from shared memory too ("SS"): B staged as above at smem + 0, A (64 rows
# x 64 fp16, the same 128-byte swizzle) at smem + 1024 by all 128 threads, 4 units each.
WGMMA_SS = (WGMMA.replace("BARRIER", "STAGE_A\nBARRIER")
            .replace("ld.global.v4.u32 {%r20, %r21, %r22, %r23}, [%rd7];\n", "")
            .replace("setp.ne.b32 %p2, 0, 0;\n", """add.u32 %r41, %r2, 1024;
shr.u32 %r41, %r41, 4;
cvt.u64.u32 %rd11, %r41;
or.b64 %rd12, %rd11, 0x4000004000010000;
setp.ne.b32 %p2, 0, 0;
""").replace("{%r20, %r21, %r22, %r23}, %rd9, %p2, 1, 1, 0;", "%rd12, %rd9, %p2, 1, 1, 0, 0;"))
@pytest.mark.parametrize("change,message", [
    ({}, None),
    (dict(fence=""), "without a fence.proxy.async"),
    (dict(after="st.shared.u32 [%r2+1024], %r1;"), "write-after-read|overwritten while a wgmma"),
])
def test_wgmma_with_a_from_shared_memory(rng, change, message):
    b = rng.standard_normal((8, 64)).astype(np.float16)
    a = rng.standard_normal((64, 64)).astype(np.float16)
    fence = change.get("fence", "fence.proxy.async.shared::cta;")
    stage_a = "".join(_STAGE_UNIT.format(offset=128 * i, src="%rd2", dst=1024)
                      for i in range(4)) + fence
    text = (WGMMA_SS.replace("STAGE_A", stage_a).replace("FENCE", fence)
            .replace("BARRIER", "bar.sync 0;")
            .replace("AFTER", change.get("after", "")))
    if message:
        with pytest.raises(pi.PtxError, match=message):
            run(text, [b, a], 128 * 16, threads=128, smem=1024 + 8192, shared_decl=True)
        return
    got = run(text, [b, a], 128 * 16, threads=128, smem=1024 + 8192, shared_decl=True)
    want = _wgmma_expected(a[:, :16], b)
    np.testing.assert_allclose(got.view(np.float32).reshape(128, 4), want, rtol=1e-6, atol=1e-6)


def test_pdl_reads_before_the_wait_and_non_coherent_reads_of_own_writes_are_caught():
    """Launch 1, a programmatic dependent launch, reads what launch 0 wrote: only after
    griddepcontrol.wait. A kernel reading its own stores through ld.global.nc is caught."""
    text = HEADER + """
.visible .entry produce(.param .u64 p0)
{
.reg .b32 %r<4>;
.reg .b64 %rd<4>;
ld.param.u64 %rd1, [p0];
mov.u32 %r1, %tid.x;
mul.wide.u32 %rd2, %r1, 4;
add.s64 %rd3, %rd1, %rd2;
st.global.u32 [%rd3], %r1;
LOAD
ret;
}
.visible .entry consume(.param .u64 p0, .param .u64 p1)
{
.reg .b32 %r<4>;
.reg .b64 %rd<8>;
ld.param.u64 %rd1, [p0];
ld.param.u64 %rd4, [p1];
mov.u32 %r1, %tid.x;
mul.wide.u32 %rd2, %r1, 4;
add.s64 %rd3, %rd1, %rd2;
WAIT
ld.global.u32 %r2, [%rd3];
add.s64 %rd5, %rd4, %rd2;
st.global.u32 [%rd5], %r2;
ret;
}
"""

    def go(wait: str, load: str = ""):
        module = pi.PtxModule(text.replace("WAIT", wait).replace("LOAD", load))
        mem = pi.GlobalMemory()
        a, b = mem.alloc(128), mem.alloc(128)
        pi.launch(module, "produce", (1, 1, 1), (32, 1, 1), [a], mem, 0, launch_id=0)
        pi.launch(module, "consume", (1, 1, 1), (32, 1, 1), [a, b], mem, 0, launch_id=1,
                  unordered=[0])
        return mem.read(b).view(np.uint32)

    np.testing.assert_array_equal(go("griddepcontrol.wait;"), np.arange(32))
    with pytest.raises(pi.PtxError, match="before griddepcontrol.wait, racing launch 0"):
        go("")
    with pytest.raises(pi.PtxError, match="ld.global.nc of .* bytes this kernel wrote"):
        go("griddepcontrol.wait;", "ld.global.nc.u32 %r2, [%rd3];")


# --- thread-block clusters (distributed shared memory) ----------------------------------------

# 64 threads a CTA, clusters of C along x. Thread t of the CTA of rank r loads 16 bytes
# (in0[ctaid * 64 + t]) and stores them at slot r, offset 16 t of every CTA of its cluster
# (mapa + st.shared::cluster), then SYNC; then reads every slot s at its offset 16 t (READ)
# into out[(ctaid * C + s) * 64 + t]. Its special registers go to out + SPECIALS (32 bytes a
# thread). START: before any DSMEM access; PRE: before the remote stores.
CLUSTER = """
ld.param.u64 %rd1, [p0];
ld.param.u64 %rd2, [p1];
mov.u32 %r1, %tid.x;
mov.u32 %r2, %ctaid.x;
mov.u32 %r3, %cluster_ctarank;
mov.u32 %r4, %cluster_nctarank;
mov.u32 %r5, %clusterid.x;
mov.u32 %r6, %nclusterid.x;
mov.u32 %r7, %cluster_ctaid.x;
mov.u32 %r8, %cluster_nctaid.x;
mad.lo.u32 %r9, %r2, 64, %r1;
mul.wide.u32 %rd4, %r9, 32;
add.s64 %rd5, %rd2, %rd4;
st.global.v4.u32 [%rd5+SPECIALS], {%r3, %r4, %r5, %r6};
st.global.v4.u32 [%rd5+SPECIALS+16], {%r7, %r8, %r2, %r1};
START
mul.wide.u32 %rd6, %r9, 16;
add.s64 %rd7, %rd1, %rd6;
ld.global.v4.u32 {%r10, %r11, %r12, %r13}, [%rd7];
mov.b32 %r14, smem;
shl.b32 %r15, %r1, 4;
add.s32 %r14, %r14, %r15;
shl.b32 %r16, %r3, 10;
add.s32 %r17, %r14, %r16;
PRE
mov.u32 %r18, 0;
$STORE:
mapa.shared::cluster.u32 %r19, %r17, %r18;
st.shared::cluster.v4.b32 [%r19], {%r10, %r11, %r12, %r13};
add.u32 %r18, %r18, 1;
setp.lt.u32 %p1, %r18, LIMIT;
@%p1 bra $STORE;
SYNC
mov.u32 %r18, 0;
$LOAD:
shl.b32 %r20, %r18, 10;
add.s32 %r21, %r14, %r20;
READ
mad.lo.u32 %r26, %r2, %r4, %r18;
mad.lo.u32 %r27, %r26, 64, %r1;
mul.wide.u32 %rd8, %r27, 16;
add.s64 %rd9, %rd2, %rd8;
st.global.v4.u32 [%rd9], {%r22, %r23, %r24, %r25};
add.u32 %r18, %r18, 1;
setp.lt.u32 %p1, %r18, %r4;
@%p1 bra $LOAD;
ret;
"""
_CLUSTER_PARTS = dict(
    START="barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;", PRE="",
    LIMIT="%r4", SYNC="barrier.cluster.arrive.release.aligned;\n"
    "barrier.cluster.wait.acquire.aligned;",
    READ="ld.shared::cluster.v4.b32 {%r22, %r23, %r24, %r25}, [%r21];")


def _run_cluster(src, ctas, c, max_lanes=4096, **change):
    parts = dict(_CLUSTER_PARTS, **change)
    specials = ctas * c * 64 * 16
    body = CLUSTER.replace("SPECIALS+16", str(specials + 16)).replace("SPECIALS", str(specials))
    for k in ("START", "PRE", "LIMIT", "SYNC", "READ"):
        body = body.replace(k, parts[k])
    out = run(body, [src], specials + ctas * 64 * 32, threads=64, ctas=ctas, smem=c * 1024,
              shared_decl=True, cluster=(c, 1, 1), max_lanes=max_lanes)
    return (out[:specials].view(np.uint32).reshape(ctas, c, 64, 4),
            out[specials:].view(np.uint32).reshape(ctas, 64, 8))


@pytest.mark.parametrize("c,max_lanes", [(4, 4096), (2, 64), (8, 4096), (4, 256)])
def test_cluster_ctas_exchange_through_distributed_shared_memory(rng, c, max_lanes):
    ctas = 8
    src = rng.integers(0, 2**32, size=(ctas, 64, 4), dtype=np.uint64).astype(np.uint32)
    slots, specials = _run_cluster(src, ctas, c, max_lanes=max_lanes)
    cta = np.arange(ctas)
    # Slot s of CTA x holds what the CTA of rank s of x's cluster loaded.
    np.testing.assert_array_equal(slots, src[(cta // c * c)[:, None] + np.arange(c)])
    want = np.stack([cta % c, np.full(ctas, c), cta // c, np.full(ctas, ctas // c), cta % c,
                     np.full(ctas, c), cta], 1)
    np.testing.assert_array_equal(specials[:, :, :7], np.broadcast_to(want[:, None], (ctas, 64, 7)))
    np.testing.assert_array_equal(specials[:, :, 7], np.broadcast_to(np.arange(64), (ctas, 64)))


def test_cluster_special_registers_of_a_2d_cluster():
    # Grid (4, 6, 2), clusters (2, 3, 1): each thread 0 writes its CTA's cluster registers.
    regs = ["%ctaid.x", "%ctaid.y", "%ctaid.z", "%cluster_ctarank", "%cluster_nctarank",
            "%cluster_ctaid.x", "%cluster_ctaid.y", "%cluster_ctaid.z", "%clusterid.x",
            "%clusterid.y", "%clusterid.z", "%nclusterid.x", "%nclusterid.y", "%nclusterid.z",
            "%cluster_nctaid.x", "%cluster_nctaid.y"]
    body = "ld.param.u64 %rd1, [p0];\nmov.u32 %r1, %tid.x;\nsetp.ne.u32 %p1, %r1, 0;\n" \
        "@%p1 bra $END;\nmov.u32 %r2, %ctaid.z;\nmov.u32 %r3, %ctaid.y;\n" \
        "mov.u32 %r4, %ctaid.x;\nmad.lo.u32 %r5, %r2, 6, %r3;\nmad.lo.u32 %r5, %r5, 4, %r4;\n" \
        "mul.wide.u32 %rd2, %r5, 64;\nadd.s64 %rd3, %rd1, %rd2;\n" + "".join(
            f"mov.u32 %r{10 + i}, {r};\nst.global.u32 [%rd3+{4 * i}], %r{10 + i};\n"
            for i, r in enumerate(regs)) + "$END:\nret;"
    out = run(body, [], 48 * 64, ctas=(4, 6, 2), cluster=(2, 3, 1), max_lanes=96)
    got = out.view(np.uint32).reshape(2, 6, 4, 16)
    z, y, x = np.meshgrid(np.arange(2), np.arange(6), np.arange(4), indexing="ij")
    want = np.stack([x, y, z, x % 2 + 2 * (y % 3), np.full_like(x, 6), x % 2, y % 3, z * 0,
                     x // 2, y // 3, z, np.full_like(x, 2), np.full_like(x, 2),
                     np.full_like(x, 2), np.full_like(x, 2), np.full_like(x, 3)], -1)
    np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"grid \(4, 6, 2\) is not divisible by the cluster "
                       r"\(4, 4, 1\)"):
        run(body, [], 48 * 64, ctas=(4, 6, 2), cluster=(4, 4))


_RELAXED = "barrier.cluster.arrive.relaxed.aligned;\nbarrier.cluster.wait.aligned;"


@pytest.mark.parametrize("change,error,message", [
    # Remote stores ordered for the local reads by bar.sync only (it orders one CTA).
    (dict(SYNC="bar.sync 0;"), pi.PtxError, "read-after-write.*cluster barrier"),
    # A relaxed arrive releases nothing.
    (dict(SYNC=_RELAXED), pi.PtxError, "read-after-write"),
    # Stores after the (release) arrive are not ordered by its wait.
    (dict(PRE="barrier.cluster.arrive.release.aligned;",
          SYNC="barrier.cluster.wait.acquire.aligned;"), pi.PtxError, "read-after-write"),
    # DSMEM before a cluster barrier guarantees the other CTAs have started.
    (dict(START=""), pi.PtxError, "before the cluster barrier that guarantees every CTA"),
    # The CTA of rank 1 skips the barrier.
    (dict(SYNC="setp.eq.u32 %p2, %r3, 1;\n@%p2 bra $SKIP;\nbarrier.cluster.arrive.aligned;\n"
          "barrier.cluster.wait.aligned;\n$SKIP:"), pi.PtxError, "part of a cluster"),
    # Rank 1 exits before arriving.
    (dict(SYNC="setp.eq.u32 %p2, %r3, 1;\n@%p2 ret;\nbarrier.cluster.arrive.aligned;\n"
          "barrier.cluster.wait.aligned;"), pi.PtxError, "exited without arriving"),
    (dict(LIMIT="5"), pi.PtxError, r"mapa to CTA rank 4 of a cluster of 4"),
    (dict(READ="mapa.shared::cluster.u32 %r21, %r21, %r3;\n"
          "ld.shared.v4.u32 {%r22, %r23, %r24, %r25}, [%r21];"), pi.PtxError,
     "used as a shared::cta address"),
    (dict(START="barrier.cluster.wait.aligned;"), pi.PtxError, "wait without a prior"),
    (dict(START="barrier.cluster.arrive.aligned;\n" + _RELAXED), pi.PtxError,
     "arrived and has not waited"),
    (dict(START="setp.lt.u32 %p2, %r1, 16;\n@%p2 bra $HALF;\n"
          "barrier.cluster.arrive.aligned;\n$HALF:\n"), pi.PtxError, "part of a warp"),
])
def test_cluster_hazards_are_caught(rng, change, error, message):
    src = rng.integers(0, 2**32, size=(8, 64, 4), dtype=np.uint64).astype(np.uint32)
    with pytest.raises(error, match=message):
        _run_cluster(src, 8, 4, **change)


def test_remote_reads_race_with_the_owners_writes_until_a_cluster_barrier(rng):
    # After the exchange, each CTA reads word 0 of slot 0 in the CTA of the next rank, then
    # that CTA's thread 0 overwrites it: a cluster barrier between them, or a race.
    src = rng.integers(0, 2**32, size=(8, 64, 4), dtype=np.uint64).astype(np.uint32)
    read = ("add.u32 %r30, %r3, 1;\nrem.u32 %r30, %r30, %r4;\nmov.b32 %r31, smem;\n"
            "mapa.shared::cluster.u32 %r32, %r31, %r30;\nld.shared::cluster.u32 %r33, [%r32];\n"
            "BETWEEN\nsetp.eq.u32 %p3, %r1, 0;\n@%p3 st.shared::cluster.b32 [%r31], %r33;\n")
    sync = _CLUSTER_PARTS["SYNC"] + "\n" + read
    _run_cluster(src, 8, 4, SYNC=sync.replace("BETWEEN", _CLUSTER_PARTS["SYNC"]))
    with pytest.raises(pi.PtxError, match="write-after-read"):
        _run_cluster(src, 8, 4, SYNC=sync.replace("BETWEEN", "bar.sync 0;"))


# Warp-instruction counts (launch's counts): lanes below SPLIT branch around two adds.
ISSUE = """
mov.u32 %r1, %tid.x;
setp.lt.u32 %p1, %r1, SPLIT;
@%p1 bra $SKIP;
add.u32 %r2, %r1, 1;
add.u32 %r2, %r2, 1;
$SKIP:
ret;
"""


@pytest.mark.parametrize("split,adds", [(32, 2 * 2), (16, 2 * 4), (0, 2 * 4), (64, 0)])
def test_issued_warp_instructions_are_counted_per_warp_and_path(split, adds):
    """Two CTAs of two warps: every warp issues the straight-line instructions once; the adds
    are issued by each warp that has a lane on their path (warp 0 skips them whole at SPLIT
    32, only half of it at 16); the branch is issued whether taken or not."""
    counts = {}
    run(ISSUE.replace("SPLIT", str(split)), [], 4, threads=64, ctas=2, counts=counts)
    want = {"mov": 4, "setp": 4, "bra": 4, "add": adds, "ret": 4}
    assert {k: v for k, v in counts.items() if v} == {k: v for k, v in want.items() if v}
