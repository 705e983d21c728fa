"""kernels.token_logprobs beyond the float64 check of test_brorl.py: the auto backend, low precision,
many blocks, ignored rows, peaked and masked logits, non-contiguous views, offsets past 2^31, no fp32
copy, empty input, the interpreter after an early triton import, bad input. On a CPU the Triton kernels
run in the interpreter; on a GPU compiled."""

import pytest
import torch

from tools import bench_kernels
import kernels
from kernels import token_logprobs
from test_brorl import FP32_TOL, KDEV, _assert_fp32_close, _err, _inputs, _oracle, _run, needs_kernel


# ----------------------------------------------------------------------------
# the reference


def test_auto_backend_on_cpu_is_the_reference():
    x, t, g = _inputs((4,), 300, torch.bfloat16, seed=1, device="cpu")
    expected = _run(x, t, g, 1.3, "torch")
    for a, b in zip(_run(x, t, g, 1.3, "auto"), expected):
        assert torch.equal(a, b)
    with torch.no_grad():  # the old-policy / reference-policy use: no graph, same numbers
        assert torch.equal(token_logprobs(x, t, 1.3), expected[0])


# ----------------------------------------------------------------------------
# the Triton kernels, executed (the interpreter on a CPU)


@needs_kernel
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


@needs_kernel
def test_kernel_many_row_and_vocab_blocks(monkeypatch):
    # small blocks: 3 row blocks (the last partial) and 16 vocabulary blocks; logits sorted
    # ascending so the running max grows at every block and every rescale is exercised
    monkeypatch.setattr(kernels, "BLOCK_R", 2)
    monkeypatch.setattr(kernels, "BLOCK_V", 64)
    x, t, g = _inputs((5,), 1000, torch.float32, seed=3)
    x = x.sort(-1).values
    _assert_fp32_close(_run(x, t, g, 0.7, "triton"), _oracle(x, t, g, 0.7), t)


@needs_kernel
def test_kernel_ignored_rows():
    # all rows ignored, then a mix (incl. a whole block of 8 ignored rows)
    x, t, g = _inputs((3, 4), 1000, torch.bfloat16, seed=4, n_ignored=12)
    logp, entropy, grad = _run(x, t, g, 1.0, "triton")
    assert (logp == 0).all() and (entropy == 0).all() and (grad == 0).all()
    x, t, g = _inputs((13,), 1000, torch.float32, seed=5, n_ignored=0)
    t[:8] = -100
    t[11] = -100
    _assert_fp32_close(_run(x, t, g, 1.3, "triton"), _oracle(x, t, g, 1.3), t)


@needs_kernel
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


@needs_kernel
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


@needs_kernel
def test_kernel_offsets_past_2_to_31():
    # The third row starts at element 2^31 + 34 of a 4 GiB bf16 buffer that stays untouched
    # except for 3 rows (pages are only mapped when written). With 32-bit offsets this reads
    # out of bounds: in the interpreter, a segmentation fault.
    V, stride = 1000, 2**30 + 17
    try:
        big = torch.empty(2 * stride + V, dtype=torch.bfloat16, device=KDEV)
    except RuntimeError:
        pytest.skip("cannot reserve 4 GiB of address space")
    x = big.as_strided((3, V), (stride, 1))  # (3, V), rows 2^30 + 17 elements apart
    src, t, g = _inputs((3,), V, torch.bfloat16, seed=8, n_ignored=0)
    x.copy_(src)
    x.requires_grad_()  # the view itself goes to the kernel: _run's clone would make it contiguous
    logp, entropy = token_logprobs(x, t, 1.0, with_entropy=True, backend="triton")
    (logp * g).sum().backward()
    assert x.stride() == (stride, 1) and x.grad.shape == (3, V)
    for a, b in zip((logp.detach(), entropy, x.grad), _run(src, t, g, 1.0, "triton")):
        assert torch.equal(a, b)
    del big, x


