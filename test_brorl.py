"""The algorithm's own tests: one BroRL step, piece by piece, each against a reference (a float64
brute force, a closed form, an exact expectation).

  advantages        rewards centred per group, then whitened as verl does (over tokens:
                    --adv_norm batch); one path for groups of equal and unequal N
  the loss          PPO's clipped token loss and its dual clip, truncated importance sampling, the
                    k2 KL, the weights of token and sequence aggregation
  dynamic sampling  how many groups a step asks for, keeps and drops, and when it gives up
  log-probs         the Triton kernel and its torch reference against float64: values and gradient
  Theorem 1         the mass balance of one update against the exact softmax change; Lemma 2
  end to end        two steps of brorl.py on the embedded model: metrics, plot, checkpoint

Everything runs on a CPU: `python -m pytest -q test_brorl.py`. The other tests (the sampler, the
update's engineering, the command line, data, the verifier, the kernel's corner cases, the
mass-balance simulation) are in tests/; some import the fixtures and helpers defined here."""

import json
import math
import os
import random
import subprocess
import sys
import types
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub: tests use what we ship
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import brorl  # noqa: E402
import data  # noqa: E402
import kernels  # noqa: E402
from lib import step  # noqa: E402
from tools import massbalance as mb  # noqa: E402
from kernels import token_logprobs, token_logprobs_ref  # noqa: E402

HERE = Path(__file__).resolve().parent  # the repository root


# ----------------------------------------------------------------------------
# fixtures: a tiny random model, prompts of different lengths


