"""The objectives beside PPO (--loss gspo|cispo, Dr. GRPO's --adv_norm none and --loss_agg constant) and
--train_rollouts' max-variance subset. Each loss is checked, values and gradients, against its paper's
formula written out independently: per sequence and per token, in plain Python loops over float64."""

import itertools
import math

import pytest
import torch

import brorl
from lib import objectives, policy
import data


def _batch(seed=0, r=5, T=7):
    """Fresh random log-probs (r, T), old log-probs near them, advantages of both signs, ragged masks."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(r, T, generator=g, dtype=torch.float64) * 3  # (r, T)
    logp = old + 0.3 * torch.randn(r, T, generator=g, dtype=torch.float64)  # (r, T): ratios on both sides of the clip
    lengths = torch.randint(1, T + 1, (r,), generator=g)
    lengths[0] = T
    mask = torch.arange(T)[None, :] < lengths[:, None]  # (r, T)
    adv = torch.randn(r, generator=g, dtype=torch.float64)  # (r,)
    return logp, old, adv, mask


def _grad(fn, logp):
    x = logp.clone().requires_grad_()
    value = fn(x)
    value.backward()
    return value.detach(), x.grad


def test_gspo_matches_the_papers_sequence_objective():
    """GSPO's J = mean_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i), s_i = (pi/pi_old)(y_i)^(1/|y_i|)."""
    logp, old, adv, mask = _batch(1)
    lo, hi = 0.05, 0.08  # wider than the paper's, so that some sequences clip and some do not

    def paper(x):
        total = 0.0
        for i in range(x.shape[0]):
            n = int(mask[i].sum())
            s = torch.exp(sum(x[i, t] - old[i, t] for t in range(n)) / n)
            total = total + torch.min(s * adv[i], s.clamp(1 - lo, 1 + hi) * adv[i])
        return -total / x.shape[0]

    def ours(x):
        loss, _ = objectives.gspo_token_loss(x, old, adv, mask, lo, hi)
        return (loss * brorl.loss_weights(mask, "sequence")).sum()

    (v_ref, g_ref), (v, g) = _grad(paper, logp), _grad(ours, logp)
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(g, g_ref)
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))
    clipped = ((s > 1 + hi) & (adv > 0)) | ((s < 1 - lo) & (adv < 0))
    assert clipped.any() and (~clipped).any()  # both branches were exercised
    assert (g[clipped] == 0).all()  # a clipped sequence: no gradient on any of its tokens


def test_cispo_matches_the_papers_token_objective():
    """CISPO's J = sum_i sum_t sg(min(r_it, 1+eps_h)) A_i log pi(y_it) / sum_i |y_i|: every token's
    gradient is kept; the clip truncates the weight, never zeroes it."""
    logp, old, adv, mask = _batch(2)
    hi = 0.1

    def paper(x):
        total, n = 0.0, 0
        for i in range(x.shape[0]):
            for t in range(int(mask[i].sum())):
                w = min(math.exp(float(x[i, t].detach() - old[i, t])), 1 + hi)  # a number: no gradient through it
                total, n = total + w * adv[i] * x[i, t], n + 1
        return -total / n

    def ours(x):
        loss, _ = objectives.cispo_token_loss(x, old, adv, hi)
        return (loss * brorl.loss_weights(mask, "token")).sum()

    (v_ref, g_ref), (v, g) = _grad(paper, logp), _grad(ours, logp)
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(g, g_ref)
    assert ((torch.exp(logp - old) > 1 + hi) & mask).any()  # some weights were truncated...
    assert (g[mask] != 0).all()  # ...and still every valid token has a gradient


def test_dr_grpo_constant_normaliser_and_no_std():
    """Dr. GRPO: advantages r - mean_group(r); the loss summed over tokens and divided by a constant,
    the generation budget times the rows, whatever the responses' lengths."""
    r = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    expected = [[0.75, -0.25, -0.25, -0.25], [0.25, 0.25, 0.25, -0.75], [0, 0, 0, 0]]
    torch.testing.assert_close(brorl.compute_advantages(r, "none"), torch.tensor(expected))
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    w = brorl.loss_weights(mask, "constant", n_rows=3, max_len=6)
    torch.testing.assert_close(w, mask.float() / 18)
    long_rows = torch.ones(3, 6, dtype=torch.bool)  # the sum of the weights reaches 1 only at full length
    assert brorl.loss_weights(long_rows, "constant", max_len=6).sum().item() == pytest.approx(1.0)


