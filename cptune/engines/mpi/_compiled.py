"""The numpy kernel's passes over elements, compiled (Numba): the softmax pass without the max
shift (exp of a block's scores in place and their row sums, one pass per row while the row is
in cache), the per-call widening of float16 queries, keys and values to float32 with their
norms, and the output's narrowing back to float16.

NumPy's float32 exp took 1.3 ns an element on this project's AVX2 host (4 cycles: as much as
either GEMM per (query, key) pair, a third of a plain call's time), then its sum another pass.
Here exp is Cephes' expf (a round to the nearest power of two, then a degree-7 polynomial on the
remainder, within 2 float32 ulps), written so LLVM vectorises it: the power of two goes into the
exponent's bits in a second loop over the row, as integers.
"""

from __future__ import annotations

import numpy as np

from cptune._numba import compiled

_LOG2E = np.float32(1.4426950408889634)
#: ln 2 in two parts, so ``x - n ln 2`` loses no bits for |n| <= 128 (Cody and Waite).
_LN2_HIGH = np.float32(0.693359375)
_LN2_LOW = np.float32(-2.12194440e-4)
#: Cephes expf's coefficients of r^7 .. r^2 (its polynomial is 1 + r + r^2 p(r)).
_C7, _C6, _C5, _C4, _C3, _C2 = (np.float32(c) for c in (
    1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1))
#: Scores below this count as masked: their exp is 0 (e^-87 = 1.6e-38, the smallest normal
#: float32's order; in the forward a row whose sum falls near it takes the exact path,
#: ``_kernels``).
_SMALLEST_EXPONENT = np.float32(-87.0)
#: Flags LLVM may use: reassociation (the row sum vectorised) and contraction (FMAs), never
#: assuming no NaN or inf (masked scores are -inf).
_FAST = {"contract", "reassoc", "afn", "arcp", "nsz"}
#: Where a float32's exponent starts.
_EXPONENT_SHIFT = np.int32(23)


@compiled(fastmath=_FAST, boundscheck=False, error_model="numpy")
def _exp_row(row: np.ndarray, powers: np.ndarray, row_shift: np.float32) -> np.float32:
    """exp(``row`` - ``row_shift``) in place; returns its sum (NaN, and the row NaN, where a
    NaN is in it). ``powers`` is int32 scratch at least the row's length. The loops run from 0
    over a slice: with the row's bounds as a loop's start LLVM vectorised it badly (3.3 ns an
    element against 0.39)."""
    row_bits = row.view(np.int32)
    nans = np.float32(0.0)
    for j in range(len(row)):
        x = row[j] - row_shift
        nans += np.float32(1.0) if x != x else np.float32(0.0)
        seen = x >= _SMALLEST_EXPONENT
        x = x if seen else _SMALLEST_EXPONENT
        n = np.floor(x * _LOG2E + np.float32(0.5))
        r = x - n * _LN2_HIGH - n * _LN2_LOW
        p = ((((_C7 * r + _C6) * r + _C5) * r + _C4) * r + _C3) * r + _C2
        row[j] = p * r * r + r + np.float32(1.0) if seen else np.float32(0.0)
        powers[j] = np.int32(n) << _EXPONENT_SHIFT if seen else np.int32(0)
    for j in range(len(row)):
        row_bits[j] += powers[j]  # times 2^n: n added to the exponent
    acc = np.float32(0.0)
    for j in range(len(row)):
        acc += row[j]
    if nans > 0:
        row[:] = np.nan
        acc = np.float32(np.nan)
    return acc


@compiled(fastmath=_FAST, boundscheck=False, error_model="numpy")
def exp_rows(scores: np.ndarray, shift: np.ndarray, total: np.ndarray) -> None:
    """exp(``scores`` [rows, keys] - ``shift`` [rows]) in place (C-contiguous float32; each at
    most 88 after the shift), each row's sum added to ``total`` [rows]: the forward's softmax
    pass without the max shift (``shift`` 0, where the scores' bound allows it) and the
    backward's probabilities (``shift`` the final lse; +inf for a row that sees no key). Scores
    below -87 after the shift (masked ones, -inf) give 0; a NaN makes its row and sum NaN (the
    row's softmax is NaN), counted beside the exp as a float so the loop stays vectorised."""
    rows, keys = scores.shape
    powers = np.empty(keys, np.int32)
    for i in range(rows):
        total[i] += _exp_row(scores[i], powers, shift[i])


@compiled(fastmath=_FAST, boundscheck=False, error_model="numpy")
def exp_rows_within(scores: np.ndarray, shift: np.ndarray, total: np.ndarray, first: np.ndarray,
                    stop: np.ndarray) -> None:
    """``exp_rows`` where row i sees only the keys [``first[i]``, ``stop[i]``): the rest become 0
    unread, so a mask whose rows each see one run of a span's keys (a causal diagonal, a
    window's far edge) costs no pass of its own and no exp of what it hides."""
    rows, keys = scores.shape
    powers = np.empty(keys, np.int32)
    for i in range(rows):
        start, end = first[i], stop[i]
        total[i] += _exp_row(scores[i, start:end], powers, shift[i])
        scores[i, :start] = np.float32(0.0)
        scores[i, end:] = np.float32(0.0)


