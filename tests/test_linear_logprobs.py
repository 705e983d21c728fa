"""kernels.linear_logprobs (log-probs from hidden states, the logits never whole), the trainer's use
of it (logprobs.response_logprobs, plain_head), and every Triton kernel compiled for real GPUs.

Each test asserts against a float64 reference that makes the whole logits (hidden @ W.T, then a
full log_softmax and torch autograd), or against the logits path of the trainer itself."""

import re
from pathlib import Path

import pytest
import torch

from tools import bench_kernels
import brorl
from lib import logprobs, step
import kernels
import sampler
from kernels import linear_logprobs
from test_brorl import needs_kernel

FP32_TOL = 1e-5  # fp32 matmul over D <= 64 and accumulation over V <= 3000: observed ~2e-6
BACKENDS = ["torch", pytest.param("triton", marks=needs_kernel)]  # triton: the interpreter on a CPU (small shapes: it is slow)


def _device(backend):
    """Where a backend's test runs: the triton backend on CUDA tensors when there is a GPU (the
    compiled kernel takes nothing else), else on the CPU (the interpreter); torch on the CPU."""
    return "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"


def _inputs(lead, D, V, seed, n_ignored=2, tied_scale=1.0):
    """float64 hidden (*lead, D), weight (V, D) giving logits ~ 3 * randn, targets with n_ignored
    -100s, and an upstream gradient (*lead) that scales every position differently."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(*lead, D, generator=gen, dtype=torch.float64)
    w = 3 * tied_scale * torch.randn(V, D, generator=gen, dtype=torch.float64) / D**0.5
    t = torch.randint(0, V, lead, generator=gen)
    t.view(-1)[torch.randperm(t.numel(), generator=gen)[:n_ignored]] = -100
    g = torch.randn(lead, generator=gen, dtype=torch.float64)
    return h, w, t, g


def _oracle(h, w, t, g, temperature):
    """float64 logp, entropy and the gradients of sum(g * logp) w.r.t. h and w, written
    independently of kernels.py: whole logits, full log_softmax, torch autograd."""
    h, w = h.detach().double().clone().requires_grad_(), w.detach().double().clone().requires_grad_()
    logp_all = torch.log_softmax(h @ w.T / temperature, -1)  # (..., V)
    valid = t != -100
    logp = torch.where(valid, logp_all.gather(-1, t.clamp(min=0)[..., None])[..., 0], 0.0)
    entropy = torch.where(valid, -(logp_all.exp() * logp_all).sum(-1), 0.0)
    (logp * g).sum().backward()
    return logp.detach(), entropy.detach(), h.grad, w.grad


def _run(h, w, t, g, temperature, **kw):
    """logp, entropy and both gradients, on the CPU; computed where the backend runs (_device)."""
    dev = _device(kw.get("backend", "torch"))
    h, w = h.detach().to(dev).clone().requires_grad_(), w.detach().to(dev).clone().requires_grad_()
    logp, entropy = linear_logprobs(h, w, t.to(dev), temperature, with_entropy=True, **kw)
    (logp * g.to(dev, logp.dtype)).sum().backward()
    return tuple(x.cpu() for x in (logp.detach(), entropy, h.grad, w.grad))


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lead, rows_per_chunk, temperature", [
    ((10,), 3, 1.0),      # 4 chunks, the last one of a single position
    ((3, 7), 4, 0.7),     # (B, T): 21 positions, chunks 4 at a time (the last of 1)
    ((2, 5), 100, 1.3),   # one chunk larger than the input
])
def test_fp32_values_and_both_gradients_match_float64(backend, lead, rows_per_chunk, temperature):
    V, D = 1000, 48  # V not a multiple of the kernel's 1024-column block
    h, w, t, g = _inputs(lead, D, V, seed=len(lead) + rows_per_chunk)
    ref = _oracle(h, w, t, g, temperature)
    ours = _run(h.float(), w.float(), t, g.float(), temperature, backend=backend,
                chunk_bytes=4 * V * rows_per_chunk)
    assert [x.dtype for x in ours] == [torch.float32] * 4
    assert ours[0].shape == ours[1].shape == t.shape
    for a, b in zip(ours, ref):
        assert _err(a, b) < FP32_TOL
    ignored = t == -100
    assert (ours[0] <= 0).all() and (ours[0][ignored] == 0).all() and (ours[1][ignored] == 0).all()
    assert (ours[2][ignored] == 0).all()  # an ignored position gets exactly no gradient


def test_float64_is_the_reference_to_rounding():
    h, w, t, g = _inputs((9,), 16, 300, seed=3)
    for a, b in zip(_run(h, w, t, g, 0.7, chunk_bytes=4 * 300 * 2), _oracle(h, w, t, g, 0.7)):
        assert _err(a, b) < 1e-12


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_hidden_states(backend):
    # every other position of a (2, 12, D) tensor, and a transposed (T, B) layout: the same numbers
    # as the contiguous copy, and gradients land in the right places of the original
    h, w, t, g = (x.float() if x.is_floating_point() else x for x in _inputs((2, 6), 32, 700, seed=4))
    h = h.to(_device(backend))  # the views are made where the kernel reads them: a move would copy
    strided = torch.cat([h, h], -1).view(2, 6, 2, 32)[:, :, 0]  # (2, 6, 32), stride 64
    transposed = h.transpose(0, 1).contiguous().transpose(0, 1)  # (2, 6, 32), strides (32, 64, 1)
    expected = _run(h, w, t, g, 1.0, backend=backend, chunk_bytes=4 * 700 * 5)
    for view in (strided, transposed):
        assert not view.is_contiguous()
        got = _run(view, w, t, g, 1.0, backend=backend, chunk_bytes=4 * 700 * 5)
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=0)


def test_all_positions_ignored_and_empty_input():
    h, w, t, g = (x.float() if x.is_floating_point() else x for x in _inputs((4,), 8, 50, seed=5, n_ignored=4))
    logp, entropy, gh, gw = _run(h, w, t, g, 1.0)
    assert (logp == 0).all() and (entropy == 0).all() and (gh == 0).all() and (gw == 0).all()
    h0 = torch.randn(0, 3, 8, requires_grad=True)
    w0 = torch.randn(50, 8, requires_grad=True)
    logp = linear_logprobs(h0, w0, torch.zeros(0, 3, dtype=torch.long))
    logp.sum().backward()
    assert logp.shape == (0, 3) and h0.grad.shape == h0.shape and (w0.grad == 0).all()


def test_tied_embedding_gets_both_gradients():
    # one Parameter as the input embedding and the output head: autograd adds both contributions
    V, D = 400, 24
    h, w, t, g = _inputs((3, 5), D, V, seed=6)
    ids = torch.randint(0, V, (3, 5), generator=torch.Generator().manual_seed(7))

    def grad_of_tied(fn, w):
        w = w.clone().requires_grad_()
        hidden = torch.tanh(w[ids] + h.to(w.dtype))  # (3, 5, D): a "model" that reads the embedding
        (fn(hidden, w) * g.to(w.dtype)).sum().backward()
        return w.grad
    ref = grad_of_tied(lambda x, w: kernels.linear_logprobs_ref(x, w, t), w)  # float64, whole logits
    ours = grad_of_tied(lambda x, w: linear_logprobs(x, w, t, chunk_bytes=4 * V * 4), w.float())
    assert _err(ours, ref) < FP32_TOL
    # and both paths matter: without the head's contribution the gradient is wrong
    emb_only = grad_of_tied(lambda x, w: kernels.linear_logprobs_ref(x, w.detach(), t), w)
    assert _err(emb_only, ref) > 100 * FP32_TOL


def test_bf16_autocast_no_worse_than_torch_in_bf16():
    """Under CPU bf16 autocast (the trainer's forward) the chunk matmul runs in bf16, as the
    model's own output layer would; errors vs float64 must be no worse than plain torch under the
    same autocast (whole logits in bf16, then token_logprobs)."""
    V, D = 3000, 64
    h, w, t, g = _inputs((6, 8), D, V, seed=8)
    h32, w32, g32 = h.float(), w.float(), g.float()
    # the float64 oracle of the bf16-rounded inputs: what both paths would give without rounding
    ref = _oracle(h32.bfloat16(), w32.bfloat16(), t, g, 0.9)

    def plain(x, wt):
        return kernels.token_logprobs(x @ wt.T, t, 0.9, with_entropy=True)  # autocast: bf16 logits
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = _run(h32, w32, t, g32, 0.9, chunk_bytes=4 * V * 7)  # 7 chunks
        hp, wp = h32.clone().requires_grad_(), w32.clone().requires_grad_()
        lp, ent = plain(hp, wp)
        (lp * g32).sum().backward()
        theirs = (lp.detach(), ent, hp.grad, wp.grad)
    assert ours[2].dtype == ours[3].dtype == torch.float32  # gradients in the inputs' dtypes
    for name, a, b, exact in zip(["logp", "entropy", "grad hidden", "grad weight"], ours, theirs, ref):
        # the same bf16 logits are made chunk by chunk: both errors are bf16 roundings of the
        # logits and gradients; ours may differ from theirs by a few ulps of summation order
        assert _err(a, exact) <= 1.1 * _err(b, exact) + 1e-6, name


def test_the_chunk_size_follows_the_memory_budget():
    # torch's allocator during forward + backward: whole logits (N, V) fp32 for the plain path,
    # a few chunks of chunk_bytes for linear_logprobs, whatever N is; gradients counted in both
    N, V, D, budget = 512, 4000, 32, 4 * 4000 * 16  # 16 positions a chunk, 32 chunks
    h, w, t, g = (x.float() if x.is_floating_point() else x for x in _inputs((N,), D, V, seed=9))
    h.requires_grad_()
    w.requires_grad_()

    def peak(fn):
        def step():
            h.grad = w.grad = None
            (fn() * g).sum().backward()
        return bench_kernels._cpu_peak_bytes(step)
    grads = (N + V) * D * 4
    plain = peak(lambda: kernels.token_logprobs(h @ w.T, t))
    linear = peak(lambda: linear_logprobs(h, w, t, chunk_bytes=budget))
    assert plain >= N * V * 4  # the whole logits, at least
    assert linear <= grads + 4 * budget  # a chunk's logits, its softmax or gradient, (V, D) sums


def test_bad_inputs_raise_value_error():
    h, w, t, _ = _inputs((2, 3), 8, 50, seed=10)
    h, w = h.float(), w.float()
    bad = [((h, w[:, :7], t), "weight"), ((h, w, t[:, :2]), "shape"), ((h, w, t.int()), "int64"),
           ((h, w.double(), t), "autocast"), ((h, w, torch.full_like(t, 50)), r"\[0, 50\)")]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            linear_logprobs(*args)
    with pytest.raises(ValueError, match="backend"):
        linear_logprobs(h, w, t, backend="cuda")


# ----------------------------------------------------------------------------
# The trainer: logprobs.response_logprobs takes hidden states to linear_logprobs


def _tiny_lm(tied, cls_name="Qwen2", **extra):
    """A small random decoder with the embedded tokenizer's vocabulary, loaded as brorl loads one."""
    import transformers
    from data import build_tokenizer
    tok = build_tokenizer()
    config = getattr(transformers, f"{cls_name}Config")(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, initializer_range=0.3,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=tied, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls_name}ForCausalLM")(config)
    model.config._attn_implementation = "brorl"
    return model, tok


def test_plain_head_detection():
    for tied in (False, True):
        model, _ = _tiny_lm(tied)
        assert logprobs.plain_head(model) is model.get_output_embeddings().weight
        assert (logprobs.plain_head(model) is model.get_input_embeddings().weight) == tied
    cohere, _ = _tiny_lm(True, "Cohere", logit_scale=0.25)  # logits = (h @ W.T) * 0.25
    assert logprobs.plain_head(cohere) is None
    for key, value in [("final_logit_softcapping", 30.0), ("logits_scaling", 8.0)]:
        model, _ = _tiny_lm(False)
        setattr(model.config, key, value)
        assert logprobs.plain_head(model) is None, key
        setattr(model.config, key, 1.0 if key == "logits_scaling" else None)  # the identity
        assert logprobs.plain_head(model) is not None, key
    model, _ = _tiny_lm(False)
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.config.vocab_size))
    assert logprobs.plain_head(model) is None


