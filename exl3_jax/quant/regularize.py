"""Weight regularisation before trellis quantization (spec 6.3), numpy float32.

W (k x n, in x out, both multiples of 128) is turned into the rotated, rescaled W_r that the tile
encoder sees, together with the channel vectors su [k] and sv [n] such that, exactly,

    W = diag(su) . Bk . W_r . Bn . diag(sv)        (Bk, Bn: block Hadamards of 128, H = H^T = H^-1)

so the decoder's formula (spec 4.1) with W_hat ~ W_r reproduces W. The rotations spread outliers
over 128 channels (making entries near-Gaussian), the channel scales equalise rows and columns, the
-1/1.24371088 factor matches the rows' RMS to the codebook's std, and a global scale g found by a
small search over sample tiles trades clipping against granularity for the actual codebook.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np

from ..format.spec import HADAMARD_BLOCK, TILE, TILE_WEIGHTS
from ..trellis.bitstream import tile_perm
from ..trellis.hadamard import hadamard_matrix

CODEBOOK_SCALE = 1.24371088          # std of the 3INST codebook; used for every codebook
ZERO_CHANNEL_SCALE = 0.1             # divisor used for all-zero rows/columns
OUT_SCALE_MODES = ("always", "never", "auto")
COARSE_SCALES = np.arange(0.1, 1.9 + 1e-9, 0.2)     # 0.1, 0.3, ..., 1.9
FINE_STEP = 0.075
MIN_SCALE = 0.01
# where the fast search starts on the coarse grid (the usual optimum once rows are scaled)
FAST_SEARCH_START = 0.9


def hadamard_right(w: np.ndarray) -> np.ndarray:
    """W . Bn: H128 applied to every 128-block of the last axis. float32 [..., n] -> same."""
    *lead, n = w.shape
    blocks = w.reshape(*lead, n // HADAMARD_BLOCK, HADAMARD_BLOCK)
    return (blocks @ hadamard_matrix()).reshape(w.shape).astype(np.float32)


def hadamard_left(w: np.ndarray) -> np.ndarray:
    """Bk . W: H128 on every 128-block of the first axis. float32 [k, n] -> [k, n]."""
    return hadamard_right(np.ascontiguousarray(w.T)).T.copy()


def random_signs(rng: np.random.Generator, size: int) -> np.ndarray:
    """float32 [size] of +-1."""
    return np.where(rng.random(size) < 0.5, -1.0, 1.0).astype(np.float32)


def to_tiles(w: np.ndarray) -> np.ndarray:
    """float [k, n] -> [k/16, n/16, 256]: tile (tk, tn) in sequence (tile_perm) order."""
    k, n = w.shape
    t = w.reshape(k // TILE, TILE, n // TILE, TILE).transpose(0, 2, 1, 3)
    return t.reshape(k // TILE, n // TILE, TILE_WEIGHTS)[..., tile_perm()]


def from_tiles(tiles: np.ndarray) -> np.ndarray:
    """Inverse of ``to_tiles``: [tk, tn, 256] (sequence order) -> [16 tk, 16 tn]."""
    tk, tn, _ = tiles.shape
    pos = np.empty_like(tiles)
    pos[..., tile_perm()] = tiles
    return pos.reshape(tk, tn, TILE, TILE).transpose(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


def channel_rms(w: np.ndarray, axis: int) -> np.ndarray:
    """Root mean square along ``axis`` (float32)."""
    return np.sqrt(np.mean(np.square(w, dtype=np.float64), axis=axis)).astype(np.float32)


def input_is_regular(h_diag: np.ndarray | None) -> bool:
    """out_scales='auto' rule: the top 2% of sqrt(diag H) hold less than 15% of its sum."""
    if h_diag is None:
        return True
    r = np.sort(np.sqrt(np.maximum(h_diag, 0.0)))[::-1]
    top = max(1, int(round(0.02 * r.size)))
    return float(r[:top].sum()) < 0.15 * float(r.sum())


def scale_sample_tiles(w_r: np.ndarray, width: int = 3) -> np.ndarray:
    """Tiles the global-scale search looks at: a wrapped tile diagonal of ``width`` (3, as the
    reference) plus the highest- and lowest-RMS tiles. float32 [k, n] -> [S, 256] (sequence
    order)."""
    tiles = to_tiles(w_r)
    tk, tn, _ = tiles.shape
    picks = {(i, (i + d) % tn) for i in range(tk) for d in range(width)}
    rms = np.sqrt(np.mean(np.square(tiles), axis=-1))
    picks.add(np.unravel_index(np.argmax(rms), rms.shape))
    picks.add(np.unravel_index(np.argmin(rms), rms.shape))
    return np.stack([tiles[i, j] for i, j in sorted(picks)])


def search_width(mode: str) -> int:
    """Diagonal width of the global-scale search sample for an encoder mode: the reference's 3
    for "exact"; 1 for "fast", where it cuts the search by 64% and moves the body error by under
    1% (bench/NOTES.md, encoder_scale_search_sample_cpu_2026-12-03.json)."""
    return 1 if mode == "fast" else 3


def estimate_search_tiles(tk: int, tn: int, mode: str = "exact") -> int:
    """Tiles the global-scale search of ``mode`` encodes for a [16 tk, 16 tn] weight (for progress
    bars: the two extreme-RMS tiles may coincide with the diagonal, and the fast search walks
    further when the optimum is off its start, so this is approximate)."""
    width = search_width(mode)
    picks = len({(i, (i + d) % tn) for i in range(tk) for d in range(width)}) + 2
    coarse, fine = (3, 3) if mode == "fast" else (len(COARSE_SCALES), 5)
    return coarse * (-(-picks // 3)) + fine * picks


# an encoder for the search: tiles float32 [N, 256] -> decoded values [N, 256]
TileQuantizer = Callable[[np.ndarray], np.ndarray]


def scale_errors(tiles: np.ndarray, scales: np.ndarray, quantize: TileQuantizer) -> np.ndarray:
    """mean((Q(tiles * s) / s - tiles)^2) for every s, in one encoder call.

    tiles float32 [N, 256]; scales [S] -> float64 [S]."""
    scaled = np.concatenate([tiles * np.float32(s) for s in scales])
    q = quantize(scaled).astype(np.float32).reshape(len(scales), *tiles.shape)
    err = q / scales.astype(np.float32)[:, None, None] - tiles[None]
    return np.mean(np.square(err, dtype=np.float64), axis=(1, 2))


def search_global_scale(tiles: np.ndarray, quantize: TileQuantizer) -> float:
    """Spec 6.3 step 7: coarse grid over every 3rd tile, 5-point fine grid around its best on all
    sample tiles, then a parabola through the best fine point and its neighbours (the offset
    clipped to half a step). Returns g >= 0.01."""
    coarse = scale_errors(tiles[::3], COARSE_SCALES, quantize)
    best = float(COARSE_SCALES[int(np.argmin(coarse))])
    fine = np.maximum(best + FINE_STEP * np.arange(-2, 3), MIN_SCALE)
    return _parabola_refine(fine, scale_errors(tiles, fine, quantize))


def search_global_scale_fast(tiles: np.ndarray, quantize: TileQuantizer) -> float:
    """The fast mode's search: the same grids, walked downhill instead of swept. The error is
    unimodal in g (every linear of two SmolLM2 layers: it rises on both sides of one coarse
    minimum, 0.9 in 13 of 14, 0.7 once), so the coarse grid is evaluated at its points next to
    FAST_SEARCH_START and then one point further at a time while the best is at an end, and the
    fine grid grows from its middle 3 points the same way. Typically 3 coarse + 3 fine scales
    instead of 10 + 5: about half the encoder work. Returns g >= 0.01."""
    start = int(np.argmin(np.abs(COARSE_SCALES - FAST_SEARCH_START)))
    coarse = _walk_downhill(lambda idx: scale_errors(tiles[::3], COARSE_SCALES[idx], quantize),
                            len(COARSE_SCALES), start)
    best = float(COARSE_SCALES[min(coarse, key=coarse.get)])
    fine_grid = np.maximum(best + FINE_STEP * np.arange(-2, 3), MIN_SCALE)
    fine = _walk_downhill(lambda idx: scale_errors(tiles, fine_grid[idx], quantize),
                          len(fine_grid), 2)
    lo, hi = min(fine), max(fine)                      # a contiguous run of evaluated points
    return _parabola_refine(fine_grid[lo:hi + 1], np.array([fine[i] for i in range(lo, hi + 1)]))


def _walk_downhill(errors_at: Callable[[np.ndarray], np.ndarray], n: int,
                   start: int) -> dict[int, float]:
    """Errors at grid indices start-1..start+1, then at one more index past whichever end holds
    the minimum, until the minimum is inside or at the grid's end. Returns {index: error}."""
    idx = np.arange(max(start - 1, 0), min(start + 2, n))
    errs = dict(zip(idx.tolist(), errors_at(idx).tolist()))
    while True:
        best, lo, hi = min(errs, key=errs.get), min(errs), max(errs)
        step = lo - 1 if best == lo and lo > 0 else hi + 1 if best == hi and hi < n - 1 else None
        if step is None:
            return errs
        errs[step] = float(errors_at(np.array([step]))[0])


