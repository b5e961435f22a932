"""The numpy attention kernel's backward against a plain float64 computation of the same
gradients: head sharing, masks, positions, key subsets, padding, blocks and threads."""

import numpy as np
import pytest

from cptune import kernels as work
from cptune.engines.mpi import _kernels as kernels
from cptune.masks import Mask


def reference_forward(q, kv, q_pos, k_pos, causal, seq_len):
    """(out, lse) in float64 from the full masked score matrix of every head."""
    scores, _ = _scores(q, kv, q_pos, k_pos, causal, seq_len)
    with np.errstate(divide="ignore"):
        row_max = scores.max(axis=-1, keepdims=True)
        row_max[~np.isfinite(row_max)] = 0.0
        total = np.exp(scores - row_max).sum(axis=-1)
        lse = row_max[..., 0] + np.log(total)
    probs = _probs(scores, lse)
    values = _per_query_head(kv[1].astype(np.float64), q.shape[1])
    return probs @ values, lse


def reference_grad(q, kv, out, lse, dout, q_pos, k_pos, causal, seq_len):
    """(dq, dkv) in float64, written from the math: P = exp(S - lse), D = rowsum(dout out),
    dV = P^T dout, dP = dout V^T, dS = P (dP - D), dQ = scale dS K, dK = scale dS^T Q; each
    KV head's dK and dV summed over its query heads."""
    heads, kv_heads = q.shape[1], kv.shape[2]
    scores, scale = _scores(q, kv, q_pos, k_pos, causal, seq_len)
    probs = _probs(scores, lse.astype(np.float64))
    q64, dout64 = q.astype(np.float64), dout.astype(np.float64)
    keys = _per_query_head(kv[0].astype(np.float64), heads)
    values = _per_query_head(kv[1].astype(np.float64), heads)
    delta = (dout64 * out.astype(np.float64)).sum(axis=-1)
    dv = probs.swapaxes(-1, -2) @ dout64
    dp = dout64 @ values.swapaxes(-1, -2)
    ds = probs * (dp - delta[..., None])
    dq = scale * ds @ keys
    dk = scale * ds.swapaxes(-1, -2) @ q64
    group = heads // kv_heads
    batch, _, sk, dim = dk.shape
    dk = dk.reshape(batch, kv_heads, group, sk, dim).sum(axis=2)
    dv = dv.reshape(batch, kv_heads, group, sk, dim).sum(axis=2)
    return dq, np.stack([dk, dv])


def _scores(q, kv, q_pos, k_pos, causal, seq_len):
    scale = 1.0 / np.sqrt(q.shape[-1])
    keys = _per_query_head(kv[0].astype(np.float64), q.shape[1])
    scores = scale * q.astype(np.float64) @ keys.swapaxes(-1, -2)
    masked = np.broadcast_to(k_pos[None, :] >= seq_len, scores.shape[-2:])
    if causal:
        masked = masked | (k_pos[None, :] > q_pos[:, None])
    return np.where(masked, -np.inf, scores), scale


def _probs(scores, lse):
    seen = np.isfinite(lse)[..., None]
    with np.errstate(invalid="ignore"):
        return np.where(seen, np.exp(scores - np.where(seen, lse[..., None], 0.0)), 0.0)


