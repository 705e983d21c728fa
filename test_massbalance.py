"""Tests of massbalance.py: Theorem 1 and Lemma 2 against exact references, the simulation's
pieces against torch, and the paper's ordering of Q_pos by N on a small simulation. CPU, seconds.
"""
import json

import pytest
import torch

import massbalance as mb


@pytest.fixture
def one_thread():
    """The simulation runs fastest on one thread on a shared 2-core CPU; restore afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


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


def test_surrogate_grad_matches_autograd():
    gen = torch.Generator().manual_seed(0)
    s, v, n = 3, 37, 9
    z = torch.randn(s, v, generator=gen, dtype=torch.float64, requires_grad=True)  # (S, V)
    reward = torch.where(torch.rand(v, generator=gen) < 0.3, 1.0, -1.0).double()  # (V,)
    draws = torch.multinomial(z.detach().softmax(-1), n, replacement=True, generator=gen)  # (S, n)
    r = reward[draws]  # (S, n) reward of each draw
    rtilde = r - r.mean(1, keepdim=True)  # batch-mean centred
    loss = -(rtilde * z.softmax(-1).gather(1, draws)).sum() / n  # summed over independent rows
    loss.backward()
    counts = torch.zeros(s, v, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(s, n, dtype=torch.float64))  # (S, V) draws per token
    grad = mb.surrogate_grad(z.detach().softmax(-1), counts, reward, n)
    torch.testing.assert_close(grad, z.grad)


def test_adamw_matches_torch():
    gen = torch.Generator().manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(3, 17, generator=gen))
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    z, m, v = ref.detach().clone(), torch.zeros(3, 17), torch.zeros(3, 17)
    for t in range(1, 6):
        grad = torch.randn(3, 17, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        mb.adamw_(z, grad, m, v, t, 1e-2, (0.8, 0.99), 1e-6, 0.1)
    torch.testing.assert_close(z, ref.detach())


def test_small_simulation_orders_q_pos_by_n(one_thread):
    # the paper's Figure 3 shape at a small size (checked offline: holds for seeds 0..9, with
    # margins ~5x the seed spread). Not smaller: at V = 2000, 300 steps of N = 4 already sample
    # every correct token several times and Q_pos(N=4) rises instead of falling.
    res = mb.simulate([4, 512, 51200], seeds=1, vocab=10_000, n_correct=800, steps=200,
                      seed=0, log_every=0)
    q0, (q4, q512, q51200) = res["q_pos"][0, 0], res["q_pos"][-1]
    assert q51200 > q512 > q4 and q4 < q0 < q51200
    assert res["improved_pct"][-1, 2] == 100.0 and res["worst_drop"][-1, 2] == 0.0
    assert res["improved_pct"][-1, 0] < 50.0


def test_cli_writes_figures_and_json(tmp_path, capsys, one_thread):
    mb.main(["--vocab", "300", "--n-correct", "30", "--steps", "5", "--ns", "4", "64",
             "--sweep-ns", "4", "16", "--seeds", "2", "--out", str(tmp_path)])
    assert (tmp_path / "simulation.png").exists() and (tmp_path / "sweep.png").exists()
    out = json.loads((tmp_path / "results.json").read_text())
    assert [r["n"] for r in out["final"]] == [4, 16, 64]
    assert "Q_pos mean" in capsys.readouterr().out


def test_bad_arguments_raise():
    p = torch.full((4,), 0.25, dtype=torch.float64)
    yes, no = torch.tensor([True, False, True, False]), torch.zeros(4, dtype=torch.bool)
    with pytest.raises(ValueError):
        mb.mass_balance_terms(p, yes[:3], no)  # shape mismatch
    with pytest.raises(ValueError):
        mb.mass_balance_terms(p, yes.long(), no)  # not a boolean mask
    with pytest.raises(ValueError):
        mb.mass_balance_terms(2 * p, yes, no)  # not a distribution
    with pytest.raises(ValueError):
        mb.mass_balance_terms(p, yes, no, r_correct=-1.0)  # theorem needs R_c >= 0 >= R_w
    with pytest.raises(ValueError):
        mb.mass_balance_terms(p, yes, no, n=0)
    with pytest.raises(ValueError):
        mb.expected_unsampled_mass(p, -1)
    with pytest.raises(ValueError):
        mb.init_logits(10, 10)  # no incorrect token left
    with pytest.raises(ValueError):
        mb.init_logits(10, 3, anchor="maybe")
    with pytest.raises(ValueError):
        mb.simulate([0], vocab=10, n_correct=3, steps=1)
    with pytest.raises(SystemExit):
        mb.main(["--anchor", "maybe"])


def test_expected_terms_coupling_vanishes_when_every_token_is_sampled():
    probs = (0.5 * torch.randn(20, generator=torch.Generator().manual_seed(0))).softmax(-1)
    correct = torch.arange(20) < 7
    terms = mb.expected_terms(probs, correct, n=5000, draws=5)  # P(a token missed) < 1e-20
    assert terms.unsampled_coupling == 0.0
    assert terms.sampled_correct > 0 and terms.sampled_incorrect > 0
