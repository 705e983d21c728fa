"""The objectives beside PPO (--loss gspo|cispo|sapo, Dr. GRPO's --adv_norm none and --loss_agg constant) and
--train_rollouts' max-variance subset. Each loss is checked, values and gradients, against its paper's
formula written out independently: per sequence and per token, in plain Python loops over float64."""

import ast
import dataclasses
import io
import itertools
import json
import math
import random
import re
import subprocess
import tokenize
from pathlib import Path

import pytest
import torch

import brorl
from lib import objectives, step
import data
import sampler


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


def sapo_by_hand(ratio: float, adv: float, tau_pos: float, tau_neg: float) -> float:
    """SAPO's loss of one token (arXiv 2511.20347, eq. of its gate), in plain floats:
    -sigmoid(tau (r - 1)) * 4 / tau * A, tau = tau_pos where A > 0, else tau_neg."""
    tau = tau_pos if adv > 0 else tau_neg
    return -1 / (1 + math.exp(-tau * (ratio - 1))) * 4 / tau * adv


def test_sapo_token_loss_by_hand():
    """Four tokens at the defaults (tau_pos 1.0, tau_neg 1.05), written out: a positive advantage
    above and below ratio 1, a negative one, A = 0 (which takes tau_neg, as TRL's and verl's
    A > 0 test does). The numbers are the formula's, computed here in floats."""
    cfg = brorl.Config(loss="sapo")
    ratios, advs = [1.5, 0.8, 1.3, 1.2], [2.0, 0.5, -1.0, 0.0]
    # -sigmoid(0.5) * 4 * 2; -sigmoid(-0.2) * 4 * 0.5; sigmoid(1.05 * 0.3) * 4 / 1.05; 0
    want = [-4.979675, -0.900332, 2.202306, 0.0]
    assert [round(sapo_by_hand(r, a, cfg.sapo_tau_pos, cfg.sapo_tau_neg), 6)
            for r, a in zip(ratios, advs)] == want
    old = torch.tensor([[-1.0], [-2.0], [-0.5], [-3.0]], dtype=torch.float64)  # (r, 1)
    logp = old + torch.tensor(ratios, dtype=torch.float64).log()[:, None]  # (r, 1)
    loss, ratio = objectives.sapo_token_loss(logp, old, torch.tensor(advs, dtype=torch.float64),
                                             cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    torch.testing.assert_close(ratio[:, 0], torch.tensor(ratios, dtype=torch.float64))
    assert loss[:, 0].tolist() == pytest.approx(want, abs=1e-6)


def test_sapo_matches_the_papers_objective_and_is_the_policy_gradient_on_policy():
    """SAPO's J = mean_i (1 / |y_i|) sum_t f_it(r_it) A_i, f(r) = sigmoid(tau (r - 1)) 4 / tau
    (tau by A's sign), its loss -J: values and gradients against the formula in a float64 loop,
    with temperatures far apart so that a swap shows; through brorl.token_loss (what the update
    computes) --loss sapo's mean is the per-sequence one. At ratio 1 its gradient is the policy
    gradient's, -mean_i (1 / |y_i|) sum_t A_i d logp_it: the 4 / tau undoes the gate's slope."""
    logp, old, adv, mask = _batch(3)
    tau_pos, tau_neg = 0.6, 2.5

    def paper(x, old):
        total = 0.0
        for i in range(x.shape[0]):
            n, tau = int(mask[i].sum()), tau_pos if adv[i] > 0 else tau_neg
            row = sum(torch.sigmoid(tau * (torch.exp(x[i, t] - old[i, t]) - 1)) * 4 / tau
                      for t in range(n))
            total = total + row * adv[i] / n
        return -total / x.shape[0]

    cfg = brorl.Config(loss="sapo", sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)
    w = brorl.loss_weights(mask, objectives.aggregation(cfg.loss, cfg.loss_agg), dtype=torch.float64)

    def ours(x, old):
        loss, _, clipped, _ = brorl.token_loss(x, old, old, None, adv, mask, w, cfg)
        assert not clipped.any()  # no clip: the gate fades a gradient, never zeroes it
        return loss.sum()

    (v_ref, g_ref), (v, g) = (_grad(lambda x: f(x, old), logp) for f in (paper, ours))
    torch.testing.assert_close(v, v_ref)
    torch.testing.assert_close(g, g_ref)
    assert (adv > 0).any() and (adv < 0).any()  # both temperatures were exercised
    # On policy (ratio 1): the policy gradient's, -A / (|y_i| rows) on each valid token.
    _, g_on = _grad(lambda x: ours(x, logp), logp)
    torch.testing.assert_close(g_on, -adv[:, None] * w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("edge", [0, 1], ids=["smallest", "largest"])
def test_sapo_at_its_accepted_temperatures_is_finite_and_on_policy_the_policy_gradient(dtype, edge):
    """At the edges of the taus the checks accept (lib/checks.SCALE), in float32 and bfloat16 (the
    dtypes a run computes in): the loss is finite and its gradient at ratio 1 is still the policy
    gradient, -A w on each valid token, whatever the 4 / tau and the tau it passes through."""
    from lib import checks
    logp, _, adv, mask = _batch(7)
    adv = adv * 3  # (r,) advantages past 2, as a group with one right rollout in 16 has
    tau = checks.SCALE[edge]
    cfg = brorl.Config(loss="sapo", sapo_tau_pos=tau, sapo_tau_neg=tau)
    x, a = logp.to(dtype), adv.to(dtype)  # (r, T), (r,)
    w = brorl.loss_weights(mask, "sequence", dtype=dtype)  # (r, T)

    def on_policy(y):
        loss = brorl.token_loss(y, x, x, None, a, mask, w, cfg)[0]  # (r, T)
        assert loss.isfinite().all()
        return loss.sum()

    _, g = _grad(on_policy, x)
    torch.testing.assert_close(g.double(), (-adv[:, None] * w.double()), rtol=1e-2, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sapo_run_at_extreme_temperatures_is_refused_or_steps_without_nan(tmp_path, capsys,
                                                                              dtype):
    """--sapo_tau_pos / _neg at 1e-40 and 1e39 (once a NaN gradient, and float32's overflow, both
    at step 1, after the step-0 evaluation was written) are one line at parse time; at the edges
    that are accepted, one real step of a tiny run trains, its gradient finite."""
    from test_brorl import SMALL
    for tau in ("1e-40", "1.1e-19", "1.8e19", "1e39"):
        flags = ["--loss", "sapo", "--sapo_tau_pos", tau, "--sapo_tau_neg", tau]
        capsys.readouterr()  # the last run's progress, apart
        try:
            cfg = brorl.parse_config([*flags, "--dtype", dtype, "--steps", "1", "--eval_every", "1",
                                      "--save", "false", "--out", str(tmp_path / tau), *SMALL])
        except SystemExit as stop:
            err = capsys.readouterr().err
            assert stop.code == 2 and len(err.strip().splitlines()) == 1, err
            assert "--sapo_tau_pos" in err and tau in ("1e-40", "1e39"), err
            continue
        rows = brorl.train(cfg)
        step_row = next(r for r in rows if r["step"] == 1 and "grad_norm" in r)
        assert math.isfinite(step_row["grad_norm"]) and step_row["grad_norm"] > 0, step_row


def test_dr_grpo_constant_normaliser_and_no_std():
    """Dr. GRPO: advantages r - mean_group(r); the loss summed over tokens and divided by a constant,
    the generation budget times the rows, whatever the responses' lengths."""
    r = torch.tensor([[1.0, 0, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]])
    expected = [[0.75, -0.25, -0.25, -0.25], [0.25, 0.25, 0.25, -0.75], [0, 0, 0, 0]]
    group = torch.arange(3).repeat_interleave(4)  # (12,)
    torch.testing.assert_close(brorl.compute_advantages(r.flatten(), group, "none").view(3, 4),
                               torch.tensor(expected))
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    w = brorl.loss_weights(mask, "constant", n_rows=3, max_len=6)
    torch.testing.assert_close(w, mask.float() / 18)
    long_rows = torch.ones(3, 6, dtype=torch.bool)  # the sum of the weights reaches 1 only at full length
    assert brorl.loss_weights(long_rows, "constant", max_len=6).sum().item() == pytest.approx(1.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Qwen2 saved to disk, a batch of 2 groups x 6 rollouts of it, and advantages (12,)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    path = tmp_path_factory.mktemp("tiny")
    tok = data.build_tokenizer()
    torch.manual_seed(0)
    mc = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, initializer_range=0.3,
                     eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, tie_word_embeddings=False)
    Qwen2ForCausalLM(mc).save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="brorl").eval()
    ro = sampler.generate(model, tok, ["12+3=", "4+56="], 6, 6, 1.0, 1.0, 4096, torch.Generator().manual_seed(3))
    batch = step.pack_groups([ro.group(g) for g in range(2)])
    adv = torch.randn(12, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    return path, batch, adv


def _update(tiny, micro_batch, batch=None, **flags):
    """The parameter change of one SGD step (lr 1) of update_policy in float64, with the old policy a little
    off the current one so that clips bind, and the update's metrics."""
    from transformers import AutoModelForCausalLM
    path, tiny_batch, adv = tiny
    batch = batch or tiny_batch
    m = AutoModelForCausalLM.from_pretrained(path, attn_implementation="brorl").double().train()
    old = dataclasses.replace(batch, sampler_logp=batch.sampler_logp.double() + 0.2 * torch.randn(
        batch.sampler_logp.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    cfg = brorl.Config(micro_batch=micro_batch, n_minibatches=1, grad_clip=1e9, old_logp="sampler", max_new_tokens=6,
                       tis_cap=0, **flags)
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    before = [p.detach().clone() for p in m.parameters()]
    info = brorl.update_policy(m, None, opt, old, adv, cfg, torch.Generator().manual_seed(0))
    return [b - p.detach() for b, p in zip(before, m.parameters())], info


@pytest.mark.parametrize("loss,agg", [("gspo", "sequence"), ("cispo", "token"), ("ppo", "constant"),
                                      ("sapo", "sequence")])
def test_micro_batching_changes_memory_not_the_gradient(tiny, loss, agg):
    """As PPO's test in tests/test_update.py: any micro-batch size gives the one-shot update, for every objective."""
    flags = dict(loss=loss, loss_agg=agg, gspo_clip_low=0.05, gspo_clip_high=0.05)
    full, info = _update(tiny, 12, **flags)
    # (SAPO has no clip to bind: its share is 0)
    assert (0 < info["clip_frac"] < 1) != (loss == "sapo") and info["clip_frac"] < 1
    assert math.isfinite(info["grad_norm"]) and info["grad_norm"] > 0
    for mb in (1, 5):
        part, _ = _update(tiny, mb, **flags)
        for a, b in zip(full, part):
            assert (a - b).norm() <= 1e-6 * a.norm() + 1e-12  # as PPO's test: the log-prob kernel sums in its own order


def test_gspo_runs_its_papers_sequence_mean_unless_told_otherwise(tiny):
    """--loss gspo alone is GSPO's objective: the per-sequence mean (a token mean weighs each sequence's ratio
    by its length). --loss_agg given is what runs; the run's first line then says it is not GSPO's."""
    assert brorl.parse_config(["--loss", "gspo"]).loss_agg == "sequence"
    assert brorl.parse_config(["--loss", "gspo", "--loss_agg", "token"]).loss_agg == "token"
    assert brorl.parse_config([]).loss_agg == brorl.parse_config(["--loss", "cispo"]).loss_agg == "token"
    assert brorl.parse_config(["--loss", "sapo"]).loss_agg == "sequence"  # TRL's and verl's mean
    _, batch, _ = tiny
    lengths = torch.arange(12) % 6 + 1  # (R,) ragged responses: 1 to 6 tokens
    mask = batch.resp_mask & (torch.arange(batch.resp_mask.shape[1])[None, :] < lengths[:, None])  # (R, T)
    ragged = dataclasses.replace(batch, resp_mask=mask, lengths=mask.sum(1).view(2, 6))
    flags = dict(batch=ragged, loss="gspo", gspo_clip_low=0.05, gspo_clip_high=0.05)
    auto, _ = _update(tiny, 12, **flags)  # Config's default, as a Config built in code gets it
    sequence, _ = _update(tiny, 12, loss_agg="sequence", **flags)
    token, _ = _update(tiny, 12, loss_agg="token", **flags)
    assert all(torch.equal(a, b) for a, b in zip(auto, sequence))
    assert sum((a - b).norm() for a, b in zip(auto, token)) > 1e-3 * sum(a.norm() for a in auto)  # ragged rows


@pytest.mark.parametrize("agg, said", [("token", True), ("sequence", False)])
def test_gspo_with_another_mean_is_said_in_the_runs_first_line(tmp_path, capsys, agg, said):
    from lib import harness
    harness.start(brorl.parse_config(["--loss", "gspo", "--loss_agg", agg, "--out", str(tmp_path / "run")]))
    first = capsys.readouterr().out.splitlines()[0]
    note = "note: --loss gspo with --loss_agg token: not GSPO's per-sequence mean (--loss_agg sequence, gspo's default)"
    assert (first == note) == said
    harness.start(brorl.parse_config(["--loss", "sapo", "--loss_agg", agg, "--out", str(tmp_path / "sapo")]))
    first = capsys.readouterr().out.splitlines()[0]
    assert (first == note.replace("gspo", "sapo").replace("GSPO", "SAPO")) == said


def test_gspo_default_bounds_are_the_papers():
    """--loss gspo with Config's default bounds clips each sequence's ratio s at the paper's [1 - 3e-4,
    1 + 4e-4] (arXiv 2507.18071), through the loss the update computes (brorl.token_loss): a sequence just
    inside keeps its gradient, one just outside loses all of it, on both sides."""
    cfg = brorl.Config(loss="gspo")
    g = torch.Generator().manual_seed(9)
    s = torch.tensor([1 + 3.5e-4, 1 + 4.5e-4, 1 - 2.5e-4, 1 - 3.5e-4, 1 + 4.5e-4], dtype=torch.float64)  # (r,)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0], dtype=torch.float64)  # the last: above, but A < 0
    clipped = [False, True, False, True, False]
    mask = torch.arange(6)[None, :] < torch.tensor([6, 3, 4, 2, 5])[:, None]  # (r, T) ragged
    old = -torch.rand(5, 6, generator=g, dtype=torch.float64) * 3  # (r, T)
    logp = (old + s.log()[:, None]).requires_grad_()  # every token's log-ratio log s: the sequence's ratio is s
    w = brorl.loss_weights(mask, objectives.aggregation(cfg.loss, cfg.loss_agg), dtype=torch.float64)
    loss, ratio, clip, _ = brorl.token_loss(logp, old, old, None, adv, mask, w, cfg)
    loss.sum().backward()
    assert [bool((logp.grad[i] == 0).all()) for i in range(5)] == clipped
    assert [bool(clip[i][mask[i]].all()) for i in range(5)] == clipped
    torch.testing.assert_close(ratio[mask], s[:, None].expand(5, 6)[mask])


def test_train_rollouts_advantages_are_over_the_trained_rows(monkeypatch):
    """--train_rollouts m (PODS) through rl_step: the update gets the m rollouts of each group whose rewards
    vary most, with advantages whitened over THOSE rows' tokens (zero mean, unit variance there), not taken
    over all N and then gathered."""
    from test_brorl import PROMPTS
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(data.EMBEDDED_MODEL, attn_implementation="brorl")
    tok = data.build_tokenizer()
    N, m = 8, 4
    pattern = torch.tensor([[1.0, 0, 0, 1, 0, 0, 0, 0], [0, 1, 1, 1, 0, 1, 1, 1]])  # 2 and 6 right of 8
    monkeypatch.setattr(step, "score", lambda ro, *a: pattern[: len(ro.prompt_ids)])
    seen = {}
    monkeypatch.setattr(brorl, "update_policy", lambda model, ref, opt, batch, adv, *a: seen.update(batch=batch, adv=adv) or {})
    cfg = brorl.Config(n_rollouts=N, train_rollouts=m, prompts_per_step=2, max_new_tokens=6)
    train = [dict(prompt=p, answer="0", task="arith") for p in PROMPTS[:2]]
    metrics = brorl.rl_step(model, model, None, None, tok, cfg, train, random.Random(0), 1, torch.Generator(), 1.0)
    lengths = torch.stack(seen["batch"].lengths).double()  # (G, m)
    adv = seen["adv"].view(2, m).double()  # (G, m)
    assert lengths.shape == (2, m) and metrics["reward_trained"] == 0.5  # the balanced subsets: 2 right, 2 wrong
    n = lengths.sum()
    mean = (lengths * adv).sum() / n  # over the trained rows' tokens
    var = (lengths * (adv - mean) ** 2).sum() / (n - 1)
    assert abs(mean) < 1e-6 and abs(var - 1) < 1e-6
    trained = pattern.gather(1, objectives.max_variance_subset(pattern, m))  # (G, m)
    group = torch.arange(2).repeat_interleave(m)  # (G*m,)
    expected = brorl.compute_advantages(trained.flatten(), group, "batch", lengths.flatten())
    torch.testing.assert_close(adv, expected.view(2, m).double())


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
    ro = sampler.Rollouts(prompt_ids=[[1, 2], [3]], tokens=torch.arange(12).view(6, 2), mask=torch.ones(6, 2, dtype=torch.bool),
                        logp=-torch.rand(6, 2), entropy=torch.rand(6, 2), truncated=torch.zeros(6, dtype=torch.bool),
                        texts=[""] * 6, n=3)
    full = step.pack_groups([ro.group(0), ro.group(1)])
    sub = step.pack_groups([ro.group(g, keep) for g, keep in enumerate(torch.tensor([[0, 2], [1, 2]]))])
    assert torch.equal(sub.resp, ro.tokens[[0, 2, 4, 5]]) and torch.equal(sub.sampler_logp, ro.logp[[0, 2, 4, 5]])
    assert sub.group.tolist() == [0, 0, 1, 1] and sub.lengths.shape == (2, 2)
    same = step.pack_groups([ro.group(g, torch.arange(3)) for g in range(2)])
    assert all(torch.equal(a, b) for a, b in zip(vars(full).values(), vars(same).values()))


def test_planner_counts_the_trained_rows_only():
    """--train_rollouts m: the update holds G*m rows, not G*N: its (rows, T) tensors shrink by N/m."""
    from lib import planner
    from transformers import Qwen2Config
    mc = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=300)
    rows_item = lambda cfg: dict(planner.plan(mc, cfg, 16)["update"])["step's (rows, T) tensors"]
    full, sub = brorl.Config(n_rollouts=512), brorl.Config(n_rollouts=512, train_rollouts=64)
    assert rows_item(full) == 8 * rows_item(sub) > 0


def _focal_by_hand(rewards, base, gamma):
    """Each group's advantages times (1 - mu)^gamma, mu its success rate, in Python loops."""
    out = []
    for r, a in zip(rewards, base):
        mu = sum(float(x) for x in r) / len(r)
        out.append([float(x) * (1 - mu) ** gamma for x in a])
    return out


def _advantages(groups, lengths, norm, gamma=0.0):
    """brorl.compute_advantages over groups given as a list of (n_j,) tensors: a list back."""
    group = torch.cat([torch.full((len(r),), j) for j, r in enumerate(groups)])  # (R,)
    adv = brorl.compute_advantages(torch.cat(groups), group, norm, torch.cat(lengths), gamma)
    return list(adv.split([len(r) for r in groups]))


@pytest.mark.parametrize("norm", ["batch", "response", "group", "none"])
@pytest.mark.parametrize("gamma", [0.5, 1.0, 2.0])
def test_focal_weight_scales_each_groups_advantages_by_one_minus_its_success_rate(norm, gamma):
    """F-GRPO's focal weight (arXiv 2602.06717): A_ij -> (1 - mu_i)^gamma A_ij after the
    advantages are computed, mu_i the group's share of right rollouts; groups of equal and of
    unequal N alike. By hand: groups of 1/4 and 3/4 right at gamma 1 are weighted 0.75 and
    0.25."""
    g = torch.Generator().manual_seed(3)
    rewards = (torch.rand(5, 8, generator=g) < torch.rand(5, 1, generator=g)).float()  # (G, N)
    rewards[:, 0], rewards[:, 1] = 1.0, 0.0  # every group informative
    lengths = torch.randint(1, 7, (5, 8), generator=g).float()  # (G, N)
    for cut in ([8] * 5, [4, 8, 6, 3, 8]):  # equal N, then groups of unequal N
        groups = [rewards[j, :n] for j, n in enumerate(cut)]
        lens = [lengths[j, :n] for j, n in enumerate(cut)]
        base = _advantages(groups, lens, norm)
        focal = _advantages(groups, lens, norm, gamma)
        for r, b, f in zip(groups, base, focal):
            expect = torch.tensor(_focal_by_hand([r.tolist()], [b.tolist()], gamma)[0])
            assert torch.allclose(f, expect, atol=1e-6)
    w = objectives.focal_weight(torch.tensor([0.25, 0.75]), 1.0)  # (2,)
    assert w.tolist() == [0.75, 0.25]


def test_focal_weight_off_is_todays_advantages_to_the_bit():
    g = torch.Generator().manual_seed(4)
    groups = [(torch.rand(16, generator=g) < 0.3).float() for _ in range(6)]
    lens = [torch.randint(1, 7, (16,), generator=g).float() for _ in range(6)]
    assert all(torch.equal(a, b) for a, b in zip(_advantages(groups, lens, "batch", 0.0),
                                                 _advantages(groups, lens, "batch")))


@pytest.mark.slow
def test_focal_gamma_reaches_the_update_and_is_checked(tmp_path):
    """--focal_gamma changes a run's update (the flag is wired to the advantages); off, the run is
    the run without it; a negative or non-finite gamma is refused in one line."""
    base = ["--steps", "1", "--eval_every", "1", "--n_rollouts", "8", "--prompts_per_step", "2",
            "--eval_prompts", "2", "--eval_samples", "2", "--probe_prompts", "1",
            "--probe_samples", "4", "--save", "0"]
    rows = {}
    for gamma in ("0", "2"):
        rows[gamma] = brorl.train(brorl.parse_config(
            [*base, "--focal_gamma", gamma, "--out", str(tmp_path / gamma)]))
    plain = brorl.train(brorl.parse_config([*base, "--out", str(tmp_path / "plain")]))
    clock = lambda r: {k: v for k, v in r.items() if not k.startswith("time_")
                       and k != "tokens_per_s"}
    assert [clock(r) for r in rows["0"]] == [clock(r) for r in plain]
    assert rows["2"][1]["grad_norm"] != rows["0"][1]["grad_norm"]
    for bad in ("-1", "nan", "inf"):
        with pytest.raises(SystemExit):
            brorl.parse_config(["--focal_gamma", bad])


# ----------------------------------------------------------------------------
# --loss is one table (objectives.OBJECTIVES): the help, the check, --loss_agg auto, the note and
# the update read it, so a loss is one entry, and its name is spelled nowhere else in the code.

def _shipped_code():
    """Every Python file git tracks or would (not ignored), but the tests: what a clone holds, not
    what a run or an install left beside it."""
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "*.py"], cwd=root, capture_output=True, text=True, check=True)
    files = [root / f for f in listed.stdout.split()]
    return root, [p for p in sorted(files) if p.is_file() and p.parts[len(root.parts)] != "tests"
                  and p.name != "test_brorl.py"]


def _loss_names_spelled(path: Path, names) -> list:
    """(line, text) of each string constant and comment of path that names one of `names` as a
    word, lower case (the value --loss takes). Docstrings are prose, as the docs are, and not read;
    a field such as sapo_tau_pos is one word, so it never matches (\\b does not split at _)."""
    src = path.read_text()
    word = re.compile(r"\b(%s)\b" % "|".join(map(re.escape, names)))
    tree = ast.parse(src)
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant)}
    found = [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant)
             and isinstance(n.value, str) and id(n) not in docstrings and word.search(n.value)]
    found += [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(src).readline)
              if t.type == tokenize.COMMENT and word.search(t.string)]
    return sorted(found)


