"""Hessian finalisation (spec 6.2), block LDL and LDLQ (spec 6.4), and ``quantize_linear``.

LDLQ quantizes W_r strip by strip (16 input rows at a time, last strip first), feeding the error
of the strips already quantized back into the target of the next one through the block-LDL factor
of the input Hessian H = E[x^T x], which minimises the proxy loss tr(E^T H E) far better than
quantizing every tile on its own. Without a Hessian (no calibration yet) every tile is quantized
independently ("fallback", exactly what the reference does when its Hessian is unusable).

numpy float32/float64 for the linear algebra; the tile encoder is the JAX Viterbi.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable, Sequence

import numpy as np

from ..format.spec import HADAMARD_BLOCK, TILE
from ..trellis.bitstream import pack_codes
from ..trellis.weight import Exl3Weight
from .regularize import (from_tiles, hadamard_left, hadamard_right, random_signs, regularize,
                         to_tiles)
from .viterbi import check_rate, default_backend, encode_tiles

SIGMA_REG = 0.025
LDL_BLOCK = TILE
CHOLESKY_RETRIES = 10


def pad_to(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Zero-pad the trailing edges of x up to ``shape``."""
    out = np.zeros(shape, dtype=x.dtype)
    out[tuple(slice(0, s) for s in x.shape)] = x
    return out