@pytest.fixture(scope="module")
def random_lm(tmp_path_factory):
    """A tiny random Qwen2 with the embedded tokenizer, initialised loudly enough that greedy
    decoding varies from prompt to prompt (a near-uniform model would hide sampler bugs)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    tok = data.build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, initializer_range=0.3,
                      eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # make EOS the argmax wherever digit "1" would win: greedy lengths vary
        head = model.lm_head.weight
        head[tok.eos_token_id] = 1.5 * head[tok.convert_tokens_to_ids("1")]
    path = tmp_path_factory.mktemp("random_lm")
    model.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="brorl").eval()
    return model, tok


PROMPTS = ["123+45=", "9+1=", "77+123+1=", "5"]  # different lengths: exercises the padding


# ----------------------------------------------------------------------------
# advantages: centred per group, whitened over the batch


def advantages(r, norm, lengths=None, focal_gamma=0.0):
    """brorl.compute_advantages of (G, N) rewards and lengths, back as (G, N): its flat rows are
    these, group-major."""
    G, N = r.shape
    group = torch.arange(G).repeat_interleave(N)  # (G*N,)
    flat = None if lengths is None else lengths.flatten()
    return brorl.compute_advantages(r.flatten(), group, norm, flat, focal_gamma).view(G, N)


@pytest.mark.parametrize("norm", ["batch", "response", "group"])
def test_all_equal_groups_are_whitened_with_the_rest_as_verl(norm):
    """With --dynamic_sampling 0 a group with no signal stays in the batch: centred to 0, then
    whitened with the rest (verl's REINFORCE++-baseline), so it gets -mean/std, one value for all
    its rows; under group (GRPO) 0 / (0 + 1e-6) = 0."""
    g = torch.Generator().manual_seed(0)
    r = (torch.rand(6, 16, generator=g) < 0.4).float()
    r[1], r[4] = 1.0, 0.0  # an all-right and an all-wrong group
    # right answers short, wrong ones long: the token mean of the centred values is negative
    lengths = torch.where(r > 0, torch.randint(5, 20, r.shape, generator=g),
                          torch.randint(30, 50, r.shape, generator=g))
    adv = advantages(r, norm, lengths)
    assert torch.isfinite(adv).all()
    assert (adv[0] != 0).any()
    if norm == "group":
        assert (adv[1] == 0).all() and (adv[4] == 0).all()
    else:
        w = (lengths if norm == "batch" else torch.ones_like(r)).double()  # each response's weight
        x = (r - r.mean(1, keepdim=True)).double()  # (G, N) centred
        mean = (w * x).sum() / w.sum()
        std = (((w * (x - mean) ** 2).sum() / (w.sum() - 1)) + 1e-8).sqrt()  # unbiased, as verl
        for i in (1, 4):
            torch.testing.assert_close(adv[i], torch.full((16,), (-mean / std).item()),
                                       rtol=1e-5, atol=1e-6)
        # Over tokens the centred mean is not 0 (per response it is: adv 0 there).
        if norm == "batch":
            assert adv[1, 0] > 0.1
            # the zero token-sum holds with the no-signal groups in it
            assert abs((adv.double() * lengths).sum() / lengths.sum()) < 1e-6
    only_equal = advantages(torch.ones(3, 4), norm, lengths[:3, :4])  # no signal anywhere: no NaN
    assert torch.equal(only_equal, torch.zeros(3, 4))


def test_advantage_formulas():
    r = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0]])
    centred = r - r.mean(1, keepdim=True)
    torch.testing.assert_close(advantages(r, "response"),
                               (centred - centred.mean()) / (centred.std() + 1e-6))
    torch.testing.assert_close(advantages(r, "group"), centred / (r.std(1, keepdim=True) + 1e-6))


def masked_whiten_reference(rewards, lengths):
    """verl's REINFORCE++-baseline, token by token in float64: the group-centred score repeated over
    each response's valid tokens of a (R, T) grid, then (x - mean) / sqrt(unbiased var + 1e-8) over
    the mask."""
    r = rewards.double()
    centred = (r - r.mean(1, keepdim=True)).flatten()  # (R,)
    T = int(lengths.max())
    mask = torch.arange(T)[None] < lengths.flatten()[:, None]  # (R, T)
    x = centred[:, None].expand(-1, T)[mask]  # (valid tokens,)
    mean, var = x.mean(), x.var(unbiased=True)
    # (G, N), constant along a response
    return ((centred - mean) / torch.sqrt(var + 1e-8)).view(rewards.shape)


def test_batch_norm_whitens_over_tokens_when_lengths_differ():
    g = torch.Generator().manual_seed(0)
    r = (torch.rand(5, 16, generator=g) < 0.4).float()
    r[2] = 1.0  # an all-right group: whitened with the rest, as verl's
    # right answers short (~20 tokens), wrong ones long (~50): the token-weighted mean of the
    # group-centred advantages is negative, so token whitening shifts every advantage up
    lengths = torch.where(r > 0, torch.randint(10, 30, r.shape, generator=g),
                          torch.randint(40, 60, r.shape, generator=g))
    adv = advantages(r, "batch", lengths)
    ref = masked_whiten_reference(r, lengths)
    torch.testing.assert_close(adv, ref.float(), rtol=1e-5, atol=1e-6)
    assert (adv[2] > 0).all()  # -mean/std: right answers are short, so the token mean is negative
    # over the valid tokens the advantages have mean 0; the per-response form's do not
    per_token_mean = lambda a: (a.double() * lengths).sum() / lengths.sum()
    per_response = advantages(r, "response", lengths)
    assert abs(per_token_mean(adv)) < 0.05 < abs(per_token_mean(per_response))
    assert (adv - per_response).abs().max() > 0.1  # the two forms differ by more than rounding


def test_batch_norm_needs_lengths():
    with pytest.raises(ValueError, match="lengths"):
        advantages(torch.tensor([[1.0, 0.0]]), "batch")


def rectangular_reference(r, norm, lengths, gamma):
    """The advantages of (G, N) rewards by (G, N) arithmetic: each row's mean and std along it,
    the whitening (brorl.whiten) over all entries, the focal weight of each row's mean."""
    mean = r.mean(1, keepdim=True)  # (G, 1)
    adv = {"group": lambda c: c / (r.std(1, keepdim=True) + 1e-6), "none": lambda c: c,
           "batch": lambda c: brorl.whiten(c, lengths),
           "response": lambda c: brorl.whiten(c, torch.ones_like(c))}[norm](r - mean)
    return adv * (1 - mean).clamp(min=0) ** gamma if gamma else adv


def ragged_reference(rs, norm, lengths, gamma):
    """The advantages of G groups of unequal N, each (n_j,), group by group: each centred on its
    own mean (group: by its own std), the whitening over all groups' entries, the focal weight of
    each group's mean."""
    if norm == "group":
        adv = [(r - r.mean()) / (r.std() + 1e-6) for r in rs]
    else:
        centred = torch.cat([r - r.mean() for r in rs])
        weights = torch.cat(lengths) if norm == "batch" else torch.ones_like(centred)
        adv = centred.split([len(r) for r in rs]) if norm == "none" else \
            brorl.whiten(centred, weights).split([len(r) for r in rs])
    return torch.cat([a * (1 - r.mean()).clamp(min=0) ** gamma if gamma else a
                      for a, r in zip(adv, rs)])


@pytest.mark.parametrize("gamma", [0.0, 1.0, 0.5])
@pytest.mark.parametrize("norm", ["batch", "response", "group", "none"])
@pytest.mark.parametrize("binary", [True, False])
def test_flat_advantages_are_each_groups_arithmetic_to_the_bit(norm, gamma, binary):
    """One path over flat rows with a group index: groups of equal N give the (G, N) arithmetic's
    numbers and groups of unequal N the group-by-group ones, to the bit (binary rewards, as the
    verifier's, and real ones), with and without the focal weight."""
    g = torch.Generator().manual_seed(1 + binary)
    draw = lambda *shape: (torch.randint(0, 2, shape, generator=g).float() if binary
                           else torch.rand(*shape, generator=g))
    r, lengths = draw(5, 8), torch.randint(1, 9, (5, 8), generator=g).double()  # (G, N) each
    assert torch.equal(advantages(r, norm, lengths, gamma),
                       rectangular_reference(r, norm, lengths, gamma))
    sizes = [2, 7, 3, 16, 5]
    rs = [draw(n) for n in sizes]
    ls = [torch.randint(1, 9, (n,), generator=g).double() for n in sizes]
    group = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))  # (R,)
    flat = brorl.compute_advantages(torch.cat(rs), group, norm, torch.cat(ls), gamma)
    assert torch.equal(flat, ragged_reference(rs, norm, ls, gamma))