def test_every_loss_name_is_spelled_in_the_table_alone():
    """Each --loss name is a string in the code once, its key in objectives.OBJECTIVES, and the
    default's once more, Config's default; no string or comment of the code outside the tests
    names a loss (a choice list, a branch, a help), so that a forker adds one entry. Docstrings and
    the docs are prose; the flags a loss owns (gspo_clip_low, sapo_tau_pos) are fields, one word
    each, named where they are read."""
    root, files = _shipped_code()
    names = list(objectives.OBJECTIVES)
    default = brorl.Config.loss
    allowed = {("lib/objectives.py", name) for name in names} | {("brorl.py", default)}
    spelled = [(str(p.relative_to(root)), line, text) for p in files
               for line, text in _loss_names_spelled(p, names)]
    outside = [s for s in spelled if (s[0], s[2]) not in allowed]
    assert outside == [], outside
    table = [text for f, _, text in spelled if f == "lib/objectives.py"]
    assert sorted(table) == sorted(names), table  # each key once
    assert names[0] == default and [t for f, _, t in spelled if f == "brorl.py"] == [default]


def test_the_grep_sees_a_loss_named_outside_the_table(tmp_path):
    """The grep of the test above finds a branch and a choice list, and skips docstrings and
    fields."""
    planted = tmp_path / "planted.py"
    planted.write_text('"""--loss gspo in a docstring is prose."""\n'
                       'def f(cfg):\n    """sapo too."""\n'
                       '    x = cfg.sapo_tau_pos  # a field, one word\n'
                       '    if cfg.loss == "gspo":  # a branch on cispo\n        return 1\n'
                       '    return f"choose ppo or {x}"\n')
    found = _loss_names_spelled(planted, list(objectives.OBJECTIVES))
    assert [line for line, _ in found] == [5, 5, 7], found