def padded(size: int) -> int:
    return -(-size // HADAMARD_BLOCK) * HADAMARD_BLOCK


@dataclasses.dataclass
class FinalHessian:
    """A usable Hessian after spec 6.2: ``h_reg`` float64 [k, k] (regularised, unrotated) and its
    diagonal ``h_diag`` (for out_scales='auto'), ``h_rot`` float64 [k, k] (sign-flipped and
    block-Hadamard rotated, the metric of the proxy error), ``L`` float64 [k, k] strictly
    block-lower-triangular, ``damp`` the Cholesky retry damping."""
    h_reg: np.ndarray
    h_diag: np.ndarray
    h_rot: np.ndarray
    L: np.ndarray
    damp: float


def finalize_hessian(h_sum: np.ndarray, count: int, su_sign: np.ndarray, *,
                     sigma_reg: float = SIGMA_REG) -> FinalHessian | None:
    """Spec 6.2. h_sum: float [k, k] accumulated X^T X over ``count`` rows (k padded, padded rows
    and columns zero); su_sign float32 [k]. Returns None where the reference falls back to plain
    tile quantization (no rows, non-finite values, or a vanishing diagonal)."""
    if count <= 0:
        return None
    h = np.asarray(h_sum, np.float64) / count
    if not np.all(np.isfinite(h)):
        return None
    diag_mean = float(np.mean(np.diag(h)))
    if not diag_mean >= 1e-20:
        return None
    h = h + sigma_reg * diag_mean * np.eye(h.shape[0])
    damp = 2 * sigma_reg * diag_mean
    # rotate like the weight's input side (signs only, as the reference does)
    h_rot, L = rotate_hessian(h, su_sign, damp)
    return FinalHessian(h_reg=h, h_diag=np.diag(h).copy(), h_rot=h_rot, L=L, damp=damp)


def rotate_hessian(h: np.ndarray, su: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """Bk diag(su) H diag(su) Bk and its block-LDL factor L (float64 [k, k] each).

    The input of W_r is x diag(su) Bk, so with the full su (signs x scales) this is W_r's true
    Hessian; the reference passes the signs only (spec 6.2 step 4, pitfall 6)."""
    su = np.asarray(su, np.float64)
    h = h * su[:, None] * su[None, :]
    h = hadamard_left(hadamard_right(h.astype(np.float32))).astype(np.float64)
    h = 0.5 * (h + h.T)
    return h, block_ldl(h, damp=damp * float(np.mean(su * su)))


def block_ldl(h: np.ndarray, *, block: int = LDL_BLOCK, damp: float = 0.0) -> np.ndarray:
    """H = (I + L) D (I + L)^T with D block-diagonal (16x16 blocks); returns the strictly
    block-lower-triangular L, float64 [k, k].

    Cholesky H = C C^T; right-multiplying every 16-column block of C by the inverse of its
    diagonal block makes C unit block-lower-triangular (= I + L). On failure the diagonal is
    damped by ``damp`` and the factorisation retried, up to 10 times.
    """
    k = h.shape[0]
    for attempt in range(CHOLESKY_RETRIES + 1):
        try:
            c = np.linalg.cholesky(h + attempt * damp * np.eye(k))
            break
        except np.linalg.LinAlgError:
            if attempt == CHOLESKY_RETRIES or damp <= 0:
                raise
    unit = np.empty_like(c)
    for b in range(0, k, block):
        unit[:, b:b + block] = c[:, b:b + block] @ np.linalg.inv(c[b:b + block, b:b + block])
    for b in range(0, k, block):
        unit[b:b + block, b:b + block] = 0.0
    return unit


# tiles float32 [N, 256] -> (states uint16 [N, 256], values float16 [N, 256])
TileEncoder = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def ldlq(items: Sequence[tuple[np.ndarray, np.ndarray | None]],
         encode: TileEncoder) -> list[tuple[np.ndarray, np.ndarray]]:
    """Spec 6.4 for several linears at once. Each item is (W_r float32 [k, n], L float64 [k, k]
    strictly block-lower, or None for plain tile quantization). LDLQ takes strips of 16 rows from
    the last to the first; strip b's target is W_r[b] + sum_{c > b} L[c, b]^T (W_r[c] - W_hat[c]).

    Strips depend on the strips below them in the same linear only, so round r encodes the r-th
    strip of every linear (and, in round 0, every plain linear whole) in one encoder call: a
    layer's 16-row strips are 12-96 tiles each, too few to keep the encoder busy alone. Results
    equal linear-by-linear LDLQ (the encoder is per tile).

    Returns (W_hat float32 [k, n], states uint16 [k/16, n/16, 256]) per item.
    """
    out = [(np.zeros_like(w_r), np.zeros((w_r.shape[0] // TILE, w_r.shape[1] // TILE, 256),
                                         np.uint16)) for w_r, _ in items]
    # W_r - W_hat of the strips done so far, per LDLQ item
    errs = [None if L is None else np.zeros(w_r.shape, np.float64) for w_r, L in items]
    rounds = max([w_r.shape[0] // TILE for w_r, L in items if L is not None] + [1])
    for r in range(rounds):
        parts = []                           # (item, strip or None for all, tiles [tk, tn, 256])
        for i, (w_r, L) in enumerate(items):
            k = w_r.shape[0]
            if L is None:
                if r == 0:
                    parts.append((i, None, to_tiles(w_r)))
                continue
            b = k // TILE - 1 - r
            if b < 0:
                continue
            rows, below = slice(TILE * b, TILE * (b + 1)), slice(TILE * (b + 1), k)
            target = w_r[rows] + (L[below, rows].T @ errs[i][below]).astype(np.float32)
            parts.append((i, b, to_tiles(target)))
        if not parts:
            continue
        states, values = encode(np.concatenate([t.reshape(-1, 256) for _, _, t in parts]))
        lo = 0
        for i, b, tiles in parts:
            tk, tn, _ = tiles.shape
            st = states[lo:lo + tk * tn].reshape(tk, tn, -1)
            q = from_tiles(values[lo:lo + tk * tn].astype(np.float32).reshape(tk, tn, -1))
            lo += tk * tn
            w_hat, all_states = out[i]
            if b is None:
                w_hat[:], all_states[:] = q, st
            else:
                rows = slice(TILE * b, TILE * (b + 1))
                w_hat[rows], all_states[b] = q, st[0]
                errs[i][rows] = items[i][0][rows] - q
    return out


def proxy_error(w_r: np.ndarray, w_hat: np.ndarray, h: np.ndarray | None) -> float:
    """tr(E^T H E) / tr(W_r^T H W_r) with E = W_r - W_hat (H = I without a Hessian)."""
    e = (w_r - w_hat).astype(np.float64)
    w = w_r.astype(np.float64)
    if h is None:
        return float(np.sum(e * e) / np.sum(w * w))
    return float(np.sum(e * (h @ e)) / np.sum(w * (h @ w)))


@dataclasses.dataclass
class QuantizeInfo:
    """What ``quantize_linear`` reports: proxy error, global scale, mode, whether LDLQ ran."""
    proxy_error: float
    g: float
    mode: str
    used_hessian: bool
    out_scales_applied: bool


@dataclasses.dataclass
class LinearInput:
    """One linear for ``quantize_linears``: w float [k_logical, n_logical] (in x out, the transpose
    of an HF Linear.weight); h_sum, h_count: accumulated X^T X [k_logical or padded k, same] over
    h_count input rows, or None for the no-Hessian fallback; seed of the sign flips (int or ints,
    as np.random.default_rng takes; linears sharing an input share the seed, hence su_sign);
    bias float [n_logical] or None."""
    w: np.ndarray
    h_sum: np.ndarray | None = None
    h_count: int = 0
    seed: int | Sequence[int] = 0
    bias: np.ndarray | None = None


def quantize_linears(linears: Sequence[LinearInput], K: float, codebook: str, *,
                     mode: str = "exact", out_scales: str = "always",
                     hessian_scales: bool = False,
                     progress: Callable[[int], None] | None = None
                     ) -> list[tuple[Exl3Weight, QuantizeInfo]]:
    """Quantize linears to EXL3 at one rate: each is regularised (with its own global-scale
    search), then all go through LDLQ together (``ldlq``: one encoder call per round of strips).
    Results equal quantizing them one by one.

    Args:
      linears: the weights, Hessians, seeds and biases (``LinearInput``).
      K: bits per weight (1..8, or 1.5/2.5/3.5 with mul1); codebook "3inst" | "mcg" | "mul1".
      mode: encoder mode, "exact" or "fast" (the global-scale search always uses "fast": it only
        ranks candidate scales; "fast" also searches a narrower sample and walks the scale
        grids instead of sweeping them, ``regularize.search_global_scale_fast``).
      out_scales: "always" | "never" | "auto".
      hessian_scales: False (the reference): LDLQ and the proxy error use H rotated with the
        input signs only. True: with the full input scales su, i.e. W_r's actual Hessian; this
        lowers the real output error where the input-channel scales are uneven (outlier rows).
      progress: called with the number of tiles encoded (scale search and final quantization).
    Returns:
      per linear: (Exl3Weight with numpy leaves: trellis int16 [k/16, n/16, W], suh/svh float16,
      bias, in_features/out_features = the logical sizes; QuantizeInfo).
    """
    K = check_rate(K, codebook)

    def search_quantize(tiles):
        return encode_tiles(tiles, K, codebook, mode="fast", progress=progress)[1]

    def encode(tiles):
        return encode_tiles(tiles, K, codebook, mode=mode, progress=progress)

    with _blas_single_thread_for_cpu_encoder():
        prepared = []
        for lin in linears:
            w = np.asarray(lin.w, np.float32)
            k, n = padded(w.shape[0]), padded(w.shape[1])
            rng = np.random.default_rng(lin.seed)
            su_sign = random_signs(rng, k)
            sv_sign = random_signs(rng, n)
            hessian = None
            if lin.h_sum is not None:
                hessian = finalize_hessian(pad_to(np.asarray(lin.h_sum, np.float64), (k, k)),
                                           lin.h_count, su_sign)
            reg = regularize(pad_to(w, (k, n)), su_sign, sv_sign, search_quantize,
                             out_scales=out_scales,
                             h_diag=None if hessian is None else hessian.h_diag,
                             search_mode=mode)
            if hessian is not None and hessian_scales:
                h_rot, L = rotate_hessian(hessian.h_reg, reg.su, hessian.damp)
                hessian = dataclasses.replace(hessian, h_rot=h_rot, L=L)
            prepared.append((reg, hessian))

        encoded = ldlq([(reg.w_r, None if h is None else h.L) for reg, h in prepared], encode)
        results = []
        for lin, (reg, hessian), (w_hat, states) in zip(linears, prepared, encoded):
            err = proxy_error(reg.w_r, w_hat, None if hessian is None else hessian.h_rot)
            k_log, n_log = np.shape(lin.w)
            n = padded(n_log)
            bias16 = (None if lin.bias is None else
                      pad_to(np.asarray(lin.bias, np.float32), (n,)).astype(np.float16))
            weight = Exl3Weight.create(np.asarray(pack_codes(states, K)),
                                       reg.su.astype(np.float16), reg.sv.astype(np.float16),
                                       codebook, bias16, in_features=k_log, out_features=n_log)
            results.append((weight, QuantizeInfo(proxy_error=err, g=reg.g, mode=mode,
                                                 used_hessian=hessian is not None,
                                                 out_scales_applied=reg.out_scales_applied)))
        return results


def _blas_single_thread_for_cpu_encoder():
    """One BLAS thread while the numba encoder shares the CPU cores with this module's numpy
    work: OpenBLAS workers spin for a while after every call, and between LDLQ rounds that took
    a core from the encoder's next call (default build on 2 cores: encoder 774 -> 1170 tiles/s,
    bench/NOTES.md, "The encoder step as explicit vectors"). The GPU encoder is left alone."""
    if default_backend() != "numba":
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits
    return threadpool_limits(limits=1, user_api="blas")


def quantize_linear(w: np.ndarray, K: float, codebook: str, h_sum: np.ndarray | None = None,
                    h_count: int = 0, *, seed: int | Sequence[int] = 0, mode: str = "exact",
                    out_scales: str = "always", hessian_scales: bool = False,
                    bias: np.ndarray | None = None,
                    progress: Callable[[int], None] | None = None
                    ) -> tuple[Exl3Weight, QuantizeInfo]:
    """``quantize_linears`` of one linear (arguments as ``LinearInput`` and there)."""
    return quantize_linears([LinearInput(w, h_sum, h_count, seed, bias)], K, codebook, mode=mode,
                            out_scales=out_scales, hessian_scales=hessian_scales,
                            progress=progress)[0]