def test_focal_weight_damps_the_groups_mostly_right():
    """F-GRPO's focal weight: each group's advantages x (1 - mu)^gamma, mu its success rate, so a
    group right 7 times of 8 keeps (1/8)^gamma of them and one right once 7/8^gamma; gamma 0 is the
    unweighted advantages."""
    r = torch.tensor([[1.0, 1, 1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0, 0, 0]])
    lengths = torch.full((2, 8), 3.0)
    plain = advantages(r, "batch", lengths)
    for gamma in (1.0, 2.0):
        weight = torch.tensor([[1 / 8], [7 / 8]]) ** gamma  # (G, 1)
        torch.testing.assert_close(advantages(r, "batch", lengths, gamma), plain * weight)
    assert torch.equal(advantages(r, "batch", lengths, 0.0), plain)


# ----------------------------------------------------------------------------
# the loss: PPO's clip and dual clip, truncated importance sampling, KL, loss weights


def test_ppo_clip_zeroes_gradient_outside_the_trust_region():
    old = torch.zeros(4, 1)
    # ratios 1.5 (above 1+0.28), 0.5 (below 1-0.2), 1.1 and 0.9 (inside)
    logp = torch.log(torch.tensor([[1.5], [0.5], [1.1], [0.9]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, ratio = brorl.ppo_token_loss(logp, old, adv, 0.2, 0.28)
    loss.sum().backward()
    assert logp.grad[0] == 0 and logp.grad[1] == 0  # clipped: no gradient
    # d(-r A)/dlogp = -r A
    torch.testing.assert_close(logp.grad[2:, 0], -adv[2:] * ratio[2:, 0].detach())
    # on the other side of the bound the clip must NOT bind: positive adv, ratio below 1-eps
    logp2 = torch.log(torch.tensor([[0.5]])).requires_grad_()
    loss2 = brorl.ppo_token_loss(logp2, torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.28)[0]
    loss2.sum().backward()
    assert logp2.grad.item() == pytest.approx(-0.5)


def test_dual_clip_and_clamp_bound_a_huge_ratio():
    old = torch.zeros(4, 1)
    # log-ratios 100 (would overflow to inf), 100, log 5 (> c = 3) and log 2 (< c)
    logp = torch.tensor([[100.0], [100.0], [math.log(5.0)], [math.log(2.0)]]).requires_grad_()
    adv = torch.tensor([-1.5, 1.5, -1.0, -1.0])
    loss, ratio = brorl.ppo_token_loss(logp, old, adv, 0.2, 0.28)  # c = 3, the default
    loss.sum().backward()
    assert all(torch.isfinite(x).all() for x in (loss, logp.grad, ratio))
    # negative advantage: capped at -c*A (no gradient); positive: clipped at (1+eps_high)*A
    torch.testing.assert_close(loss[:, 0], torch.tensor([3 * 1.5, -1.28 * 1.5, 3.0, 2.0]))
    assert logp.grad[0] == 0 and logp.grad[1] == 0 and logp.grad[2] == 0
    assert logp.grad[3].item() == pytest.approx(2.0)  # d(-r A)/dlogp = -r A, below the cap


def test_tis_corrects_a_planted_sampler_mismatch():
    """Tokens drawn by a sampler q that differs from the trainer's p: weighted by p/q, the expected
    gradient over q's draws is the on-policy one, d/dtheta sum_v p(v) A(v); unweighted it is not.
    The expectation is exact: every token is a row, weighted by its probability under q."""
    g = torch.Generator().manual_seed(2)
    V = 7
    # the trainer's logits
    theta = torch.randn(V, dtype=torch.float64, generator=g).requires_grad_()
    A = torch.randn(V, dtype=torch.float64, generator=g)  # (V,) each token's advantage
    # the sampler's, a planted mismatch
    logq = F.log_softmax(theta.detach() + torch.randn(V, dtype=torch.float64, generator=g), -1)
    exact = torch.autograd.grad(-(F.softmax(theta, -1) * A).sum(), theta)[0]

    def expected_grad(cap):
        logp = F.log_softmax(theta, -1)[:, None]  # (V, 1): one row per token
        # ratio 1: the clip is inactive
        loss, _ = brorl.ppo_token_loss(logp, logp.detach(), A, 0.2, 0.28)
        w = brorl.tis_weight(logp.detach(), logq[:, None], cap)  # (V, 1)
        return torch.autograd.grad((logq.exp() * (loss * w)[:, 0]).sum(), theta)[0]

    # so a cap of 100 never binds
    assert (F.log_softmax(theta.detach(), -1) - logq).exp().max() < 100
    torch.testing.assert_close(expected_grad(cap=100.0), exact)
    assert (expected_grad(cap=0) - exact).norm() > 0.2 * exact.norm()  # TIS off: biased
    weight = brorl.tis_weight(torch.zeros(3), torch.tensor([-5.0, 0.0, 5.0]), 2.0)
    torch.testing.assert_close(weight, torch.tensor([2.0, 1.0, math.exp(-5)]))  # truncated at C


def test_k2_kl_matches_formula_and_clamps():
    lp, ref = torch.tensor([-1.0, -30.0]), torch.tensor([-2.0, -1.0])
    torch.testing.assert_close(brorl.kl_k2(lp, ref), torch.tensor([0.5, 0.5 * 100]))


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_loss_weights_sum_to_one_and_ignore_padding(agg):
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    w = brorl.loss_weights(mask, agg)
    assert w.sum().item() == pytest.approx(1.0) and (w[~mask] == 0).all()
    # in the loss's dtype: float64 checks stay float64's
    w64 = brorl.loss_weights(mask, agg, dtype=torch.float64)
    assert w64.dtype == torch.float64 and abs(w64.sum().item() - 1) < 1e-15
    assert torch.equal(w64.float(), w)
    if agg == "token":
        assert torch.allclose(w[mask], torch.full_like(w[mask], 1 / 6))
    else:
        assert w[1, 0].item() == pytest.approx(1 / 3)


# ----------------------------------------------------------------------------
# dynamic sampling: B informative groups a step


def test_dynamic_sampling_keeps_b_informative_groups(random_lm, monkeypatch):
    model, tok = random_lm
    calls = iter([torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]),  # round 1: 1 of 3 informative
                  torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0],
                                [0.0, 0.0]])])
    monkeypatch.setattr(step, "score", lambda ro, answers, *a: next(calls))
    cfg = brorl.Config(n_rollouts=2, prompts_per_step=3, max_new_tokens=2, max_rounds=5)
    train = [dict(prompt=f"{i}+1=", answer=str(i + 1), task="arith") for i in range(50)]
    rng = random.Random(0)
    # prompts asked for: ceil(3 / 1.0) = 3, then at this step's rate ceil(2 / (1/3)) = 6
    want = iter([3, 6])
    orig = step.generate
    def spy(model, tok, prompts, *a, **k):
        assert len(prompts) == next(want)
        return orig(model, tok, prompts, *a, **k)
    monkeypatch.setattr(step, "generate", spy)
    kept, stats = brorl.sample_step_groups(model, tok, cfg, train, rng, 1, keep_est=1.0)
    assert stats.groups_generated == 9 and stats.rounds == 2
    assert stats.groups_survived == 4  # keep_rate counts survivors before truncation: 4 / 9
    assert stats.groups_kept == 3 and len(kept) == 3  # the 4th survivor is dropped: exactly B
    assert all(g.rewards.min() != g.rewards.max() and g.rollouts is not None for g in kept)