def test_the_help_the_check_and_loss_agg_read_the_table():
    """--loss's help lists the table's names in its order, the check refuses a name it lacks in one
    line listing them, --loss_agg auto is each entry's, and every loss's own flags are
    COUNTS_ONLY_WITH that loss."""
    from lib import checks, config
    names = list(objectives.OBJECTIVES)
    helps = config.table_help(brorl.Config, {})
    assert helps["loss"].endswith("; one of " + ", ".join(names)), helps["loss"]
    assert checks.check_config(brorl.Config(loss="nope")) == (
        f"--loss 'nope': choose {', '.join(names[:-1])} or {names[-1]}")
    for name, o in objectives.OBJECTIVES.items():
        assert objectives.aggregation(name, "auto") == o.aggregation in ("token", "sequence")
        assert objectives.aggregation(name, "constant") == "constant"
        for flag in o.flags:
            assert checks.COUNTS_ONLY_WITH[flag][0] == "loss" and name in checks.COUNTS_ONLY_WITH[flag][1]


def _reinforce(logp, old_logp, adv, mask, cfg):
    """A made-up loss: plain REINFORCE, -A logp per token; no clip binds."""
    return -adv[:, None] * logp, torch.exp(logp - old_logp), torch.zeros_like(mask)


def _register(monkeypatch):
    """--loss reinforce, registered in this test alone: one entry of the table, nothing else."""
    monkeypatch.setitem(objectives.OBJECTIVES, "reinforce",
                        objectives.Objective(_reinforce, "token"))


