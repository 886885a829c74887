"""Hessian finalisation (spec 6.2), block LDL and LDLQ (spec 6.4), and ``quantize_linear``.

LDLQ quantizes W_r strip by strip (16 input rows at a time, last strip first), feeding the error
of the strips already quantized back into the target of the next one through the block-LDL factor
of the input Hessian H = E[x^T x], which minimises the proxy loss tr(E^T H E) far better than
quantizing every tile on its own. Without a Hessian (no calibration yet) every tile is quantized
independently ("fallback", exactly what the reference does when its Hessian is unusable).

numpy float32/float64 for the linear algebra; the tile encoder is the JAX Viterbi.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import numpy as np

from ..format.spec import HADAMARD_BLOCK, TILE
from ..trellis.bitstream import pack_codes
from ..trellis.weight import Exl3Weight
from .regularize import from_tiles, hadamard_left, hadamard_right, random_signs, regularize, \
    to_tiles
from .viterbi import check_rate, encode_tiles

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


def quantize_plain(w_r: np.ndarray, encode: TileEncoder) -> tuple[np.ndarray, np.ndarray]:
    """Fallback: every tile on its own. w_r float32 [k, n] -> (W_hat float32 [k, n],
    states uint16 [k/16, n/16, 256])."""
    tiles = to_tiles(w_r)
    tk, tn, _ = tiles.shape
    states, values = encode(tiles.reshape(tk * tn, -1))
    return (from_tiles(values.astype(np.float32).reshape(tk, tn, -1)),
            states.reshape(tk, tn, -1))


def ldlq(w_r: np.ndarray, L: np.ndarray, encode: TileEncoder) -> tuple[np.ndarray, np.ndarray]:
    """Spec 6.4: strips of 16 rows from the last to the first; strip b's target is
    W_r[b] + sum_{c > b} L[c, b]^T (W_r[c] - W_hat[c]).

    w_r float32 [k, n], L float64 [k, k] strictly block-lower -> (W_hat float32 [k, n],
    states uint16 [k/16, n/16, 256])."""
    k, n = w_r.shape
    w_hat = np.zeros_like(w_r)
    states = np.zeros((k // TILE, n // TILE, 256), np.uint16)
    err = np.zeros((k, n), np.float64)                 # W_r - W_hat of the strips done so far
    for b in reversed(range(k // TILE)):
        rows = slice(TILE * b, TILE * (b + 1))
        below = slice(TILE * (b + 1), k)
        target = w_r[rows] + (L[below, rows].T @ err[below]).astype(np.float32)
        q, st = quantize_plain(target, encode)
        w_hat[rows], states[b] = q, st[0]
        err[rows] = w_r[rows] - q
    return w_hat, states


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


def quantize_linear(w: np.ndarray, K: float, codebook: str, h_sum: np.ndarray | None = None,
                    h_count: int = 0, *, seed: int | Sequence[int] = 0, mode: str = "exact",
                    out_scales: str = "always", hessian_scales: bool = False,
                    bias: np.ndarray | None = None,
                    progress: Callable[[int], None] | None = None
                    ) -> tuple[Exl3Weight, QuantizeInfo]:
    """Quantize one linear to EXL3.

    Args:
      w: float [k_logical, n_logical] in x out (the transpose of an HF Linear.weight).
      K: bits per weight (1..8, or 1.5/2.5/3.5 with mul1); codebook "3inst" | "mcg" | "mul1".
      h_sum, h_count: accumulated X^T X [k_logical or padded k, same] over h_count input rows,
        or None for the no-Hessian fallback (plain tile quantization of W_r).
      seed: RNG seed (int or ints, as np.random.default_rng takes) of the sign flips (the
        reference seeds with the module index; linears sharing an input share su_sign = the seed).
      mode: encoder mode, "exact" or "fast" (the global-scale search always uses "fast": it only
        ranks candidate scales).
      out_scales: "always" | "never" | "auto".
      hessian_scales: False (the reference): LDLQ and the proxy error use H rotated with the
        input signs only. True: with the full input scales su, i.e. W_r's actual Hessian; this
        lowers the real output error where the input-channel scales are uneven (outlier rows).
      bias: optional float [n_logical], stored fp16 padded to n.
      progress: called with the number of tiles encoded (scale search and final quantization).
    Returns:
      (Exl3Weight with numpy leaves: trellis int16 [k/16, n/16, W], suh/svh float16, bias,
       in_features/out_features = the logical sizes; QuantizeInfo).
    """
    K = check_rate(K, codebook)
    w = np.asarray(w, np.float32)
    k_log, n_log = w.shape
    k, n = padded(k_log), padded(n_log)
    w = pad_to(w, (k, n))
    rng = np.random.default_rng(seed)
    su_sign = random_signs(rng, k)
    sv_sign = random_signs(rng, n)

    hessian = None
    if h_sum is not None:
        hessian = finalize_hessian(pad_to(np.asarray(h_sum, np.float64), (k, k)), h_count,
                                   su_sign)

    def search_quantize(tiles):
        return encode_tiles(tiles, K, codebook, mode="fast", progress=progress)[1]

    def encode(tiles):
        return encode_tiles(tiles, K, codebook, mode=mode, progress=progress)

    reg = regularize(w, su_sign, sv_sign, search_quantize, out_scales=out_scales,
                     h_diag=None if hessian is None else hessian.h_diag)
    if hessian is not None and hessian_scales:
        h_rot, L = rotate_hessian(hessian.h_reg, reg.su, hessian.damp)
        hessian = dataclasses.replace(hessian, h_rot=h_rot, L=L)
    if hessian is None:
        w_hat, states = quantize_plain(reg.w_r, encode)
    else:
        w_hat, states = ldlq(reg.w_r, hessian.L, encode)
    err = proxy_error(reg.w_r, w_hat, None if hessian is None else hessian.h_rot)

    trellis = np.asarray(pack_codes(states, K))
    bias16 = None if bias is None else pad_to(np.asarray(bias, np.float32), (n,)).astype(np.float16)
    weight = Exl3Weight.create(trellis, reg.su.astype(np.float16), reg.sv.astype(np.float16),
                               codebook, bias16, in_features=k_log, out_features=n_log)
    return weight, QuantizeInfo(proxy_error=err, g=reg.g, mode=mode,
                                used_hessian=hessian is not None,
                                out_scales_applied=reg.out_scales_applied)
