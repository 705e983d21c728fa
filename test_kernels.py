"""Tests of kernels.py: the Triton kernels (run through the interpreter on a CPU) and the torch
reference, against float64, on ugly inputs. `python -m pytest test_kernels.py -q`."""

import pytest
import torch

import kernels
from kernels import token_logprobs, token_logprobs_ref

FP32_TOL = 1e-5  # fp32 accumulation over <= 50k columns: observed errors are ~2e-6


def _inputs(lead, V, dtype, seed, n_ignored=1):
    """Random logits (*lead, V) ~ 4 * randn in dtype, targets (*lead) with n_ignored -100s,
    and an upstream gradient (*lead) so that every row's gradient is scaled differently."""
    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(*lead, V, generator=gen)).to(dtype)
    t = torch.randint(0, V, lead, generator=gen)
    t.view(-1)[torch.randperm(t.numel(), generator=gen)[:n_ignored]] = -100
    g = torch.randn(lead, generator=gen)
    return x, t, g


def _run(x, t, g, temperature, backend):
    """logp, entropy and d(sum g * logp)/d x, by token_logprobs with the given backend."""
    x = x.clone().requires_grad_()
    logp, entropy = token_logprobs(x, t, temperature, with_entropy=True, backend=backend)
    (logp * g).sum().backward()
    return logp.detach(), entropy, x.grad


def _oracle(x, t, g, temperature):
    """float64 logp, entropy, gradient of the same (already rounded) logits, written
    independently of kernels.py: full log_softmax and torch autograd."""
    x = x.double().requires_grad_()
    logp_all = torch.log_softmax(x / temperature, -1)  # (..., V)
    valid = t != -100
    logp = torch.where(valid, logp_all.gather(-1, t.clamp(min=0)[..., None])[..., 0], 0.0)
    p = logp_all.exp()
    entropy = torch.where(valid, -torch.where(p > 0, p * logp_all, 0.0).sum(-1), 0.0)
    (logp * g.double()).sum().backward()
    return logp.detach(), entropy.detach(), x.grad


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _assert_fp32_close(ours, ref, t):
    (logp, entropy, grad), (logp64, entropy64, grad64) = ours, ref
    assert logp.dtype == entropy.dtype == torch.float32
    assert _err(logp, logp64) < FP32_TOL
    assert _err(entropy, entropy64) < FP32_TOL
    assert _err(grad, grad64) < FP32_TOL
    assert (logp <= 0).all()
    ignored = t == -100
    assert (logp[ignored] == 0).all() and (entropy[ignored] == 0).all()
    assert (grad[ignored] == 0).all()  # exactly 0, not merely small


# -----------------------------------------------------------------------------
# The reference

def test_reference_matches_float64(monkeypatch):
    # a tiny chunk size so that rows are split into several checkpointed chunks (3 rows each)
    monkeypatch.setattr(kernels, "REF_CHUNK_ELEMENTS", 3000)
    x, t, g = _inputs((3, 5), 1000, torch.float32, seed=0, n_ignored=3)
    ref = _oracle(x, t, g, 0.7)
    _assert_fp32_close(_run(x, t, g, 0.7, "torch"), ref, t)
    # and in float64 it is the oracle up to float64 rounding
    x64 = x.double().requires_grad_()
    logp, entropy = token_logprobs_ref(x64, t, 0.7, with_entropy=True)
    (logp * g.double()).sum().backward()
    assert max(_err(logp, ref[0]), _err(entropy, ref[1]), _err(x64.grad, ref[2])) < 1e-12


def test_auto_backend_on_cpu_is_the_reference():
    x, t, g = _inputs((4,), 300, torch.bfloat16, seed=1)
    expected = _run(x, t, g, 1.3, "torch")
    for a, b in zip(_run(x, t, g, 1.3, "auto"), expected):
        assert torch.equal(a, b)
    with torch.no_grad():  # the old-policy / reference-policy use: no graph, same numbers
        assert torch.equal(token_logprobs(x, t, 1.3), expected[0])


# -----------------------------------------------------------------------------
# The Triton kernels, executed (interpreter on a CPU)

