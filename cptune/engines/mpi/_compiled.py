"""The numpy kernel's softmax pass without the max shift, compiled (Numba): exp of a block's
scores in place and their row sums, in one pass per row while the row is in cache.

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


@compiled(fastmath=_FAST, boundscheck=False, error_model="numpy")
def exp_rows(scores: np.ndarray, shift: np.ndarray, total: np.ndarray) -> None:
    """exp(``scores`` [rows, keys] - ``shift`` [rows]) in place (C-contiguous float32; each at
    most 88 after the shift), each row's sum added to ``total`` [rows]: the forward's softmax
    pass without the max shift (``shift`` 0, where the scores' bound allows it) and the
    backward's probabilities (``shift`` the final lse; +inf for a row that sees no key). Scores
    below -87 after the shift (masked ones, -inf) give 0; a NaN makes its row and sum NaN (the
    row's softmax is NaN), counted beside the exp as a float so the loop stays vectorised."""
    rows, keys = scores.shape
    bits = scores.view(np.int32)
    powers = np.empty(keys, np.int32)
    for i in range(rows):
        row, row_bits, row_shift = scores[i], bits[i], shift[i]
        nans = np.float32(0.0)
        for j in range(keys):
            x = row[j] - row_shift
            nans += np.float32(1.0) if x != x else np.float32(0.0)
            seen = x >= _SMALLEST_EXPONENT
            x = x if seen else _SMALLEST_EXPONENT
            n = np.floor(x * _LOG2E + np.float32(0.5))
            r = x - n * _LN2_HIGH - n * _LN2_LOW
            p = ((((_C7 * r + _C6) * r + _C5) * r + _C4) * r + _C3) * r + _C2
            row[j] = p * r * r + r + np.float32(1.0) if seen else np.float32(0.0)
            powers[j] = np.int32(n) << 23 if seen else 0
        for j in range(keys):
            row_bits[j] += powers[j]  # times 2^n: n added to the exponent
        acc = np.float32(0.0)
        for j in range(keys):
            acc += row[j]
        if nans > 0:
            row[:] = np.nan
            acc = np.float32(np.nan)
        total[i] += acc