@pytest.mark.parametrize("loss,agg", [("gspo", "sequence"), ("cispo", "token"), ("ppo", "constant")])
def test_micro_batching_changes_memory_not_the_gradient(tmp_path, loss, agg):
    """As PPO's test in tests/test_update.py: any micro-batch size gives the one-shot update, for every objective."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    tok = data.build_tokenizer()
    torch.manual_seed(0)
    mc = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    Qwen2ForCausalLM(mc).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="brorl").eval()
    ro = brorl.generate(model, tok, ["12+3=", "4+56="], 6, 6, 1.0, 1.0, 4096, torch.Generator().manual_seed(3))
    batch = policy.pack_groups([ro.group(g) for g in range(2)])
    adv = torch.randn(12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)

    def update(micro_batch):
        m = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="brorl").double().train()
        # the old policy a little off the current one, so that clips bind
        old = {**batch, "sampler_logp": batch["sampler_logp"].double() + 0.2 * torch.randn(
            batch["sampler_logp"].shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)}
        cfg = brorl.Config(micro_batch=micro_batch, n_minibatches=1, grad_clip=1e9, old_logp="sampler", loss=loss,
                           loss_agg=agg, max_new_tokens=6, tis_cap=0, gspo_clip_low=0.05, gspo_clip_high=0.05)
        opt = torch.optim.SGD(m.parameters(), lr=1.0)
        before = [p.detach().clone() for p in m.parameters()]
        info = brorl.update_policy(m, None, opt, old, adv, cfg, torch.Generator().manual_seed(0))
        return [b - p.detach() for b, p in zip(before, m.parameters())], info

    full, info = update(12)
    assert 0 < info["clip_frac"] < 1 and math.isfinite(info["grad_norm"]) and info["grad_norm"] > 0
    for mb in (1, 5):
        part, _ = update(mb)
        for a, b in zip(full, part):
            assert (a - b).norm() <= 1e-6 * a.norm() + 1e-12  # as PPO's test: the log-prob kernel sums in its own order


@pytest.mark.parametrize("binary", [True, False])
def test_max_variance_subset_is_the_max_over_all_subsets(binary):
    """PODS's rule against brute force over every m-subset of small groups, binary and real rewards."""
    g = torch.Generator().manual_seed(7 + binary)
    N = 8
    r = torch.randint(0, 2, (6, N), generator=g).float() if binary else torch.randn(6, N, generator=g)  # (G, N)
    for m in (2, 3, 5, N):
        keep = objectives.max_variance_subset(r, m)  # (G, m)
        assert keep.shape == (6, m) and (keep.diff(1) > 0).all()  # distinct, ascending
        for i in range(6):
            best = max(r[i, list(c)].var(unbiased=False).item() for c in itertools.combinations(range(N), m))
            assert r[i, keep[i]].var(unbiased=False).item() == pytest.approx(best, abs=1e-6)
    assert torch.equal(objectives.max_variance_subset(r, N), torch.arange(N).expand(6, N))  # m = N: all, in order


def test_pack_groups_keeps_the_chosen_rows(tmp_path):
    """--train_rollouts: the batch holds exactly the chosen rollouts of each group, in order; keep = all
    rollouts gives the batch of a run without it."""
    ro = brorl.Rollouts(prompt_ids=[[1, 2], [3]], tokens=torch.arange(12).view(6, 2), mask=torch.ones(6, 2, dtype=torch.bool),
                        logp=-torch.rand(6, 2), entropy=torch.rand(6, 2), truncated=torch.zeros(6, dtype=torch.bool),
                        texts=[""] * 6, n=3)
    full = policy.pack_groups([ro.group(0), ro.group(1)])
    sub = policy.pack_groups([ro.group(g, keep) for g, keep in enumerate(torch.tensor([[0, 2], [1, 2]]))])
    assert torch.equal(sub["resp"], ro.tokens[[0, 2, 4, 5]]) and torch.equal(sub["sampler_logp"], ro.logp[[0, 2, 4, 5]])
    assert sub["group"].tolist() == [0, 0, 1, 1] and sub["lengths"].shape == (2, 2)
    same = policy.pack_groups([ro.group(g, torch.arange(3)) for g in range(2)])
    assert all(torch.equal(full[k], same[k]) for k in full if torch.is_tensor(full[k]))


def test_planner_counts_the_trained_rows_only():
    """--train_rollouts m: the update holds G*m rows, not G*N: its (rows, T) tensors shrink by N/m."""
    from lib import planner
    from transformers import Qwen2Config
    mc = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300)
    rows_item = lambda cfg: dict(planner.plan(mc, cfg, 16)["update"])["step's (rows, T) tensors"]
    full, sub = brorl.Config(n_rollouts=512), brorl.Config(n_rollouts=512, train_rollouts=64)
    assert rows_item(full) == 8 * rows_item(sub) > 0