def all_wrong(ro, answers, *a):
    """A scorer that marks every rollout wrong. (prompts, n)"""
    return torch.zeros(len(ro.prompt_ids), ro.n)


def test_dynamic_sampling_gives_up_after_max_rounds(random_lm, monkeypatch):
    model, tok = random_lm
    monkeypatch.setattr(step, "score", all_wrong)
    cfg = brorl.Config(n_rollouts=2, prompts_per_step=2, max_new_tokens=2, max_rounds=3)
    train = [dict(prompt=f"{i}+1=", answer=str(i + 1), task="arith") for i in range(50)]
    kept, stats = brorl.sample_step_groups(model, tok, cfg, train, random.Random(0), 1,
                                           keep_est=0.5)
    assert kept == [] and stats.rounds == 3 and stats.groups_kept == 0


def test_without_dynamic_sampling_exactly_b_groups_are_generated(monkeypatch):
    asked = []

    def fake_generate(model, tok, prompts, n, *args):
        asked.append(len(prompts))
        R = len(prompts) * n
        return types.SimpleNamespace(prompt_ids=[[1]] * len(prompts), n=n,
                                     mask=torch.ones(R, 2, dtype=torch.bool),
                                     truncated=torch.zeros(R, dtype=torch.bool))

    monkeypatch.setattr(step, "generate", fake_generate)
    monkeypatch.setattr(step, "score", all_wrong)
    cfg = brorl.Config(n_rollouts=4, prompts_per_step=3, dynamic_sampling=False)
    train = [dict(prompt=f"{i}+1=", answer=str(i + 1), task="arith") for i in range(50)]
    kept, stats = brorl.sample_step_groups(None, None, cfg, train, random.Random(0), None,
                                           keep_est=0.5)
    assert asked == [3] and len(kept) == 3 and stats.groups_generated == 3


