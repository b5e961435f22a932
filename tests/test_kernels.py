"""The numpy attention kernel and merge, against the float64 reference, on their edges."""

import numpy as np
import pytest

from cptune import Workload
from cptune import kernels as work
from cptune.engines.mpi import _kernels as kernels
from cptune.layout import position_runs
from cptune.masks import Mask
from cptune.reference import make_inputs, reference_attention, reference_gradients, relative_error


def run(workload, q, k, v, **options):
    """Kernel on full sequences in the internal layout, back to [batch, seq, heads, dim]."""
    positions = np.arange(workload.seq_len)
    kv = np.stack([k, v]).transpose(0, 1, 3, 2, 4)
    out, lse = kernels.attention(q.transpose(0, 2, 1, 3), kv, positions, positions,
                                 mask=workload.mask, **options)
    return out.transpose(0, 2, 1, 3), lse


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("magnitude", [1.0, 40.0], ids=["unshifted-exp", "exact-path"])
def test_both_softmax_paths_match_reference(causal, magnitude):
    """Large logits (|q||k| beyond the safe bound) must take the max-shifted path and still
    be right; ordinary ones take the unshifted path."""
    workload = Workload(seq_len=300, heads=2, head_dim=16, dtype="fp32", causal=causal)
    q, k, v = make_inputs(workload, seed=1)
    q = q * np.float32(magnitude)
    out, lse = run(workload, q, k, v)
    assert np.all(np.isfinite(lse))
    assert relative_error(out, reference_attention(workload, q, k, v)) < 2e-5


def test_key_chunks_are_merged(monkeypatch):
    monkeypatch.setattr(work, "KEY_CHUNK", 64)
    workload = Workload(seq_len=200, heads=3, head_dim=8, kv_heads=1, dtype="fp32", causal=True)
    q, k, v = make_inputs(workload, seed=2)
    out, _ = run(workload, q, k, v)
    assert relative_error(out, reference_attention(workload, q, k, v)) < 2e-5