@pytest.mark.parametrize("lead, V, temperature", [
    ((5,), 1000, 1.0),       # (R,), V not a multiple of BLOCK_V, one partial block
    ((2, 3), 1000, 0.7),     # (B, T)
    ((1,), 50257, 1.3),      # a single row, 50 vocabulary blocks, last one partial
    ((2, 2), 50257, 0.7),
])
def test_kernel_fp32_matches_float64(lead, V, temperature):
    x, t, g = _inputs(lead, V, torch.float32, seed=V + len(lead))
    if lead == (1,):
        t[0] = 7  # the single row must not be the ignored one
    ours = _run(x, t, g, temperature, "triton")
    assert ours[0].shape == ours[1].shape == t.shape and ours[2].shape == x.shape
    _assert_fp32_close(ours, _oracle(x, t, g, temperature), t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead, V, temperature", [((3, 2), 1000, 0.7), ((3,), 50257, 1.3)])
def test_kernel_low_precision_no_worse_than_torch(dtype, lead, V, temperature):
    x, t, g = _inputs(lead, V, dtype, seed=V + 1)
    ref = _oracle(x, t, g, temperature)  # float64 on the same rounded logits
    logp, entropy, grad = _run(x, t, g, temperature, "triton")
    # torch's own computation in that dtype: the bar to meet
    xd = x.clone().requires_grad_()
    logp_all = torch.log_softmax(xd / temperature, -1)
    valid = t != -100
    logp_d = logp_all.gather(-1, t.clamp(min=0)[..., None])[..., 0] * valid
    entropy_d = -(logp_all.exp() * logp_all).sum(-1) * valid
    (logp_d * g.to(dtype)).sum().backward()
    # logp and entropy: fp32 math on exactly representable inputs, so within the fp32 tolerance,
    # which is also inside the bar (torch's own error in that dtype, plus that tolerance)
    for ours, theirs, exact in [(logp, logp_d, ref[0]), (entropy, entropy_d, ref[1])]:
        assert _err(ours, exact) <= min(FP32_TOL, _err(theirs, exact) + FP32_TOL)
    # The gradient is written in dtype: one rounding of values up to max|grad| costs up to one
    # ulp there (the interpreter truncates on fp32 -> bf16; a GPU rounds to nearest, half an ulp).
    ulp = torch.finfo(dtype).eps * ref[2].abs().max().item()
    assert _err(grad, ref[2]) <= min(ulp, _err(xd.grad, ref[2]) + ulp)
    assert grad.dtype == dtype and (logp <= 0).all() and (grad[~valid] == 0).all()


def test_kernel_many_row_and_vocab_blocks(monkeypatch):
    # small blocks: 3 row blocks (the last partial) and 16 vocabulary blocks; logits sorted
    # ascending so the running max grows at every block and every rescale is exercised
    monkeypatch.setattr(kernels, "BLOCK_R", 2)
    monkeypatch.setattr(kernels, "BLOCK_V", 64)
    x, t, g = _inputs((5,), 1000, torch.float32, seed=3)
    x = x.sort(-1).values
    _assert_fp32_close(_run(x, t, g, 0.7, "triton"), _oracle(x, t, g, 0.7), t)


def test_kernel_ignored_rows():
    # all rows ignored, then a mix (incl. a whole block of 8 ignored rows)
    x, t, g = _inputs((3, 4), 1000, torch.bfloat16, seed=4, n_ignored=12)
    logp, entropy, grad = _run(x, t, g, 1.0, "triton")
    assert (logp == 0).all() and (entropy == 0).all() and (grad == 0).all()
    x, t, g = _inputs((13,), 1000, torch.float32, seed=5, n_ignored=0)
    t[:8] = -100
    t[11] = -100
    _assert_fp32_close(_run(x, t, g, 1.3, "triton"), _oracle(x, t, g, 1.3), t)


def test_peaked_and_masked_logits():
    # p(target) ~ 1 (logp must round to <= 0, never above) and -inf logits (a masked vocabulary)
    x, t, g = _inputs((4,), 1000, torch.float32, seed=6, n_ignored=0)
    x[:2, :] = 0.0
    x[0, t[0]] = 60.0  # softmax = 1 - 1e-23: logp rounds to 0
    x[1, t[1]] = 15.0
    x[2:, 500:] = float("-inf")
    t[2:] = torch.tensor([3, 499])
    for dtype in (torch.float32, torch.bfloat16):
        for backend in ("triton", "torch"):
            ours = _run(x.to(dtype), t, g, 0.7, backend)
            assert (ours[0] <= 0).all() and ours[0][0] == 0
            assert all(torch.isfinite(o).all() for o in ours)
            if dtype == torch.float32:
                _assert_fp32_close(ours, _oracle(x, t, g, 0.7), t)


def test_kernel_non_contiguous_logits_are_read_in_place():
    # logits[:, :-1] (the usual next-token shift) and a column-major (R, V): same numbers
    x, t, g = _inputs((2, 4), 1000, torch.bfloat16, seed=7)
    sliced = torch.cat([x, x[:, :1]], 1)[:, :-1]  # (2, 4, V), a non-contiguous view
    transposed = x.reshape(8, 1000).t().contiguous().t().view(2, 4, 1000)  # last stride 8
    assert not sliced.is_contiguous() and transposed.stride(-1) != 1
    expected = _run(x, t, g, 0.7, "triton")
    for view in (sliced, transposed):
        for a, b in zip(_run(view, t, g, 0.7, "triton"), expected):
            assert torch.equal(a, b)


def test_kernel_offsets_past_2_to_31():
    # The third row starts at element 2^31 + 34 of a 4 GiB bf16 buffer that stays untouched
    # except for 3 rows (pages are only mapped when written). With 32-bit offsets this reads
    # out of bounds: in the interpreter, a segmentation fault.
    V, stride = 1000, 2**30 + 17
    try:
        big = torch.empty(2 * stride + V, dtype=torch.bfloat16)
    except RuntimeError:
        pytest.skip("cannot reserve 4 GiB of address space")
    x = big.as_strided((3, V), (stride, 1))  # (3, V), rows 2^30 + 17 elements apart
    src, t, g = _inputs((3,), V, torch.bfloat16, seed=8, n_ignored=0)
    x.copy_(src)
    ours = _run(x, t, g, 1.0, "triton")
    for a, b in zip(ours, _run(src, t, g, 1.0, "triton")):
        assert torch.equal(a, b)
    del big, x


def test_kernel_allocates_no_fp32_copy():
    # the launcher must not upcast: during forward + backward torch allocates the bf16
    # gradient (R, V) and a few (R,) vectors, nothing else (counted by the torch profiler)
    x, t, g = _inputs((64,), 2000, torch.bfloat16, seed=10)
    x.requires_grad_()
    peak = kernels._cpu_peak_bytes(lambda: (token_logprobs(x, t, backend="triton") * g).sum()
                                   .backward())
    assert x.grad.numel() * 2 <= peak <= x.grad.numel() * 2 + 64 * 1024


def test_empty_input():
    for backend in ("triton", "torch"):
        x = torch.randn(0, 3, 7, requires_grad=True)
        logp = token_logprobs(x, torch.zeros(0, 3, dtype=torch.long), backend=backend)
        logp.sum().backward()
        assert logp.shape == (0, 3) and x.grad.shape == x.shape


def test_interpreter_works_when_triton_was_imported_first():
    # torch._dynamo (torch.compile, checkpoint) imports triton; if that happens before
    # kernels.py sets TRITON_INTERPRET, triton.language's own helpers must still be interpreted
    import os
    import subprocess
    import sys
    if torch.cuda.is_available():
        pytest.skip("the interpreter is only forced without a GPU")
    code = ("import triton.language, torch, kernels;"
            "x = torch.randn(3, 100); t = torch.tensor([1, -100, 99]);"
            "assert torch.allclose(kernels.token_logprobs(x, t, backend='triton'),"
            " kernels.token_logprobs_ref(x, t), atol=1e-5)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a fresh shell
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.abspath(kernels.__file__)))
    assert out.returncode == 0, out.stderr[-2000:]


# -----------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs_raise_value_error(backend):
    x, t, _ = _inputs((2, 3), 50, torch.float32, seed=9)
    bad = [
        ((x, t[:, :2]), "shape"),                               # targets shape mismatch
        ((x, t.int()), "int64"),                                # targets dtype
        ((x, t.float()), "int64"),
        ((x.long(), t), "dtype"),                               # integer logits
        ((x, t, 0.0), "temperature"),
        ((x, t, -1.0), "temperature"),
        ((x, t, float("inf")), "temperature"),
        ((x, torch.full_like(t, 50)), r"\[0, 50\)"),            # target == V
        ((x, torch.full_like(t, -1)), r"\[0, 50\)"),            # negative but not -100
        ((x[..., :0], t), "V >= 1"),                            # empty vocabulary
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            token_logprobs(*args, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        token_logprobs(x, t, backend="cuda")
    if backend == "triton":  # float64 is for the reference (the oracle) only
        with pytest.raises(ValueError, match="dtype"):
            token_logprobs(x.double(), t, backend="triton")