# ----------------------------------------------------------------------------
# log-probs: the Triton kernel (the interpreter on a CPU) and the torch reference against float64


FP32_TOL = 1e-5  # fp32 accumulation over <= 50k columns: observed errors are ~2e-6
# where the kernel tests run: on a GPU the compiled kernel, on a CPU the interpreter
KDEV = "cuda" if torch.cuda.is_available() else "cpu"
# where the interpreter cannot run (triton 3.6 with numpy >= 2.4) the kernel tests skip with its
# one-line reason
NO_KERNEL = "" if KDEV == "cuda" else kernels.interpreter_problem()
needs_kernel = pytest.mark.skipif(bool(NO_KERNEL), reason=NO_KERNEL)


def _inputs(lead, V, dtype, seed, n_ignored=1, device=KDEV):
    """Random logits (*lead, V) ~ 4 * randn in dtype, targets (*lead) with n_ignored -100s,
    and an upstream gradient (*lead) so that every row's gradient is scaled differently."""
    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(*lead, V, generator=gen)).to(dtype)
    t = torch.randint(0, V, lead, generator=gen)
    t.view(-1)[torch.randperm(t.numel(), generator=gen)[:n_ignored]] = -100
    g = torch.randn(lead, generator=gen)
    return x.to(device), t.to(device), g.to(device)


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