def test_a_made_up_loss_is_refused_until_its_entry_is_added(monkeypatch, capsys):
    """--loss reinforce is one line (exit status 2) before its entry is in the table; after, it
    parses, --help lists it, --loss_agg auto is its entry's and the update's dispatch runs it."""
    with pytest.raises(SystemExit) as stop:
        brorl.parse_config(["--loss", "reinforce"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--loss 'reinforce': choose ppo, gspo, cispo or sapo" in err, err
    _register(monkeypatch)
    cfg = brorl.parse_config(["--loss", "reinforce"])
    assert (cfg.loss, cfg.loss_agg) == ("reinforce", "token")
    with pytest.raises(SystemExit):
        brorl.parse_config(["--help"])
    assert "sapo, reinforce" in " ".join(capsys.readouterr().out.split())
    logp, old, adv, mask = _batch()
    loss, ratio, clipped = brorl.policy_token_loss(logp, old, adv, mask, cfg)
    assert torch.equal(loss, -adv[:, None] * logp) and not clipped.any()


@pytest.mark.slow
def test_a_made_up_loss_trains_from_its_entry_alone(monkeypatch, tmp_path):
    """Two steps of the tiny embedded model under --loss reinforce, added by one entry: the
    update ran it (a step's gradient, finite and nonzero) and config.json records it."""
    from test_brorl import SMALL
    _register(monkeypatch)
    calls = []
    monkeypatch.setitem(objectives.OBJECTIVES, "reinforce", objectives.Objective(
        lambda *a: calls.append(1) or _reinforce(*a), "token"))
    rows = brorl.train(brorl.parse_config(["--loss", "reinforce", "--steps", "2", "--eval_every", "2",
                                           "--save", "false", "--out", str(tmp_path), *SMALL]))
    steps = [r for r in rows if "grad_norm" in r]
    assert [r["step"] for r in steps] == [1, 2] and calls, rows
    assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in steps)
    assert json.loads((tmp_path / "config.json").read_text())["loss"] == "reinforce"