#: float16 bits moved to float32's places (sign kept, exponent and mantissa shifted by 13)
#: read as a float32 this many times too small: one multiply restores them, exactly for normal
#: and subnormal halves alike.
_WIDEN_FACTOR = np.float32(2.0**112)


#: The masks and constants of the widening, as int32: a Python int would widen the integer
#: work to int64, which LLVM did not vectorise (1.8 ns an element against 0.33).
_HALF_MAGNITUDE, _HALF_SIGN = np.int32(0x7FFF), np.int32(0x8000)
_HALF_MANTISSA, _HALF_INF = np.int32(0x3FF), np.int32(0x7C00)
#: float32's infinity, as bits.
_F32_INF = np.int32(0x7F800000)
_SIGN_SHIFT, _PLACE_SHIFT = np.int32(16), np.int32(13)


@compiled(fastmath=_FAST, boundscheck=False, error_model="numpy")
def widen_rows(halves: np.ndarray, out: np.ndarray, scale: np.float32, norms: np.ndarray) -> np.float32:
    """float16 ``halves`` [rows, D] (their bits, uint16) as float32 times ``scale`` into ``out``
    [rows, D] (C-contiguous), each row's norm into ``norms`` [rows]; returns the largest
    magnitude (inf where a value is NaN): the numpy kernel's per-call pass over its queries, keys
    and values, one pass per row (NumPy casts float16 an element at a time; its bit passes and
    the norm took 3 ns an element, as much as a masked call's attention of the same rows). Values
    are NumPy's cast times ``scale`` rounded once; infs and NaNs stay what they are. The largest
    is taken on the halves' bits, whose magnitudes order as their values do (a float maximum
    kept the loop from vectorising)."""
    rows, dim = halves.shape
    bits = out.view(np.int32)
    factor = _WIDEN_FACTOR * scale
    top = np.int32(0)
    for i in range(rows):
        row, row_bits, row_halves = out[i], bits[i], halves[i]
        for j in range(dim):
            h = np.int32(row_halves[j])
            magnitude = h & _HALF_MAGNITUDE
            top = magnitude if magnitude > top else top
            sign = (h & _HALF_SIGN) << _SIGN_SHIFT
            special = sign | _F32_INF | ((magnitude & _HALF_MANTISSA) << _PLACE_SHIFT)  # inf or NaN
            row_bits[j] = sign | (magnitude << _PLACE_SHIFT) if magnitude < _HALF_INF else special
        square = np.float32(0.0)
        for j in range(dim):
            x = row[j] * factor
            row[j] = x
            square += x * x
        norms[i] = np.sqrt(square)
    if top >= _HALF_INF:  # an inf or a NaN
        return np.float32(np.inf)
    largest = np.empty(1, np.int32)
    largest[0] = top << _PLACE_SHIFT
    return largest.view(np.float32)[0] * factor


#: float32 bit patterns (magnitudes) at float16's edges: NaNs above infinity (``_F32_INF``);
#: from 65520 (half way past float16's largest) rounding to infinity; from 2^-14 float16's
#: normals; at most 2^-25 (half its smallest subnormal, a tie to the even 0) zero.
_F32_HALF_OVERFLOW = np.int32(0x477FF000)
_F32_HALF_NORMAL, _F32_HALF_ZERO = np.int32(0x38800000), np.int32(0x33000000)
_REBIAS = np.int32((127 - 15) << 23)
_ROUND_HALF_DOWN, _ONE = np.int32(0xFFF), np.int32(1)
_F32_MAGNITUDE, _F32_MANTISSA, _IMPLICIT_BIT = np.int32(0x7FFFFFFF), np.int32(0x7FFFFF), np.int32(0x800000)
_SUBNORMAL_SHIFT_BASE = np.int32(126)


@compiled(boundscheck=False, error_model="numpy")
def narrow(src: np.ndarray, dst: np.ndarray) -> None:
    """float32 ``src`` into float16 ``dst`` (as its bits, uint16; both 1-D, contiguous), as
    NumPy's cast gives it: rounded to nearest, ties to even, subnormals included, overflow to
    infinity, a NaN's leading payload kept. NumPy casts an element at a time (2.1 ns each): the
    rank's output cast was the largest pass left per call a mask does not shrink."""
    bits = src.view(np.int32)
    for j in range(len(bits)):
        x = bits[j]
        sign = (x >> _SIGN_SHIFT) & _HALF_SIGN
        a = x & _F32_MAGNITUDE
        payload = (a & _F32_MANTISSA) >> _PLACE_SHIFT
        nan = _HALF_INF | (payload if payload != 0 else _ONE)
        normal = (a - _REBIAS + _ROUND_HALF_DOWN + ((a >> _PLACE_SHIFT) & _ONE)) >> _PLACE_SHIFT
        shift = _SUBNORMAL_SHIFT_BASE - (a >> _EXPONENT_SHIFT)
        shift = shift if shift < np.int32(31) else np.int32(31)
        m = (a & _F32_MANTISSA) | _IMPLICIT_BIT
        subnormal = (m + ((_ONE << (shift - _ONE)) - _ONE) + ((m >> shift) & _ONE)) >> shift
        h = normal if a >= _F32_HALF_NORMAL else (subnormal if a > _F32_HALF_ZERO else np.int32(0))
        h = h if a < _F32_HALF_OVERFLOW else _HALF_INF
        h = h if a <= _F32_INF else nan
        dst[j] = np.uint16(sign | h)