@pytest.mark.parametrize("lead, V, temperature", [
    ((5,), 1000, 1.0),       # (R,), V not a multiple of BLOCK_V, one partial block
    ((2, 3), 1000, 0.7),     # (B, T)
    ((1,), 50257, 1.3),      # a single row, 50 vocabulary blocks, last one partial
    ((2, 2), 50257, 0.7),
])
@needs_kernel
def test_kernel_fp32_matches_float64(lead, V, temperature):
    x, t, g = _inputs(lead, V, torch.float32, seed=V + len(lead))
    if lead == (1,):
        t[0] = 7  # the single row must not be the ignored one
    ours = _run(x, t, g, temperature, "triton")
    assert ours[0].shape == ours[1].shape == t.shape and ours[2].shape == x.shape
    _assert_fp32_close(ours, _oracle(x, t, g, temperature), t)


# ----------------------------------------------------------------------------
# Theorem 1 (the mass balance of one update) and Lemma 2 (unsampled mass falls with N)


def _random_case(v, n, seed):
    """Random peaked logits (V,), a random correct mask and the distinct tokens of n draws."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(v, generator=gen, dtype=torch.float64)  # (V,)
    correct = torch.rand(v, generator=gen) < 0.4  # (V,)
    draws = torch.multinomial(logits.softmax(-1), n, replacement=True, generator=gen)  # (n,)
    sampled = torch.zeros(v, dtype=torch.bool).index_fill_(0, draws, True)  # (V,)
    u = torch.rand(2, generator=gen, dtype=torch.float64)
    r_c, r_w = 0.2 + 1.5 * u[0].item(), -1.5 * u[1].item()  # any R_c > 0 >= R_w
    return logits, correct, sampled, r_c, r_w


@pytest.mark.parametrize("n", [1, 4, 16, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_theorem1_matches_exact_softmax_change(n, seed):
    # one exact step of the update Theorem 1 linearises, small lr, float64: the first-order
    # prediction must match the exact change of Q_pos to relative error O(lr) << 1e-3
    logits, correct, sampled, r_c, r_w = _random_case(v=53, n=n, seed=seed)
    lr = 1e-5
    new = mb.surrogate_logit_step(logits, correct, sampled, r_c, r_w, lr=lr, n=n)
    exact = (new.softmax(-1)[correct].sum() - logits.softmax(-1)[correct].sum()).item()
    terms = mb.mass_balance_terms(logits.softmax(-1), correct, sampled, r_c, r_w, lr=lr, n=n)
    assert abs(terms.total - exact) <= 1e-3 * abs(exact)
    assert terms.total == pytest.approx(sum(terms[:3]), rel=1e-12)
    # the paper's sign claims: sampled terms never negative
    assert terms.sampled_correct >= 0 and terms.sampled_incorrect >= 0


def test_theorem1_unsampled_coupling_can_shrink_correct_mass():
    # a big correct token left unsampled: the coupling term wins and Q_pos falls, exactly too
    # tokens: sampled correct, unsampled correct, unsampled wrong
    probs = torch.tensor([0.1, 0.8, 0.1], dtype=torch.float64)
    correct = torch.tensor([True, True, False])
    sampled = torch.tensor([True, False, False])
    terms = mb.mass_balance_terms(probs, correct, sampled, lr=1e-4)
    assert terms.unsampled_coupling < 0 and terms.total < 0
    new = mb.surrogate_logit_step(probs.log(), correct, sampled, lr=1e-4)
    exact = new.softmax(-1)[:2].sum().item() - 0.9
    assert exact < 0 and abs(terms.total - exact) <= 1e-3 * abs(exact)


@pytest.mark.parametrize("n", [1, 7, 40])
def test_lemma2_matches_monte_carlo(n):
    gen = torch.Generator().manual_seed(n)
    v, trials = 31, 20_000
    probs = (1.5 * torch.randn(v, generator=gen, dtype=torch.float64)).softmax(-1)  # (V,)
    correct = torch.rand(v, generator=gen) < 0.5  # (V,)
    draws = torch.multinomial(probs.expand(trials, v), n, replacement=True,
                              generator=gen)  # (trials, n)
    unsampled = torch.ones(trials, v, dtype=torch.bool).scatter_(1, draws, False)  # (trials, V)
    for mask in (None, correct, ~correct):
        keep = unsampled if mask is None else unsampled & mask
        u2 = (probs ** 2 * keep).sum(1)  # (trials,) unsampled squared mass per trial
        se = u2.std().item() / trials ** 0.5
        assert abs(u2.mean().item() - mb.expected_unsampled_mass(probs, n, mask)) <= 3 * se


def test_lemma2_falls_with_n():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    values = [mb.expected_unsampled_mass(probs, n) for n in (0, 1, 4, 16, 64, 512)]
    assert values[0] == pytest.approx((probs ** 2).sum().item())
    assert all(a > b for a, b in zip(values, values[1:]))


# ----------------------------------------------------------------------------
# brorl.py end to end: its command line, a short run


def run_cli(*args, cwd=HERE):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(HERE / "brorl.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


SMALL = ["--n_rollouts", "32", "--prompts_per_step", "2", "--eval_prompts", "4",
         "--eval_samples", "4", "--probe_prompts", "2", "--max_rows", "256"]


def run_in_process(capsys, *args):
    """brorl's command line, in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        brorl.train(brorl.parse_config(list(args)))
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.slow
def test_two_step_run_writes_metrics_plot_and_checkpoint(tmp_path):
    out = tmp_path / "run"
    p = run_cli("--steps", "2", "--eval_every", "1", "--kl_coef", "1e-4", "--ref_reset_every", "1",
                "--out", str(out), *SMALL)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    need = {"step", "reward_mean", "keep_rate", "zero_adv_frac", "pass@1", "pass@N", "kl",
            "clip_frac", "entropy", "resp_len", "tokens_per_s", "time_rollout", "time_update",
            "eval_pass@1", "eval_pass@k", "mass_mean", "mass_rose", "mass_fell", "mass_worst_drop",
            "max_ratio_dev"}
    assert need <= set(rows[2]), need - set(rows[2])
    # float32 rounding between the decode and the training forward: ~1e-6, the largest seen 1.3e-5
    # (logp -2.9)
    assert all(r["max_ratio_dev"] < 3e-5 for r in rows[1:] if r["groups_kept"])
    saved = json.loads((out / "config.json").read_text())
    assert saved["n_rollouts"] == 32 and saved["steps"] == 2
    assert (out / "metrics.png").stat().st_size > 10_000
    assert (out / "ckpt" / "config.json").exists() and not (out / "ckpt.tmp").exists()