def _per_query_head(x, heads):
    """[B, K, s, D] -> [B, H, s, D]: query head h reads KV head h // (H // K)."""
    return np.repeat(x, heads // x.shape[1], axis=1)


def relative(got, ref):
    return float(np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max())


def inputs(seed, batch, heads, kv_heads, sq, sk, dim, dtype):
    """q, kv and dout rounded to ``dtype`` (the reference then sees the same numbers)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, heads, sq, dim)).astype(dtype)
    kv = rng.standard_normal((2, batch, kv_heads, sk, dim)).astype(dtype)
    dout = rng.standard_normal((batch, heads, sq, dim)).astype(dtype)
    return q, kv, dout


def check(q, kv, dout, q_pos, k_pos, *, causal, seq_len, threads=1, tolerance=2e-5):
    """Kernel against the reference, with the final out and lse of the reference forward
    (out in the inputs' dtype, lse float32 as the forward returns it)."""
    out, lse = reference_forward(q, kv, q_pos, k_pos, causal, seq_len)
    out, lse = out.astype(q.dtype), lse.astype(np.float32)
    dq, dkv = kernels.attention_grad(q, kv, out, lse, dout, q_pos, k_pos,
                                     mask=Mask(seq_len, causal), threads=threads)
    assert dq.dtype == np.float32 and dkv.dtype == np.float32
    assert dq.shape == q.shape and dkv.shape == kv.shape
    ref_dq, ref_dkv = reference_grad(q, kv, out, lse, dout, q_pos, k_pos, causal, seq_len)
    for got, ref, name in ((dq, ref_dq, "dq"), (dkv[0], ref_dkv[0], "dk"), (dkv[1], ref_dkv[1], "dv")):
        assert relative(got, ref) <= tolerance, name
    return dq, dkv, out, lse


@pytest.fixture
def small_blocks(monkeypatch):
    """Key chunks of about 50 and row blocks of 16, so small sizes cross several of each."""
    monkeypatch.setattr(work, "KEY_CHUNK", 64)
    monkeypatch.setattr(kernels, "rows_per_block", lambda keys: 16)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_matches_float64_reference(small_blocks, kv_heads, causal, dtype, threads):
    """Several key chunks and row blocks; with three threads some KV heads have query heads
    on two threads (summed after) and some on one (written in place)."""
    q, kv, dout = inputs(1, 2, 4, kv_heads, 100, 100, 16, dtype)
    positions = np.arange(100)
    tolerance = 2e-5 if dtype == np.float32 else 1e-4
    check(q, kv, dout, positions, positions, causal=causal, seq_len=100, threads=threads, tolerance=tolerance)


@pytest.mark.parametrize("seq_len", [64, 60], ids=["no-padding", "padding"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_zigzag_key_subsets_sum_to_the_whole(small_blocks, causal, seq_len):
    """Zigzag positions (rank r of 4 holds chunks r and 7 - r of 8): the gradient over all
    keys matches the reference, and two disjoint key subsets called with the final out and
    lse give dq shares that sum to it and its dk, dv pieces. Keys at positions >= seq_len
    are padding and get no gradient."""
    ranks = [np.r_[8 * r : 8 * r + 8, 56 - 8 * r : 64 - 8 * r] for r in range(4)]
    q_pos, k_pos = ranks[0], np.concatenate(ranks)
    q, kv, dout = inputs(2, 1, 4, 2, len(q_pos), len(k_pos), 8, np.float32)
    dq, dkv, out, lse = check(q, kv, dout, q_pos, k_pos, causal=causal, seq_len=seq_len, threads=2)
    assert np.all(dkv[:, :, :, k_pos >= seq_len] == 0)
    first, second = np.arange(32), np.arange(32, 64)
    dq_first, dkv_first = kernels.attention_grad(q, kv[:, :, :, first], out, lse, dout, q_pos, k_pos[first],
                                                 mask=Mask(seq_len, causal))
    dq_second, dkv_second = kernels.attention_grad(q, kv[:, :, :, second], out, lse, dout, q_pos,
                                                   k_pos[second], mask=Mask(seq_len, causal), threads=2)
    assert relative(dq_first + dq_second, dq.astype(np.float64)) <= 2e-6
    assert relative(dkv_first, dkv[:, :, :, first].astype(np.float64)) <= 2e-6
    assert relative(dkv_second, dkv[:, :, :, second].astype(np.float64)) <= 2e-6


def test_rows_that_see_no_key():
    """Queries before every key (causal) have lse -inf: no gradient flows through them and
    nothing becomes NaN."""
    q, kv, dout = inputs(3, 1, 2, 1, 4, 4, 8, np.float32)
    q_pos, k_pos = np.arange(0, 4), np.arange(2, 6)  # queries 0, 1 see none of keys 2..5
    dq, dkv, _, lse = check(q, kv, dout, q_pos, k_pos, causal=True, seq_len=10)
    assert np.all(np.isneginf(lse[..., :2])) and np.all(dq[..., :2, :] == 0)
    assert np.all(np.isfinite(dkv))


def test_default_blocks_over_several_key_chunks():
    """More keys than one chunk holds, with the module's own chunk and row sizes."""
    q, kv, dout = inputs(4, 1, 2, 1, 64, 2500, 16, np.float32)
    k_pos = np.arange(2500)
    for causal in (False, True):
        check(q, kv, dout, np.arange(2436, 2500), k_pos, causal=causal, seq_len=2500)


def test_kernel_forward_output_feeds_the_backward(small_blocks):
    """With out and lse from the kernel's own forward (float32), as a layer would save them."""
    q, kv, dout = inputs(5, 1, 4, 2, 80, 80, 16, np.float32)
    positions = np.arange(80)
    out, lse = kernels.attention(q, kv, positions, positions, mask=Mask(80, True))
    dq, dkv = kernels.attention_grad(q, kv, out, lse, dout, positions, positions, mask=Mask(80, True))
    ref_out, ref_lse = reference_forward(q, kv, positions, positions, True, 80)
    ref_dq, ref_dkv = reference_grad(q, kv, ref_out, ref_lse, dout, positions, positions, True, 80)
    assert relative(dq, ref_dq) <= 2e-5 and relative(dkv, ref_dkv) <= 2e-5