def _parabola_refine(grid: np.ndarray, err: np.ndarray) -> float:
    """The best of ``grid`` (equally spaced by FINE_STEP), moved to the vertex of the parabola
    through it and its neighbours when it has both (offset clipped to half a step)."""
    i = int(np.argmin(err))
    g = float(grid[i])
    if 0 < i < len(grid) - 1:
        e0, e1, e2 = err[i - 1], err[i], err[i + 1]
        denom = e0 - 2 * e1 + e2
        if denom > 0:
            offset = 0.5 * (e0 - e2) / denom            # vertex of the parabola, in steps
            g += float(np.clip(offset, -0.5, 0.5)) * FINE_STEP
    return max(g, MIN_SCALE)


@dataclasses.dataclass
class Regularized:
    """W_r float32 [k, n] (what the tiles encode), su float32 [k], sv float32 [n] with
    W = diag(su) Bk W_r Bn diag(sv); g the global scale; out_scales_applied."""
    w_r: np.ndarray
    su: np.ndarray
    sv: np.ndarray
    g: float
    out_scales_applied: bool


def regularize(w: np.ndarray, su_sign: np.ndarray, sv_sign: np.ndarray,
               quantize: TileQuantizer | None, *, out_scales: str = "always",
               h_diag: np.ndarray | None = None, search_mode: str = "exact") -> Regularized:
    """Spec 6.3 on a padded weight.

    Args:
      w: float32 [k, n] (in x out), k and n multiples of 128.
      su_sign, sv_sign: float32 [k], [n] random signs (su_sign is shared with the Hessian).
      quantize: tile encoder for the global-scale search, or None to skip the search (g = 1).
      out_scales: "always" | "never" | "auto" (auto: apply when ``input_is_regular(h_diag)``).
      h_diag: diag of the regularised Hessian (before rotation), for "auto".
      search_mode: "exact" (the reference's search, ``search_global_scale``, on a width-3
        sample) or "fast" (``search_global_scale_fast`` on a width-1 sample; ``search_width``).
    """
    if out_scales not in OUT_SCALE_MODES:
        raise ValueError(f"out_scales must be one of {OUT_SCALE_MODES}")
    w = np.asarray(w, np.float32)
    k, n = w.shape
    if k % HADAMARD_BLOCK or n % HADAMARD_BLOCK:
        raise ValueError(f"weight {w.shape} is not padded to multiples of {HADAMARD_BLOCK}")

    # output channels: sign x RMS (normalised by the mean); all-zero columns divide by 0.1 and
    # end up with sv = 0, so padded outputs decode to exact zeros
    oc = channel_rms(w, axis=0)
    zero_cols = oc == 0
    apply = out_scales == "always" or (out_scales == "auto" and input_is_regular(h_diag))
    if apply and np.any(~zero_cols):
        oc = oc / np.mean(oc)
        sv = sv_sign * (np.where(zero_cols, ZERO_CHANNEL_SCALE, oc) + 1e-10)
    else:
        sv = sv_sign.copy()
    w = hadamard_right(w / sv[None, :])
    sv = np.where(zero_cols, 0.0, sv).astype(np.float32)

    # input channels: rows end with RMS = codebook std; note the minus sign (as the reference)
    ic = channel_rms(w, axis=1)
    ic = np.where(ic == 0, ZERO_CHANNEL_SCALE, ic)
    su = (su_sign * ic / -CODEBOOK_SCALE).astype(np.float32)
    w_r = hadamard_left(w / su[:, None])

    search = search_global_scale_fast if search_mode == "fast" else search_global_scale
    g = 1.0 if quantize is None else search(
        scale_sample_tiles(w_r, search_width(search_mode)), quantize)
    return Regularized(w_r=(w_r * np.float32(g)).astype(np.float32),
                       su=(su / np.float32(g)).astype(np.float32), sv=sv, g=g,
                       out_scales_applied=bool(apply))