@needs_kernel
def test_kernel_allocates_no_fp32_copy():
    # the launcher must not upcast: during forward + backward torch allocates the bf16
    # gradient (R, V) and a few (R,) vectors, nothing else (counted by the torch profiler)
    x, t, g = _inputs((64,), 2000, torch.bfloat16, seed=10)
    x.requires_grad_()
    fwd_bwd = lambda: (token_logprobs(x, t, backend="triton") * g).sum().backward()
    peak = (bench_kernels._cuda_peak_bytes if KDEV == "cuda" else bench_kernels._cpu_peak_bytes)(fwd_bwd)
    assert x.grad.numel() * 2 <= peak <= x.grad.numel() * 2 + 64 * 1024


@needs_kernel
def test_empty_input():
    for backend in ("triton", "torch"):
        x = torch.randn(0, 3, 7, device=KDEV, requires_grad=True)
        logp = token_logprobs(x, torch.zeros(0, 3, dtype=torch.long, device=KDEV), backend=backend)
        logp.sum().backward()
        assert logp.shape == (0, 3) and x.grad.shape == x.shape


@pytest.mark.skipif(not kernels.HAS_TRITON, reason="triton ships for Linux only")
def test_triton_36_with_numpy_24_says_in_one_line_what_to_install(monkeypatch):
    """triton 3.6's interpreter fails inside every kernel with numpy >= 2.4: a kernel call on a CPU says
    so in one line, naming what to install, and the kernel tests skip with that line as their reason."""
    import numpy
    import triton
    x, t = torch.randn(3, 50), torch.randint(0, 50, (3,))
    for triton_v, numpy_v, broken in [("3.6.0", "2.5.2", True), ("3.6.0", "2.4.0", True), ("3.6.0", "2.3.5", False),
                                       ("3.7.1", "2.5.2", False)]:
        monkeypatch.setattr(triton, "__version__", triton_v)
        monkeypatch.setattr(numpy, "__version__", numpy_v)
        problem = kernels.interpreter_problem()
        assert bool(problem) == broken and "\n" not in problem
        if broken and KDEV == "cpu":  # (on a GPU machine a CPU tensor is refused first: no interpreter is set up)
            assert "pip install 'numpy<2.4'" in problem and f"numpy {numpy_v}" in problem
            for call in (lambda: token_logprobs(x, t, backend="triton"),
                         lambda: kernels.linear_logprobs(torch.randn(3, 4), torch.randn(50, 4), t, backend="triton")):
                with pytest.raises(ValueError, match="numpy<2.4") as e:
                    call()
                assert "\n" not in str(e.value)


@pytest.mark.slow
@needs_kernel
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


@pytest.mark.slow
def test_without_triton_the_reference_serves_and_a_run_trains(tmp_path):
    """triton ships for Linux only: where it is absent (a Mac) kernels.py still imports, every auto call
    takes the torch reference, backend='triton' says what is missing, and brorl.py trains a step."""
    import os
    import subprocess
    import sys
    import textwrap
    root = os.path.dirname(os.path.abspath(kernels.__file__))
    code = textwrap.dedent(f"""
        import sys, runpy
        sys.modules["triton"] = None  # `import triton` now raises ImportError
        import torch, kernels
        x, t = torch.randn(3, 100, requires_grad=True), torch.tensor([1, -100, 99])
        assert torch.equal(kernels.token_logprobs(x, t), kernels.token_logprobs_ref(x, t))
        kernels.linear_logprobs(torch.randn(2, 3, 8), torch.randn(100, 8), torch.tensor([[1, 2, 3], [4, 5, -100]]))
        try:
            kernels.token_logprobs(x, t, backend="triton")
        except ValueError as e:
            print(e)
        sys.argv = ["brorl.py", "--steps", "1", "--eval_every", "1", "--n_rollouts", "8", "--eval_prompts", "2",
                    "--eval_samples", "2", "--probe_prompts", "1", "--probe_samples", "8", "--save", "0",
                    "--out", {str(tmp_path)!r}]
        runpy.run_path("brorl.py", run_name="__main__")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "needs triton, which is not installed" in out.stdout
    assert (tmp_path / "metrics.jsonl").read_text().count("\n") == 2  # step 0's evaluation and step 1


# ----------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("backend", [pytest.param("triton", marks=needs_kernel), "torch"])
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
