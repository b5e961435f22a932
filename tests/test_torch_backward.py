"""The torch engine's attention backward by position: ``attend_grad`` against a float64
computation written out here from the math (full scores under a position mask), for MHA, GQA
and MQA, causal or not, float32 and bfloat16, zigzag positions, key subsets (the Ring's use:
the layer's final output and log-sum-exp, each subset's share), padding; the fused backward of
one call against ``explicit_grad``, the explicit one against autograd, the CUDA backwards'
arguments on meta tensors, and the check that keeps a CUDA backward or falls back."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # the cptune[torch] extra; CI installs it

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from cptune import Workload  # noqa: E402
from cptune.engines.torch import _kernels  # noqa: E402
from cptune.engines.torch._kernels import (  # noqa: E402
    Pick,
    explicit,
    explicit_grad,
    fused_attention_grad,
    run_grad,
)
from cptune.engines.torch._ops import TorchOps, attend, attend_grad  # noqa: E402
from cptune.masks import Mask  # noqa: E402
from cptune.strategies.primitives import Partial  # noqa: E402

SEQ = 64
BATCH, HEADS, HEAD_DIM = 2, 4, 16
#: The relative error allowed against the float64 computation (bf16: on the rounded inputs).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def zigzag(rank: int, ranks: int = 4, seq: int = SEQ) -> np.ndarray:
    """Positions of ``rank``'s zigzag block: chunks ``rank`` and ``2 ranks - 1 - rank``."""
    chunk = seq // (2 * ranks)
    first, second = rank * chunk, (2 * ranks - 1 - rank) * chunk
    return np.concatenate([np.arange(first, first + chunk), np.arange(second, second + chunk)])


def relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.double() - expected).abs().max() / expected.abs().max())