def test_key_chunks_are_as_few_as_fit_and_of_one_size():
    for keys in (1, 2047, 2048, 2049, 3072, 4096, 5000, 8192):
        size = work.key_chunk(keys)
        chunks = -(-keys // size)
        assert size <= work.KEY_CHUNK, keys
        assert chunks == -(-keys // work.KEY_CHUNK), keys
        assert chunks * size - keys < chunks, keys  # the last chunk short by less than one key per chunk
    assert work.key_chunk(3072) == 1536


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_threads_give_the_same_result(dtype):
    workload = Workload(seq_len=129, heads=4, head_dim=16, kv_heads=2, batch=2, dtype=dtype)
    q, k, v = make_inputs(workload, seed=3)
    one, _ = run(workload, q, k, v, threads=1)
    two, _ = run(workload, q, k, v, threads=2)
    np.testing.assert_array_equal(one, two)


def test_rows_that_see_no_key():
    """Queries before every key (causal) get output 0 and log-sum-exp -inf, and merging
    such a partial changes nothing."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 1, 4, 8), dtype=np.float32)
    kv = rng.standard_normal((2, 1, 1, 4, 8), dtype=np.float32)
    q_pos, k_pos = np.arange(0, 4), np.arange(2, 6)  # queries 0, 1 see none of keys 2..5
    out, lse = kernels.attention(q, kv, q_pos, k_pos, mask=Mask(10, True))
    assert np.all(out[..., :2, :] == 0) and np.all(np.isneginf(lse[..., :2]))
    assert np.all(np.isfinite(lse[..., 2:]))
    empty = (np.zeros_like(out), np.full_like(lse, -np.inf))
    merged_out, merged_lse = kernels.merge((out.copy(), lse.copy()), empty)
    np.testing.assert_allclose(merged_out, out)
    np.testing.assert_array_equal(merged_lse, lse)


def test_padding_keys_are_ignored():
    """Keys at positions >= seq_len carry garbage and must not change the result."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 2, 6, 8), dtype=np.float32)
    kv = rng.standard_normal((2, 1, 2, 8, 8), dtype=np.float32)
    q_pos, k_pos = np.arange(6), np.arange(8)
    clean, _ = kernels.attention(q, kv[..., :6, :], q_pos, k_pos[:6], mask=Mask(6, False))
    kv[..., 6:, :] = 1e4
    padded, _ = kernels.attention(q, kv, q_pos, k_pos, mask=Mask(6, False))
    np.testing.assert_allclose(padded, clean, rtol=1e-6)


def test_position_runs():
    assert position_runs(np.array([0, 1, 2, 7, 8, 3])) == [(0, 3), (3, 5), (5, 6)]


def planned_pairs(q_pos, k_pos, causal, seq_len):
    """(query, key) pairs the kernel's plan computes, block by block, chunk by chunk."""
    total = 0
    for chunk in work.chunk_slices(len(k_pos)):
        for i, j, segments in kernels._plan(q_pos, k_pos[chunk], Mask(seq_len, causal)):
            total += (j - i) * sum(stop - first for first, stop, _ in segments)
    return total


def test_computed_pairs_count_what_the_plan_computes():
    """Counted by runs, the pairs equal the plan's own, over random orders of position runs
    (zigzag-like pieces, several key chunks, padding), with and without a causal mask."""
    rng = np.random.default_rng(6)
    for _ in range(60):
        length = int(rng.integers(1, 7000))
        cuts = np.sort(rng.choice(np.arange(1, length), size=min(length - 1, int(rng.integers(0, 5))),
                                  replace=False))
        pieces = np.split(np.arange(length), cuts)
        k_pos = np.concatenate([pieces[i] for i in rng.permutation(len(pieces))])
        chosen = rng.choice(len(pieces), size=int(rng.integers(1, len(pieces) + 1)), replace=False)
        q_pos = np.concatenate([pieces[i] for i in chosen])
        seq_len = length - int(rng.integers(0, min(length, 40)))
        runs = [[(int(p[a]), b - a) for a, b in position_runs(p)] for p in (q_pos, k_pos)]
        for causal in (False, True):
            counted = work.computed_pairs(*runs, causal, seq_len)
            assert counted == planned_pairs(q_pos, k_pos, causal, seq_len)


def test_a_causal_block_computes_its_masked_corner():
    """1024 causal positions in row blocks of 512: the first block sees keys 0..511, the
    second all 1024, so 3/4 of the square is computed where only half is visible."""
    assert work.rows_per_block(1024) == 512
    assert work.computed_pairs([(0, 1024)], [(0, 1024)], True, 1024) == 512 * 512 + 512 * 1024


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_per_call_passes_share_slices_between_threads_and_match_numpy(threads):
    """The kernel's passes over memory, split over threads, give numpy's whole-array
    results: casts float16 -> float32 (K, V, a chunk's strided view) and float32 -> float16
    (the output), Q scaled with its row norms, K's norms and the values' largest magnitude,
    and the merge of two partials; an array already in the dtype is returned as is."""
    rng = np.random.default_rng(6)
    wide = rng.standard_normal((2, 3, 5, 8), dtype=np.float32)
    narrow = wide.astype(np.float16)
    chunk = narrow[..., 1:4, :]
    np.testing.assert_array_equal(kernels.cast(chunk, np.dtype(np.float32), threads),
                                  chunk.astype(np.float32))
    np.testing.assert_array_equal(kernels.cast(wide, np.dtype(np.float16), threads), narrow)
    assert kernels.cast(wide, np.dtype(np.float32), threads) is wide

    scaled, norms = kernels.prepare_query(narrow, threads)
    expected = narrow.astype(np.float32) * np.float32(1 / np.sqrt(8))
    np.testing.assert_array_equal(scaled, expected)
    np.testing.assert_allclose(norms, np.linalg.norm(expected, axis=-1), rtol=1e-6)

    kv = np.stack([narrow, 3 * narrow])
    keys, values, key_norms, small = kernels._prepare_keys(kv, threads)
    np.testing.assert_array_equal(values, (3 * narrow).astype(np.float32))
    np.testing.assert_allclose(key_norms, np.linalg.norm(narrow.astype(np.float32), axis=-1), rtol=1e-6)
    assert small
    assert not kernels._prepare_keys(np.stack([wide, wide * 1e7]), threads)[3]

    lse_a, lse_b = rng.standard_normal((2, 2, 3, 5), dtype=np.float32)
    out_a, out_b = wide.copy(), 2 * wide
    merged, lse = kernels.merge((out_a, lse_a), (out_b, lse_b), threads)
    total = np.logaddexp(lse_a, lse_b)
    np.testing.assert_allclose(lse, total)
    np.testing.assert_allclose(merged, wide * np.exp(lse_a - total)[..., None]
                               + 2 * wide * np.exp(lse_b - total)[..., None], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", [1.0, 1 / np.sqrt(64), 1 / np.sqrt(96)])
def test_widening_halves_by_bits_matches_numpy_s_cast_on_every_half(scale):
    """``_to_float32`` from float16 (``widen_rows``, compiled) gives numpy's float16 -> float32
    cast times a float32 scale bit for bit on every half - subnormals, -0, infs and NaNs
    included - on a strided view too, each row's norm as numpy's, and the largest magnitude
    (inf once a NaN is among them)."""
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    finite = halves[np.isfinite(halves)]
    for src in (halves.reshape(-1, 64), finite[: len(finite) // 64 * 64].reshape(-1, 64)[::3],
                finite.reshape(-1, 8)[:, 1:6]):
        dst, norms = np.empty(src.shape, np.float32), np.empty(len(src), np.float32)
        largest = kernels._to_float32(src, dst, scale, norms)
        with np.errstate(invalid="ignore", over="ignore"):
            expected = np.multiply(src, np.float32(scale), dtype=np.float32)
            expected_norms = np.sqrt(np.einsum("sd,sd->s", expected, expected))
        same = (dst.view(np.uint32) == expected.view(np.uint32)) | (np.isnan(dst) & np.isnan(expected))
        assert same.all()
        np.testing.assert_allclose(norms, expected_norms, rtol=2e-6)
        held = np.abs(expected)
        assert largest == (np.inf if np.isnan(held).any() else held.max())


def test_narrowing_to_halves_by_bits_matches_numpy_s_cast_at_every_rounding_edge():
    """``cast`` to float16 (``narrow``, compiled) gives numpy's float32 -> float16 cast bit for
    bit on every half, its float32 neighbours and the midpoints between halves (ties to even,
    subnormals, overflow to inf, NaN payloads), and on a million random bit patterns."""
    halves = np.arange(65536, dtype=np.uint16).view(np.float16)
    exact = halves.astype(np.float32).view(np.uint32).astype(np.int64)
    finite = halves[np.isfinite(halves)].astype(np.float64)
    between = np.sort(finite)
    middles = ((between[1:] + between[:-1]) / 2).astype(np.float32).view(np.uint32).astype(np.int64)
    patterns = [exact + step for step in (-2, -1, 0, 1, 2)] + [middles + step for step in (-1, 0, 1)]
    patterns.append(np.random.default_rng(3).integers(0, 2**32, 2**20))
    bits = np.concatenate(patterns).astype(np.uint32)
    src = bits[: len(bits) // 8 * 8].view(np.float32).reshape(2, 1, -1, 4)
    with np.errstate(all="ignore"):
        expected = src.astype(np.float16)
    got = kernels.cast(src, np.dtype(np.float16), threads=2)
    np.testing.assert_array_equal(got.view(np.uint16), expected.view(np.uint16))


@pytest.mark.parametrize("masking", [
    {"documents": [700, 300, 1048], "causal": True},
    {"window": [300, 0], "causal": True},
    {"window": [200, 0], "sinks": 4, "causal": True},
    {"documents": [1024, 1024], "window": [128, 0], "causal": True},
])
def test_the_numpy_kernel_masks_only_the_segments_the_mask_cuts(masking):
    """A segment every query of its block sees runs unmasked; a masked one holds a pair the
    mask hides; and they cover exactly the keys some query sees."""
    from cptune.calls import kernel_blocks

    mask = Workload(2048, heads=1, head_dim=16, **masking).mask
    positions = np.arange(2048)
    for start, stop, segments in kernel_blocks(positions, positions, mask):
        q = positions[start:stop, None]
        masked_pairs = 0
        covered = np.zeros(2048, bool)
        for lo, hi, masked in segments:
            seen = mask.visible(q, positions[None, lo:hi])
            assert seen.any(axis=0).all()
            assert seen.all() != masked
            masked_pairs += masked * seen.size
            covered[lo:hi] = True
        assert (covered == mask.visible(q, positions[None, :]).any(axis=0)).all()
        # at most a diagonal square and a window's far edge; before, a block deep in a causal
        # document masked every key back to the document's start
        assert masked_pairs <= 2 * (stop - start) ** 2


@pytest.mark.parametrize("masking", [
    {"documents": [150, 30, 20], "causal": True},
    {"window": [90, 0], "causal": True},
    {"window": [70, 20], "sinks": 3, "documents": [120, 80]},
])
def test_a_masked_block_that_sees_more_than_a_chunk_is_cut_into_equal_runs(monkeypatch, masking):
    """Under a window or documents the plan spans all keys, and a block that sees more than
    ``KEY_CHUNK`` (64 here) reads them in runs of ``key_chunk`` keys: the runs of one row
    block cover what it would read uncut, each once, and forward and gradients still match
    the float64 reference."""
    from cptune.calls import kernel_blocks

    workload = Workload(200, heads=2, head_dim=8, kv_heads=1, dtype="fp32", **masking)
    positions = np.arange(200)
    uncut = {(i, j): segments for i, j, segments in kernel_blocks(positions, positions, workload.mask)}
    monkeypatch.setattr(work, "KEY_CHUNK", 64)
    cut: dict[tuple[int, int], list[np.ndarray]] = {}
    for i, j, segments in kernel_blocks(positions, positions, workload.mask):
        keys = np.concatenate([np.arange(lo, hi) for lo, hi, _ in segments])
        assert len(keys) <= 64
        cut.setdefault((i, j), []).append(keys)
    assert cut.keys() == uncut.keys()
    widest = 0
    for rows, runs in cut.items():
        whole = np.concatenate([np.arange(lo, hi) for lo, hi, _ in uncut[rows]])
        np.testing.assert_array_equal(np.concatenate(runs), whole)
        assert len({len(run) for run in runs[:-1]}) <= 1 and len(runs[-1]) <= len(runs[0])
        widest = max(widest, len(whole))
    assert widest > 64  # some block was cut
    q, k, v = make_inputs(workload, seed=4)
    out, _ = run(workload, q, k, v)
    assert relative_error(out, reference_attention(workload, q, k, v)) < 2e-5
    dout = np.random.default_rng(5).standard_normal(q.shape).astype(np.float32)
    kv = np.stack([k, v]).transpose(0, 1, 3, 2, 4)
    final, lse = kernels.attention(q.transpose(0, 2, 1, 3), kv, positions, positions, mask=workload.mask)
    dq, dkv = kernels.attention_grad(q.transpose(0, 2, 1, 3), kv, final, lse, dout.transpose(0, 2, 1, 3),
                                     positions, positions, mask=workload.mask)
    grads = (dq, dkv[0], dkv[1])
    for got, ref in zip(grads, reference_gradients(workload, q, k, v, dout), strict=True):
        assert relative_error(got.transpose(0, 2, 1, 3), ref) < 2e-5


@pytest.mark.parametrize("masking", [
    {"causal": True, "documents": [40, 60, 100]},
    {"causal": True, "window": [17, 0]},
    {"window": [9, 23]},
    {"causal": True, "window": [30, 0], "sinks": 3, "documents": [120, 80]},
    {"window": [30, 12], "sinks": 5, "documents": [150, 50]},
])
def test_a_banded_segments_mask_is_the_rules(masking):
    """The kernel's one-pass mask over consecutive positions of one document hides exactly
    the pairs ``Mask.visible`` does not show: on random ranges and on every masked segment the
    kernel plans (sinks a causal query must not see yet among them)."""
    from cptune.calls import kernel_blocks

    mask = Workload(200, heads=1, head_dim=8, **masking).mask
    positions = np.arange(200)
    for start, stop, segments in kernel_blocks(positions, positions, mask):
        q = positions[start:stop]
        for lo, hi, masked in segments:
            if masked:
                assert kernels._banded(mask, q, positions[lo:hi])
                hidden = ~mask.visible(q[:, None], positions[None, lo:hi])
                assert (kernels._hidden(mask, q, positions[lo:hi]) == hidden).all()
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(300):
        a, b = sorted(rng.integers(0, 200, 2))
        c, d = sorted(rng.integers(0, 200, 2))
        q, k = np.arange(a, b + 1), np.arange(c, d + 1)
        if kernels._banded(mask, q, k):
            checked += 1
            assert (kernels._hidden(mask, q, k) == ~mask.visible(q[:, None], k[None, :])).all()
    assert checked > 10


def reference_with_lse(q, kv, q_pos, k_pos, mask):
    """Output and log-sum-exp in float64 of the kernel's internal layout, under ``mask``."""
    q64, k64, v64 = (x.astype(np.float64) for x in (q[0], kv[0, 0], kv[1, 0]))
    scores = q64 @ k64.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
    scores = np.where(mask.visible(q_pos[:, None], k_pos[None, :]), scores, -np.inf)
    lse = np.logaddexp.reduce(scores, axis=-1)
    with np.errstate(invalid="ignore"):  # rows that see no key: NaN, not compared
        return np.exp(scores - lse[..., None]) @ v64, lse


@pytest.mark.parametrize("order", ["exact-first", "unshifted-first"])
def test_running_sums_of_both_softmax_paths_meet_across_key_chunks(monkeypatch, order):
    """Key chunks of 64 whose blocks take different paths (one chunk's keys large enough to
    need the max shift, pulling the scores far up or far down), added into each row's
    running sums: output and log-sum-exp match the float64 reference."""
    monkeypatch.setattr(work, "KEY_CHUNK", 64)
    rng = np.random.default_rng(8)
    q = rng.standard_normal((1, 2, 50, 16), dtype=np.float32)
    kv = rng.standard_normal((2, 1, 2, 192, 16), dtype=np.float32)
    large = slice(0, 64) if order == "exact-first" else slice(128, 192)
    kv[0, ..., large, :] = 30 * np.sign(rng.standard_normal((1, 2, 64, 1))) * q[..., :1, :]
    q_pos, k_pos = np.arange(50), np.arange(192)
    mask = Mask(192, False)
    shifted = []
    real = kernels._attend_shifted
    monkeypatch.setattr(kernels, "_attend_shifted", lambda block: shifted.append(1) or real(block))
    out, lse = kernels.attention(q, kv, q_pos, k_pos, mask=mask)
    ref_out, ref_lse = reference_with_lse(q, kv, q_pos, k_pos, mask)
    assert 0 < len(shifted) < 2 * 3  # some blocks took each path
    assert relative_error(out[0], ref_out) < 2e-5
    np.testing.assert_allclose(lse[0], ref_lse, rtol=2e-6, atol=2e-4)


def test_a_row_that_sees_none_of_a_block_keeps_the_unshifted_path(monkeypatch):
    """Queries 0..7 over keys 4..11 (causal): rows 0..3 see no key of the block, which adds
    nothing to them (they end with output 0 and lse -inf) rather than sending the block down
    the exact path."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 1, 8, 8), dtype=np.float32)
    kv = rng.standard_normal((2, 1, 1, 8, 8), dtype=np.float32)
    monkeypatch.setattr(kernels, "_attend_shifted", lambda block: pytest.fail("took the exact path"))
    q_pos, k_pos, mask = np.arange(8), np.arange(4, 12), Mask(12, True)
    out, lse = kernels.attention(q, kv, q_pos, k_pos, mask=mask)
    ref_out, ref_lse = reference_with_lse(q, kv, q_pos, k_pos, mask)
    assert np.all(out[0, :, :4] == 0) and np.all(np.isneginf(lse[0, :, :4]))
    assert relative_error(out[0, :, 4:], ref_out[:, 4:]) < 2e-5
    np.testing.assert_allclose(lse[0, :, 4:], ref_lse[:, 4:], rtol=2e-6)


def test_keys_no_query_sees_are_never_read():
    """A zigzag rank's queries under packed documents see half of the gathered keys: the
    others, set to NaN and inf (and huge values, which would forbid the unshifted path),
    change nothing; their cast is skipped."""
    workload = Workload(1024, heads=2, head_dim=8, documents=[128] * 8, causal=True)
    rng = np.random.default_rng(10)
    q_pos = np.concatenate([np.arange(0, 256), np.arange(768, 1024)])
    k_pos = np.arange(1024)
    q = rng.standard_normal((1, 2, 512, 8), dtype=np.float32).astype(np.float16)
    kv = rng.standard_normal((2, 1, 2, 1024, 8), dtype=np.float32).astype(np.float16)
    clean = kernels.attention(q, kv, q_pos, k_pos, mask=workload.mask)
    ref_out, _ = reference_with_lse(q, kv, q_pos, k_pos, workload.mask)
    assert relative_error(clean[0][0], ref_out) < 2e-5
    kv[0, ..., 256:512, :] = np.nan
    kv[1, ..., 512:768, :] = np.inf
    kv[1, ..., 300, :] = 6e4
    dirty = kernels.attention(q, kv, q_pos, k_pos, mask=workload.mask)
    np.testing.assert_array_equal(dirty[0], clean[0])
    np.testing.assert_array_equal(dirty[1], clean[1])


@pytest.mark.parametrize("masking", [
    {"causal": True},
    {"causal": True, "documents": [40, 60, 100]},
    {"causal": True, "window": [17, 0], "sinks": 3},
    {"causal": True, "window": [17, 0], "documents": [90, 110]},
    {"window": [9, 5]},
])
def test_a_masked_segment_s_hidden_pairs_and_runs_are_exactly_what_the_mask_hides(masking):
    """``_masking`` over consecutive ranges (through their key - query offsets) and over
    scattered positions (padding queries among them): its hidden pairs are exactly those the
    mask hides, and where it gives each row's run of keys (banded, no sinks) the run holds
    exactly the keys that row sees."""
    mask = Workload(200, heads=1, head_dim=8, **masking).mask
    rng = np.random.default_rng(11)
    cases = [(np.arange(a, a + 30), np.arange(b, b + 40)) for a, b in rng.integers(0, 160, (20, 2))]
    cases.append((np.array([3, 4, 5, 150, 151, 199]), np.array([0, 4, 100, 150, 151])))
    runs = 0
    for q_pos, k_pos in cases:
        seen = mask.visible(q_pos[:, None], k_pos[None, :])
        hidden, run = kernels._masking(mask, q_pos, k_pos)
        np.testing.assert_array_equal(hidden, ~seen)
        if run is not None:
            runs += 1
            columns = np.arange(len(k_pos))
            np.testing.assert_array_equal((columns >= run[0][:, None]) & (columns < run[1][:, None]), seen)
    assert (runs > 0) == (not mask.sinks)


@pytest.mark.parametrize("keys", [1, 7, 64, 2053])
def test_the_compiled_exp_is_numpy_s_to_two_ulps_and_zeroes_masked_scores(keys):
    """``exp_rows``: exp(scores - shift) in place, within 2 float32 ulps of NumPy's, -inf (and
    anything below -87 after the shift) 0, each row's sum added to the running total; a NaN
    makes its row NaN. Lengths that are and are not a multiple of the vector width."""
    from cptune.engines.mpi._compiled import exp_rows

    rng = np.random.default_rng(keys)
    scores = (rng.standard_normal((6, keys)) * 20).astype(np.float32)
    scores[1, ::2] = -np.inf
    scores[2] = -np.inf
    scores[3, 0] = 88.0
    shift = np.array([0.0, 0.0, 0.0, 0.0, 30.0, np.inf], np.float32)
    total = np.full(6, 0.5, np.float32)
    expected = np.exp((scores - shift[:, None]).astype(np.float64))  # the shift in float32, as the kernel's
    got = scores.copy()
    exp_rows(got, shift, total)

    seen = expected >= np.exp(-87.0)
    np.testing.assert_array_less(np.abs(got[seen] - expected[seen]), 2.5 * 2.0**-23 * expected[seen])
    assert (got[~seen] == 0).all() and (got[2] == 0).all() and (got[5] == 0).all()
    np.testing.assert_allclose(total, 0.5 + expected.sum(axis=1, where=seen), rtol=1e-6)
    assert total[2] == total[5] == np.float32(0.5)

    scores[0, keys // 2] = np.nan
    total = np.zeros(6, np.float32)
    exp_rows(scores, np.zeros(6, np.float32), total)
    assert np.isnan(scores[0]).all() and np.isnan(total[0]) and not np.isnan(total[1:]).any()


@pytest.mark.parametrize("keys", [64, 77])
def test_the_compiled_exp_within_runs_zeroes_what_each_row_does_not_see_unread(keys):
    """``exp_rows_within``: row i's keys [first, stop) as ``exp_rows`` gives them, the rest 0
    whatever they held (a NaN outside the run stays out of the row's sum); empty runs give 0."""
    from cptune.engines.mpi._compiled import exp_rows, exp_rows_within

    rng = np.random.default_rng(keys)
    scores = (rng.standard_normal((5, keys)) * 5).astype(np.float32)
    scores[1, 0] = np.nan  # outside row 1's run
    first = np.array([0, 3, 10, keys, 0])
    stop = np.array([keys, 20, 10, keys, 1])
    shift = np.zeros(5, np.float32)
    got, total = scores.copy(), np.full(5, 1.0, np.float32)
    exp_rows_within(got, shift, total, first, stop)
    inside = (np.arange(keys) >= first[:, None]) & (np.arange(keys) < stop[:, None])
    expected = np.where(inside, scores, -np.inf).astype(np.float32)
    expected_total = np.full(5, 1.0, np.float32)
    exp_rows(expected, shift, expected_total)  # the run's keys only, the rest masked
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(total, expected_total)
    assert (got[~inside] == 0).all() and total[2] == total[3] == np.float32(1.0)