def _batch(model, tok, n=4):
    ro = sampler.generate(model, tok, ["12+3=", "7+45=", "1+1="], n, 6, 1.0, 1.0, 4096, torch.Generator().manual_seed(1))
    return step.pack_groups([ro.group(g) for g in range(3)])


def _full_forward_logprobs(model, batch, temperature):
    """Log-probs of every response by running prompt + response through model(...).logits, row by row."""
    out = torch.zeros(batch.resp.shape, dtype=torch.float64)
    for r in range(len(batch.resp)):
        p = batch.prompt[batch.group[r]][batch.prompt_mask[batch.group[r]]]
        resp = batch.resp[r][batch.resp_mask[r]]
        logits = model(torch.cat([p, resp])[None]).logits[0, len(p) - 1: -1].double()  # (t, V)
        out[r, : len(resp)] = torch.log_softmax(logits / temperature, -1).gather(-1, resp[:, None])[:, 0]
    return out


@pytest.mark.parametrize("cls_name, extra", [("Qwen2", {}), ("Cohere", dict(logit_scale=0.25))])
def test_response_logprobs_equal_a_full_forward(cls_name, extra):
    # Qwen2: the hidden-state path; Cohere (scaled logits): the logits path, chosen by plain_head
    batch = _batch(*_tiny_lm(True))  # rollouts of a Qwen2, scored by each model
    model, _ = _tiny_lm(True, cls_name, **extra)
    model.eval()
    with torch.no_grad():
        logp = logprobs.response_logprobs(model, batch, torch.arange(len(batch.resp)), 0.8)
        ref = _full_forward_logprobs(model, batch, 0.8)
    torch.testing.assert_close(logp.double(), ref, atol=2e-5, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_training_with_it_equals_training_on_logits(tied, monkeypatch):
    """One update_policy step from hidden states (linear_logprobs) and one through the whole logits
    (plain_head forced off): the same weights after the step, to float64 rounding."""
    model, tok = _tiny_lm(tied)
    batch = _batch(model, tok, n=6)
    adv = torch.randn(18, generator=torch.Generator().manual_seed(2))
    cfg = brorl.Config(micro_batch=7, n_minibatches=1, grad_clip=1e9, kl_coef=0.1, old_logp="recompute")

    def one_step():
        torch.manual_seed(0)
        m = type(model)(model.config).double()
        m.load_state_dict(model.state_dict())
        m.train()
        ref = type(model)(model.config).double()
        ref.load_state_dict(model.state_dict())
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        brorl.update_policy(m, ref, opt, batch, adv, cfg, torch.Generator().manual_seed(0))
        return [p.detach() for p in m.parameters()]
    calls = []
    real = logprobs.linear_logprobs
    monkeypatch.setattr(logprobs, "linear_logprobs", lambda *a, **k: calls.append(1) or real(*a, **k))
    fused = one_step()
    assert calls  # the hidden-state path was taken
    monkeypatch.setattr(logprobs, "plain_head", lambda model: None)
    plain = one_step()
    start = [p.detach().double() for p in model.parameters()]
    for a, b, s in zip(fused, plain, start):
        assert (a - b).norm() <= 1e-9 * (b - s).norm() + 1e-12
    assert any((b - s).norm() > 0 for b, s in zip(plain, start))  # the step did move the weights


# ----------------------------------------------------------------------------
# Compiled for real GPUs: every @triton.jit kernel, ahead of time, no GPU needed


@pytest.mark.slow
def test_every_kernel_compiles_for_sm80_and_sm90_without_spills():
    rows = bench_kernels.compile_kernels()
    jitted = set(re.findall(r"@triton\.jit\s+def (\w+)", Path(kernels.__file__).read_text()))
    assert {r["kernel"] for r in rows} == jitted
    assert len(rows) == len(jitted) * 2 * 3  # x sm_80, sm_90 x fp32, bf16, fp16 logits
    for r in rows:
        assert r["spill_bytes"] == 0, r  # spilled registers go through local memory: slow
        assert 0 < r["regs"] <= 255 and r["warps_per_sm"] >= kernels.NUM_WARPS, r