class Layer:
    """One layer's queries at ``q_pos`` over keys at every position 0..seq-1 (in position
    order), its output, log-sum-exp and gradients in float64 from the inputs as rounded to
    ``dtype``: P = exp(s - lse) under the mask (keys at seq_len or beyond never count, a causal
    query sees keys at or before it), D = rowsum(dout out), dV = P^T dout, dS = P (dout V^T -
    D), dQ = scale dS K, dK = scale dS^T q, a KV head's summed over its query heads."""

    def __init__(self, q_pos: np.ndarray, kv_heads: int, causal: bool, dtype: torch.dtype,
                 seq_len: int = SEQ, seed: int = 0) -> None:
        generator = torch.Generator().manual_seed(seed)
        rows = len(q_pos)
        self.q_pos, self.k_pos = q_pos, np.arange(SEQ)
        self.causal, self.seq_len, self.dtype, self.kv_heads = causal, seq_len, dtype, kv_heads
        self.q = torch.randn(BATCH, HEADS, rows, HEAD_DIM, generator=generator).to(dtype)
        self.kv = torch.randn(2, BATCH, kv_heads, SEQ, HEAD_DIM, generator=generator).to(dtype)
        dout = torch.randn(BATCH, HEADS, rows, HEAD_DIM, generator=generator)
        dout[..., torch.as_tensor(q_pos >= seq_len), :] = 0.0  # the caller pads with zeros
        self.dout = dout.to(dtype)

        groups = HEADS // kv_heads
        q64, dout64 = self.q.double(), self.dout.double()
        k64 = self.kv[0].double().repeat_interleave(groups, dim=1)
        v64 = self.kv[1].double().repeat_interleave(groups, dim=1)
        self.scale = 1 / math.sqrt(HEAD_DIM)
        visible = torch.as_tensor(self.k_pos < seq_len)[None, :].expand(rows, SEQ)
        if causal:
            visible = visible & torch.as_tensor(self.k_pos[None, :] <= q_pos[:, None])
        scores = (q64 @ k64.transpose(-1, -2) * self.scale).masked_fill(~visible, float("-inf"))
        self.lse = torch.logsumexp(scores, dim=-1)
        assert torch.isfinite(self.lse).all()
        p = torch.exp(scores - self.lse[..., None])
        self.out = p @ v64
        delta = (dout64 * self.out).sum(-1, keepdim=True)
        self.ds = p * (dout64 @ v64.transpose(-1, -2) - delta)
        self.k64 = k64
        self.dq = self.scale * self.ds @ k64
        self.dk = (self.scale * self.ds.transpose(-1, -2) @ q64).unflatten(1, (kv_heads, groups)).sum(2)
        self.dv = (p.transpose(-1, -2) @ dout64).unflatten(1, (kv_heads, groups)).sum(2)

    def saved(self, out_dtype: torch.dtype | None = None) -> Partial:
        """The layer's final output (in ``out_dtype``, the model's by default) and float32
        log-sum-exp, as a forward leaves them."""
        return Partial(self.out.to(out_dtype or self.dtype), self.lse.float())

    def grad(self, keys: np.ndarray, saved: Partial | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``attend_grad`` over the keys at index (= position) ``keys``."""
        return attend_grad(self.q, self.kv[..., keys, :], self.dout, saved or self.saved(), self.q_pos,
                           self.k_pos[keys], Mask(self.seq_len, self.causal))

    def expected_share(self, keys: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The float64 (dQ share, dK, dV) of the keys at index ``keys``."""
        at = torch.as_tensor(keys)
        dq = self.scale * self.ds[..., at] @ self.k64[..., at, :]
        return dq, self.dk[..., at, :], self.dv[..., at, :]


def assert_close(got: tuple[torch.Tensor, torch.Tensor], expected: tuple, dtype: torch.dtype) -> None:
    dq, dkv = got
    assert dq.dtype == dkv.dtype == torch.float32
    assert dq.shape == expected[0].shape and dkv.shape == (2, *expected[1].shape)
    for name, value, reference in (("dq", dq, expected[0]), ("dk", dkv[0], expected[1]),
                                   ("dv", dkv[1], expected[2])):
        error = relative(value, reference)
        assert error <= TOLERANCE[dtype], f"{name}: relative error {error:.2e}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_attend_grad_matches_the_float64_reference(kv_heads, causal, dtype):
    """Zigzag queries (rank 0 of 4: positions 0-7 and 56-63) over every key, and over their
    own block alone and another rank's with the layer's output and log-sum-exp."""
    layer = Layer(zigzag(0), kv_heads, causal, dtype)
    everything = np.arange(SEQ)
    assert_close(layer.grad(everything), (layer.dq, layer.dk, layer.dv), dtype)
    for block in (zigzag(0), zigzag(1)):
        assert_close(layer.grad(block), layer.expected_share(block), dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("split", ["zigzag", "halves"])
def test_key_subsets_shares_sum_to_the_full_gradient(split, causal):
    """The Ring's use: disjoint key subsets each given the layer's final output and
    log-sum-exp; their dq shares sum to the gradient over all keys, and each subset's dK, dV
    are those of the gradient over all keys."""
    layer = Layer(zigzag(1), kv_heads=2, causal=causal, dtype=torch.float32, seed=1)
    subsets = ([zigzag(rank) for rank in range(4)] if split == "zigzag"
               else [np.arange(0, SEQ // 2), np.arange(SEQ // 2, SEQ)])
    full_dq, full_dkv = layer.grad(np.arange(SEQ))
    total = torch.zeros_like(full_dq)
    into = torch.zeros_like(full_dq)  # the same shares added in place, as a Ring step may
    for keys in subsets:
        dq, dkv = layer.grad(keys)
        total += dq
        torch.testing.assert_close(dkv, full_dkv[..., torch.as_tensor(keys), :], rtol=1e-5, atol=1e-6)
        added, _ = attend_grad(layer.q, layer.kv[..., keys, :], layer.dout, layer.saved(), layer.q_pos,
                               keys, Mask(SEQ, causal), dq_into=into)
        assert added is into
    torch.testing.assert_close(total, full_dq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(into, total, rtol=1e-6, atol=1e-7)
    assert relative(total, layer.dq) <= TOLERANCE[torch.float32]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padding_keys_and_queries_contribute_nothing(causal):
    """seq_len 60 of 64 positions: the keys at 60-63 never count for a real query and get no
    gradient; the queries at 60-63 have dout 0 and get dq 0, whatever their calls see."""
    seq_len = 60
    layer = Layer(zigzag(0), kv_heads=2, causal=causal, dtype=torch.float32, seq_len=seq_len, seed=2)
    dq, dkv = layer.grad(np.arange(SEQ))
    assert_close((dq, dkv), (layer.dq, layer.dk, layer.dv), torch.float32)
    assert not dkv[..., seq_len:, :].any()
    assert not dq[..., torch.as_tensor(layer.q_pos >= seq_len), :].any()
    for block in (zigzag(0), zigzag(1)):  # the own block holds the padding keys
        assert_close(layer.grad(block), layer.expected_share(block), torch.float32)


def test_the_forwards_output_in_float32_or_the_models_dtype_gives_the_same_gradient():
    """``saved`` as ``attend`` leaves it: the kernel's own output (one call) or its float32
    accumulator (several), with its log-sum-exp."""
    layer = Layer(zigzag(0), kv_heads=2, causal=True, dtype=torch.bfloat16, seed=3)
    keys = np.arange(SEQ)
    part = attend(layer.q, layer.kv, layer.q_pos, layer.k_pos, Mask(SEQ, True))
    assert relative(part.lse, layer.lse) < 1e-4
    for saved in (part, layer.saved(torch.float32), layer.saved(torch.bfloat16)):
        assert_close(layer.grad(keys, saved), (layer.dq, layer.dk, layer.dv), torch.bfloat16)


def test_rows_and_keys_no_call_names_get_zeros():
    """Causal queries at 0-7 and 56-63 over the keys at 48-55 (a later block for the first
    chunk): the rows at 0-7 see none of them."""
    layer = Layer(zigzag(0), kv_heads=1, causal=True, dtype=torch.float32, seed=4)
    keys = np.arange(48, 56)
    dq, dkv = layer.grad(keys)
    assert not dq[..., :8, :].any() and dq[..., 8:, :].all()
    assert_close((dq, dkv), layer.expected_share(keys), torch.float32)


def test_torch_ops_attention_grad_is_attend_grad_timed_as_compute():
    workload = Workload(seq_len=SEQ, heads=HEADS, head_dim=HEAD_DIM, kv_heads=2, batch=BATCH,
                        dtype="fp32", causal=True)
    ops = TorchOps(workload, {}, torch.device("cpu"))
    layer = Layer(zigzag(2), kv_heads=2, causal=True, dtype=torch.float32, seed=5)
    keys = zigzag(3)
    dq, dkv = ops.attention_grad(layer.q, layer.kv[..., keys, :], layer.dout, layer.saved(), layer.q_pos,
                                 keys)
    expected = layer.grad(keys)
    torch.testing.assert_close(dq, expected[0], rtol=0, atol=0)
    torch.testing.assert_close(dkv, expected[1], rtol=0, atol=0)
    assert ops.clock.totals()[0] > 0


def one_call(kv_heads: int, causal: bool, dtype: torch.dtype, sequence_major: bool, seed: int = 6):
    """A call over the last 24 of 40 keys (square-causal over them, or unmasked), with the
    layer's output and log-sum-exp over all 40 (the first 16 all before the call's queries)."""
    generator = torch.Generator().manual_seed(seed)

    def drawn(heads: int, seq: int) -> torch.Tensor:
        x = torch.randn(BATCH, seq, heads, HEAD_DIM, generator=generator).to(dtype)
        return x.transpose(1, 2) if sequence_major else x.transpose(1, 2).contiguous()

    q, dout = drawn(HEADS, 24), drawn(HEADS, 24)
    k, v = drawn(kv_heads, 40), drawn(kv_heads, 40)
    before_out, before_lse = explicit(q, k[..., :16, :], v[..., :16, :], False)
    call_out, call_lse = explicit(q, k[..., 16:, :], v[..., 16:, :], causal)
    lse = torch.logaddexp(before_lse, call_lse)
    out = (before_out.float() * torch.exp(before_lse - lse)[..., None]
           + call_out.float() * torch.exp(call_lse - lse)[..., None])
    return q, k[..., 16:, :], v[..., 16:, :], out.to(dtype), lse, dout


@pytest.mark.parametrize("sequence_major", [False, True], ids=["heads-major", "sequence-major"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1], ids=["mha", "gqa", "mqa"])
def test_the_fused_backward_of_a_call_over_part_of_the_keys_matches_the_explicit_one(
        kv_heads, causal, dtype, sequence_major):
    """The CPU flash backward, given the layer's output and log-sum-exp over more keys than
    the call sees, with fewer KV heads as they are: the call's exact share (it computes D from
    the ``out`` it is given)."""
    q, k, v, out, lse, dout = one_call(kv_heads, causal, dtype, sequence_major)
    got = fused_attention_grad(q, k, v, out, lse, dout, causal)
    expected = explicit_grad(q, k, v, out, lse, dout, causal)
    for grad, reference, like in zip(got, expected, (q, k, v), strict=True):
        assert grad.shape == like.shape == reference.shape
        assert relative(grad, reference.double()) <= TOLERANCE[dtype] / (10 if dtype == torch.float32 else 1)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_the_explicit_backward_is_autograds_gradient(kv_heads, causal):
    """Over all its keys a call's output and log-sum-exp are its own: explicit_grad is then
    the gradient autograd takes of plain float64 attention."""
    generator = torch.Generator().manual_seed(7)
    q = torch.randn(1, HEADS, 12, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, kv_heads, 12, 8, generator=generator, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    dout = torch.randn(1, HEADS, 12, 8, generator=generator, dtype=torch.float64)
    groups = HEADS // kv_heads
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) * 0.3
    if causal:
        scores = scores.masked_fill(torch.ones(12, 12, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.softmax(scores, -1) @ v.repeat_interleave(groups, 1)
    out.backward(dout)
    lse = torch.logsumexp(scores, -1).detach()
    got = explicit_grad(q.detach(), k.detach(), v.detach(), out.detach(), lse, dout, causal, 0.3)
    for grad, tensor in zip(got, (q, k, v), strict=True):
        assert relative(grad, tensor.grad) < 1e-6


class Recorded(TorchDispatchMode):
    """The aten ops run under it, with their arguments by schema name (those the dispatcher
    leaves out at their defaults filled in)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        schema = func._schema.arguments
        given = dict(zip([argument.name for argument in schema], args, strict=False)) | (kwargs or {})
        defaults = {argument.name: argument.default_value for argument in schema
                    if argument.name not in given and argument.has_default_value()}
        self.calls.append((func._schema.name, given | defaults))
        return func(*args, **(kwargs or {}))


CUDA_BACKWARDS = {
    "cuda_flash": "aten::_scaled_dot_product_flash_attention_backward",
    "cuda_efficient": "aten::_scaled_dot_product_efficient_attention_backward",
    "cuda_cudnn": "aten::_scaled_dot_product_cudnn_attention_backward",
}


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("kernel", sorted(CUDA_BACKWARDS))
def test_each_cuda_backward_calls_its_op_with_the_dense_dropout_free_arguments(kernel, causal):
    """No GPU here: the CUDA branch runs on meta tensors, whose kernels this torch registers
    for these ops, so its arguments are parsed against their real schemas (a wrong name or a
    missing argument raises) and its shapes come back; what it passed is recorded."""
    op = CUDA_BACKWARDS[kernel]
    assert hasattr(torch.ops.aten, op.removeprefix("aten::"))
    meta = {"device": "meta", "dtype": torch.bfloat16}
    rows, keys = 40, 72
    q, dout = torch.empty(BATCH, HEADS, rows, 64, **meta), torch.empty(BATCH, HEADS, rows, 64, **meta)
    k, v = torch.empty(BATCH, 2, keys, 64, **meta), torch.empty(BATCH, 2, keys, 64, **meta)
    out = torch.empty(BATCH, HEADS, rows, 64, device="meta", dtype=torch.float32)  # a float32 accumulator
    lse = torch.empty(BATCH, HEADS, rows, device="meta")
    with Recorded() as recorded:
        dq, dk, dv = run_grad(Pick(kernel, False), q, k, v, out, lse, dout, causal, 0.125)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    (arguments,) = [found for name, found in recorded.calls if name == op]
    schema = getattr(torch.ops.aten, op.removeprefix("aten::")).default._schema
    assert set(arguments) <= {argument.name for argument in schema.arguments}
    assert arguments["dropout_p"] == 0.0 and arguments["is_causal"] is causal and arguments["scale"] == 0.125
    assert arguments["query"] is q
    assert arguments["out"].dtype == torch.bfloat16
    assert arguments["logsumexp"].dtype == torch.float32 and arguments["logsumexp"].is_contiguous()
    grouped_k = arguments["key"].shape[1]
    if kernel == "cuda_efficient":  # takes no fewer KV heads, out sequence-major, lse padded to 32
        assert grouped_k == HEADS
        assert arguments["grad_input_mask"] == [True, True, True, False] and arguments["attn_bias"] is None
        assert arguments["logsumexp"].shape == (BATCH, HEADS, 64)
    else:  # dense: no cumulative lengths; the maximum lengths are the call's
        assert grouped_k == 2
        assert arguments["cum_seq_q"] is None and arguments["cum_seq_k"] is None
        assert (arguments["max_q"], arguments["max_k"]) == (rows, keys)
    if kernel in ("cuda_flash", "cuda_efficient"):  # out and dout as they read them
        assert arguments["out"].transpose(1, 2).is_contiguous()
        grad_out = arguments["grad_out" if kernel == "cuda_flash" else "grad_out_"]
        assert grad_out.transpose(1, 2).is_contiguous()
    if kernel == "cuda_flash":
        assert arguments["logsumexp"].shape == (BATCH, HEADS, rows)
        assert arguments["philox_seed"].shape == (2,)  # the forward's rng_state
    if kernel == "cuda_cudnn":  # the forward's [batch, heads, rows, 1]; out and dout alike, in q's order
        assert arguments["logsumexp"].shape == (BATCH, HEADS, rows, 1) and arguments["attn_bias"] is None
        assert arguments["grad_out"].stride() == arguments["out"].stride()


def test_the_backward_check_keeps_the_forwards_kernel_repeats_kv_heads_or_falls_back(monkeypatch):
    """On CUDA a backward is first checked on a call over part of the keys: one that refuses
    fewer KV heads gets them repeated; one that is wrong -- or right only over all the keys
    (it ignores the layer's log-sum-exp) -- gives way to the explicit backward."""

    def no_gqa(q, k, v, out, lse, dout, causal, scale):
        if q.shape[1] != k.shape[1]:
            raise RuntimeError("fewer KV heads")
        return explicit_grad(q, k, v, out, lse, dout, causal, scale)

    def local(q, k, v, out, lse, dout, causal, scale):
        return explicit_grad(q, k, v, *explicit(q, k, v, causal, scale), dout, causal, scale)

    def wrong(q, k, v, out, lse, dout, causal, scale):
        dq, dk, dv = explicit_grad(q, k, v, out, lse, dout, causal, scale)
        return dq, dk, 2 * dv

    fakes = {"no_gqa": no_gqa, "local": local, "wrong": wrong, "right": explicit_grad}
    monkeypatch.setattr(_kernels, "GRAD_KERNELS", _kernels.GRAD_KERNELS | fakes)
    q, k = torch.empty(1, 4, 300, 16), torch.empty(1, 2, 300, 16)
    chooser = _kernels.KernelChooser()
    assert chooser.probe_grad(Pick("right", False), q, k) == Pick("right", False)
    assert chooser.probe_grad(Pick("no_gqa", False), q, k) == Pick("no_gqa", True)
    assert chooser.probe_grad(Pick("no_gqa", False), q, q) == Pick("no_gqa", False)
    assert chooser.probe_grad(Pick("local", False), q, k) == Pick("explicit", False)
    assert chooser.probe_grad(Pick("wrong", True), q, k) == Pick("explicit", False)
    for dtype in (torch.float32, torch.bfloat16):  # the check passes a real fused backward
        real = Pick("flash_for_cpu", False)
        assert chooser.probe_grad(real, q.to(dtype), k.to(dtype)) == real
    # on the CPU the backward is the forward's, unchecked
    assert chooser.grad_pick(q, k) == Pick("flash_for_cpu", False) and not chooser.grad_picks


@pytest.mark.parametrize("mask", [
    Mask(SEQ, True, window=(15, 0)),
    Mask(SEQ, True, window=(15, 0), sinks=2),
    Mask(SEQ, True, window=(11, 0), documents=(20, 44)),
    Mask(SEQ, False, window=(8, 8)),
], ids=["window", "sinks", "documents", "both-sides"])
@pytest.mark.parametrize("positions", ["all", "zigzag"])
def test_a_windows_far_edge_runs_by_the_causal_kernel_reversed_as_the_explicit_path_computes_it(
        monkeypatch, mask, positions):
    """A masked call a window's far edge makes (its first rows see the keys from their own index
    on) runs as the fused causal call on its rows and keys reversed: output, log-sum-exp, dQ, dK
    and dV as the explicit path gives them, which then runs only the other masked calls."""
    from cptune.calls import attention_calls
    from cptune.engines.torch import _ops

    q_pos = np.arange(SEQ) if positions == "all" else zigzag(1)
    k_pos = np.arange(SEQ)
    layer = Layer(q_pos, 2, mask.causal, torch.float32)
    masked = [c for c in attention_calls(q_pos, k_pos, mask) if c.masked]
    reversible = [c for c in masked if _ops._anti_causal(_ops._visible(c, q_pos, k_pos, mask))]
    assert reversible  # each mask's far edges are among its masked calls

    def run() -> tuple[torch.Tensor, ...]:
        out, lse = attend(layer.q, layer.kv, q_pos, k_pos, mask)
        dq, dkv = attend_grad(layer.q, layer.kv, layer.dout, Partial(out, lse), q_pos, k_pos, mask)
        return out, lse, dq, dkv

    explicit_calls = {"forward": 0, "backward": 0}

    def counted(name: str, function):
        def call(*args, **kwargs):
            explicit_calls[name] += 1
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(_ops, "explicit", counted("forward", _ops.explicit))
    monkeypatch.setattr(_ops, "explicit_grad", counted("backward", _ops.explicit_grad))
    reversed_run = run()
    others = len(masked) - len(reversible)
    assert explicit_calls == {"forward": others, "backward": others}
    monkeypatch.setattr(_ops, "_anti_causal", lambda visible: False)
    explicit_run = run()
    for name, got, expected in zip(("out", "lse", "dq", "dkv"), reversed_run, explicit_run, strict=True):
        finite = torch.isfinite(expected)
        assert torch.equal(torch.isfinite(got), finite), name
        assert torch.allclose(got[finite], expected[finite], atol=1e-5), name
