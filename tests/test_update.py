"""The policy update (brorl.update_policy) as engineering: micro-batching changes memory, not the
gradient; the sampler's log-probs as the old policy give the recompute's update; the gradient is bitwise
reproducible; --old_logp auto's choice."""

import pytest
import torch

import brorl
from lib import logprobs, step
import sampler
from test_brorl import PROMPTS, random_lm  # noqa: F401  (random_lm is a fixture)


def _one_update(model, batch, adv, micro_batch, kl_coef=0.0, old_logp="recompute"):
    """Parameters after one SGD step (lr 1) of update_policy: equal params <=> equal gradients.
    In float64, so that what is compared is the normaliser, not fp32 summation order."""
    m = type(model).from_pretrained(model.name_or_path, attn_implementation="brorl").double().train()
    cfg = brorl.Config(micro_batch=micro_batch, n_minibatches=1, grad_clip=1e9, kl_coef=kl_coef, old_logp=old_logp)
    ref = type(model).from_pretrained(model.name_or_path, attn_implementation="brorl").double() if kl_coef else None
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    before = [p.detach().clone() for p in m.parameters()]
    info = brorl.update_policy(m, ref, opt, batch, adv, cfg, torch.Generator().manual_seed(0))
    return [b - p.detach() for b, p in zip(before, m.parameters())], info


def test_micro_batching_changes_memory_not_the_gradient(random_lm):
    model, tok = random_lm
    ro = sampler.generate(model, tok, PROMPTS[:3], 6, 8, 1.0, 1.0, 4096, torch.Generator().manual_seed(3))
    batch = step.pack_groups([ro.group(g) for g in range(3)])
    adv = torch.randn(18, generator=torch.Generator().manual_seed(4))
    full, info = _one_update(model, batch, adv, micro_batch=18, kl_coef=0.1)
    for mb in (1, 5):
        part, _ = _one_update(model, batch, adv, micro_batch=mb, kl_coef=0.1)
        for a, b in zip(full, part):
            assert (a - b).norm() <= 1e-6 * a.norm() + 1e-12
    assert info["max_ratio_dev"] < 1e-5  # one engine: first mini-batch ratio is exactly 1


def test_sampler_logp_as_old_policy_gives_the_recompute_update(random_lm):
    """--old_logp sampler (auto's choice in float32) skips a forward over every row; the update and
    the entropy metric must be the recompute's, up to the rounding between the two forwards."""
    model, tok = random_lm
    ro = sampler.generate(model, tok, PROMPTS[:3], 6, 8, 1.0, 1.0, 4096, torch.Generator().manual_seed(5))
    batch = step.pack_groups([ro.group(g) for g in range(3)])
    adv = torch.randn(18, generator=torch.Generator().manual_seed(6))
    recomputed, info_r = _one_update(model, batch, adv, micro_batch=7, old_logp="recompute")
    reused, info_s = _one_update(model, batch, adv, micro_batch=7, old_logp="sampler")
    for a, b in zip(recomputed, reused):
        assert (a - b).norm() <= 1e-5 * a.norm() + 1e-12
    assert info_s["entropy"] == pytest.approx(info_r["entropy"], rel=1e-5)
    assert 0 < info_s["max_ratio_dev"] < 2e-5  # float64 trainer vs float32 sampler: rounding (as above)


def test_training_gradient_is_bitwise_reproducible(random_lm):
    """Same seed, same gradient, to the bit: a shuffled micro-batch gathers its prompts' keys/values
    per row, and that gather's backward must sum the N rows' gradients in a fixed order (x[idx]'s
    backward on a CPU does not: runs drifted apart from their first step)."""
    model, tok = random_lm
    ro = sampler.generate(model, tok, PROMPTS[:2], 256, 6, 1.0, 1.0, 4096, torch.Generator().manual_seed(7))
    batch = step.pack_groups([ro.group(g) for g in range(2)])
    rows = torch.randperm(512, generator=torch.Generator().manual_seed(8))[:384]  # both prompts, shuffled

    def grads():
        model.zero_grad(set_to_none=True)
        logprobs.response_logprobs(model, batch, rows, 1.0).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    first = grads()
    assert all(torch.equal(first, grads()) for _ in range(3))
    model.zero_grad(set_to_none=True)


def test_old_logp_auto_recomputes_unless_the_forward_is_float32():
    fp32, bf16 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).bfloat16()
    assert logprobs.uses_sampler_logp(brorl.Config(), fp32)  # float32: the sampler's log-probs
    assert not logprobs.uses_sampler_logp(brorl.Config(), bf16)  # bf16 weights: a trainer forward
    assert not logprobs.uses_sampler_logp(brorl.Config(dtype="bfloat16"), fp32)  # bf16 autocast: a trainer forward
    assert logprobs.uses_sampler_logp(brorl.Config(dtype="bfloat16", old_logp="sampler"), fp32)
    assert not logprobs.uses_sampler_logp(brorl.Config(old_logp="recompute"), fp32)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps, at every step, the parameters before it and their gradients."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self):
        self.seen.append([(p.detach().clone(), p.grad.detach().clone()) for p in self.param_groups[0]["params"]])
        super().step()


def test_update_is_the_readmes_loss_with_old_sampler_and_current_policies_apart(random_lm, monkeypatch):
    """Each mini-batch's gradient in update_policy is the gradient of the README's loss written out here,
    with the old, sampler and current log-probs all different (the sampler's shifted, the current moved by
    the first mini-batch's step) and a reference apart from all three: ratio, clip, dual clip, TIS as a
    constant weight (no gradient through it, whatever it is computed from), the k2 KL, 1/T_M. float64."""
    model, tok = random_lm
    ro = sampler.generate(model, tok, PROMPTS[:3], 6, 8, 1.0, 1.0, 4096, torch.Generator().manual_seed(11))
    batch = step.pack_groups([ro.group(g) for g in range(3)])
    g = torch.Generator().manual_seed(12)
    batch.sampler_logp = batch.sampler_logp.double() + 0.3 * torch.randn(18, batch.resp.shape[1], generator=g,
                                                                         dtype=torch.float64)  # (R, T)
    adv = torch.randn(18, generator=g, dtype=torch.float64)  # (R,)
    load = lambda: type(model).from_pretrained(model.name_or_path, attn_implementation="brorl").double()
    m, ref, start = load().train(), load(), load()
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    cfg = brorl.Config(micro_batch=5, n_minibatches=2, grad_clip=1e9, old_logp="recompute", kl_coef=0.1, tis_cap=1.2,
                       clip_ratio_c=1.05, loss_agg="token")  # c near 1: the dual clip binds after one step
    opt = RecordingSGD(m.parameters(), lr=3.0)
    weights, dtypes = brorl.loss_weights, set()
    monkeypatch.setattr(brorl, "loss_weights", lambda *a, **k: (lambda w: dtypes.add(w.dtype) or w)(weights(*a, **k)))
    brorl.update_policy(m, ref, opt, batch, adv, cfg, torch.Generator().manual_seed(0))
    assert dtypes == {torch.float64}  # the weights in the loss's dtype
    minibatches = torch.randperm(18, generator=torch.Generator().manual_seed(0)).tensor_split(2)  # update_policy's
    C, c, lo, hi = cfg.tis_cap, cfg.clip_ratio_c, cfg.clip_low, cfg.clip_high
    moved, binds = [], []
    for (params, grads), rows in zip(map(lambda s: list(zip(*s)), opt.seen), minibatches):
        now = load().train()
        with torch.no_grad():
            for p, v in zip(now.parameters(), params):
                p.copy_(v)
            old = logprobs.response_logprobs(start, batch, rows, 1.0)  # (r, T) before any update
            ref_logp = logprobs.response_logprobs(ref, batch, rows, 1.0)  # (r, T)
        logp = logprobs.response_logprobs(now, batch, rows, 1.0)  # (r, T)
        mask, A, sampler_logp = batch.resp_mask[rows], adv[rows][:, None], batch.sampler_logp[rows]
        ratio = torch.exp(torch.clamp(logp - old, -20, 20))
        pg = torch.max(-ratio * A, -torch.clamp(ratio, 1 - lo, 1 + hi) * A)
        pg = torch.where(A < 0, torch.min(pg, c * A.abs()), pg)
        tis = torch.clamp(torch.exp(old - sampler_logp), max=C)  # old and sampler carry no gradient: a constant
        kl = 0.5 * torch.clamp(logp - ref_logp, -10, 10) ** 2
        loss = ((tis * pg + cfg.kl_coef * kl) * mask).sum() / mask.sum()
        expected = torch.autograd.grad(loss, list(now.parameters()))
        for got, want in zip(grads, expected):  # float64, but the attention scores are float32 (sampler.py): ~1e-7 apart
            assert (got - want).norm() <= 1e-6 * want.norm() + 1e-12
        moved.append(((logp.detach() - old).abs() * mask).max().item())
        binds.append([int((((ratio > 1 + hi) & (A > 0)) | ((ratio < 1 - lo) & (A < 0)))[mask].sum()),
                      int(((ratio > c) & (A < 0))[mask].sum())])  # tokens where the clip, the dual clip bind
        assert ((tis < C) & mask).any() and ((tis == C) & mask).any()  # TIS weights, some truncated
    assert moved[0] < 1e-5 < 1e-2 < moved[1]  # the second mini-batch: current != old (!= sampler)
    assert binds[0] == [0, 0] and min(binds[1]) > 0  # there: both clips bind on some tokens
