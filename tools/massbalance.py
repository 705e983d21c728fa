"""The mass balance equation of BroRL (arXiv 2510.01180, section 2; docs/paper.md §3), checked and simulated.

The theory needs no language model, so this file stands apart from brorl.py. Read it top to bottom:

1. Theory. One RL step is gradient ascent on the logits z of a softmax p over a vocabulary
   split into correct tokens (the set P) and incorrect ones (the rest; the paper calls them N too,
   here N is only the number of draws). With N draws, sampled correct tokens (A) get reward
   R_c >= 0, sampled incorrect ones (B) get R_w <= 0, unsampled ones (U) get 0, and
   the surrogate -(1/N) sum_i R_i p_i moves each logit by dz_j = (eta/N) p_j (R_j - S_R).
   `mass_balance_terms` gives Theorem 1, the first-order change of the correct mass Q_pos:
     dQ_pos = (eta/N) [ (R_c - S_R) Q_neg A2            sampled correct,   never < 0
                      + (S_R - R_w) Q_pos B2            sampled incorrect, never < 0
                      + S_R (Q_pos U_neg2 - Q_neg U_pos2) ]  unsampled coupling, either sign
   `expected_unsampled_mass` gives Lemma 2: E[U2] = sum_i p_i^2 (1 - p_i)^N, which shrinks as
   N grows, so large N makes the expansion of the correct mass reliable.
2. Simulation (the paper's Figure 3). Many independent logit vectors, one per (N, seed), shape
   (S, V); each step draws N tokens from softmax(z), centres the +-1 rewards by their batch mean,
   and takes one AdamW step on -(1/N) sum_j rtilde_j p_{k_j} (gradient in closed form).
3. Plots: the curves per step for the paper's N values, and a sweep of N (log-spaced).
4. CLI: `python -m tools.massbalance` (about 3 minutes on 2 CPU cores) writes
   assets/massbalance/{simulation.png, sweep.png, results.json} and prints the final-step table.
   `python -m tools.massbalance --help` lists the flags; `--no-sweep --steps 200` is a quick look.

What we found: the ordering by N (more draws, more correct mass, every correct token up at
N = 51200) holds in every setting we tried, but the *fall* at small N comes from AdamW's eps.
An unsampled token's gradient is tiny (prop. to p_k, below eps = 1e-8 at V = 128k), so AdamW
moves it by about lr * grad / eps, prop. to p_k: unsampled correct tokens (p 20x larger) sink
~17x faster than unsampled incorrect ones (measured, N = 4). With eps = 1e-12 every N gains
mass. For a plain gradient step (Theorem 1, bottom of sweep.png) the coupling takes back ~half.

Where the paper is silent (ours): AdamW as torch.optim.AdamW's defaults (betas 0.9/0.999,
eps 1e-8, weight decay 0.01); the anchor token (logit 5) is incorrect; the correct tokens are the
first n_correct indices (the setup is exchangeable, so which ones does not matter).
"""
import argparse
import json
import os
import time
from typing import NamedTuple

import matplotlib
import numpy as np
import torch

matplotlib.use("Agg")  # plots are written as PNG files, never shown
import matplotlib.pyplot as plt  # noqa: E402 (after choosing the backend)

METRICS = ("q_pos", "improved_pct", "worst_drop")  # what the simulation logs per step and row

# ----------------------------------------------------------------------------------------------
# 1. Theory: Theorem 1 (mass balance) and Lemma 2 (unsampled mass)


class MassBalance(NamedTuple):
    """Theorem 1's terms of dQ_pos (each already multiplied by eta/N), and their sum."""
    sampled_correct: float  # (eta/N) (R_c - S_R) Q_neg A2, never negative
    sampled_incorrect: float  # (eta/N) (S_R - R_w) Q_pos B2, never negative
    unsampled_coupling: float  # (eta/N) S_R (Q_pos U_neg2 - Q_neg U_pos2), either sign
    total: float  # first-order dQ_pos


def _check_inputs(probs, correct, sampled, r_correct, r_wrong, n):
    """Validate and convert to float64 / bool tensors of shape (V,)."""
    probs = torch.as_tensor(probs, dtype=torch.float64)
    correct, sampled = torch.as_tensor(correct), torch.as_tensor(sampled)
    if probs.ndim != 1 or correct.shape != probs.shape or sampled.shape != probs.shape:
        raise ValueError(f"probs, correct, sampled must share one shape (V,), got "
                         f"{tuple(probs.shape)}, {tuple(correct.shape)}, {tuple(sampled.shape)}")
    if correct.dtype != torch.bool or sampled.dtype != torch.bool:
        raise ValueError("correct and sampled must be boolean masks")
    if (probs < 0).any() or abs(probs.sum().item() - 1.0) > 1e-6:
        raise ValueError("probs must be a probability distribution (non-negative, sums to 1)")
    if r_correct < 0 or r_wrong > 0:
        raise ValueError(f"Theorem 1 assumes R_c >= 0 >= R_w, got {r_correct}, {r_wrong}")
    if n < 1:
        raise ValueError(f"n (rollouts) must be >= 1, got {n}")
    return probs, correct, sampled


def surrogate_logit_step(logits, correct, sampled, r_correct=1.0, r_wrong=-1.0, lr=1.0, n=1):
    """The exact update that Theorem 1 linearises: z_j += (lr/n) p_j (R_j - S_R).

    It is one gradient-ascent step on (1/n) sum_i R_i p_i, since d p_i / d z_j = p_i (1[i=j] - p_j).
    Sampled correct tokens get R_c, sampled incorrect R_w, unsampled 0; S_R = sum_i R_i p_i.
    """
    logits = torch.as_tensor(logits, dtype=torch.float64)
    probs, correct, sampled = _check_inputs(logits.softmax(-1), correct, sampled,
                                            r_correct, r_wrong, n)
    reward = torch.where(correct, r_correct, r_wrong) * sampled  # (V,) R_j, 0 if unsampled
    batch_mood = (reward * probs).sum()  # S_R = R_c P_pos + R_w P_neg
    return logits + lr / n * probs * (reward - batch_mood)  # (V,)


def mass_balance_terms(probs, correct, sampled, r_correct=1.0, r_wrong=-1.0, lr=1.0, n=1):
    """Theorem 1: the first-order change of Q_pos after `surrogate_logit_step`.

    probs (V,) the softmax; correct, sampled boolean (V,), each distinct sampled token once.
    Derivation, with c = lr/n and dz_j = c p_j (R_j - S_R), and dp_k = p_k (dz_k - sum_j p_j dz_j):
      sum_j p_j dz_j       = c [(R_c - S_R) A2 + (R_w - S_R) B2 - S_R (U_pos2 + U_neg2)]
      sum_{k in P} p_k dz_k = c [(R_c - S_R) A2 - S_R U_pos2]
      dQ_pos = sum_{k in P} p_k dz_k - Q_pos sum_j p_j dz_j, which regroups into the three
    terms below: exactly the paper's statement (no discrepancy found).
    """
    p, correct, sampled = _check_inputs(probs, correct, sampled, r_correct, r_wrong, n)
    q_pos = p[correct].sum()  # Q_pos: all correct mass
    q_neg = 1.0 - q_pos  # Q_neg: all incorrect mass
    p_pos, p_neg = p[sampled & correct].sum(), p[sampled & ~correct].sum()  # P_pos, P_neg
    batch_mood = r_correct * p_pos + r_wrong * p_neg  # S_R
    sq = p ** 2  # (V,) squared probabilities: the "concentration" sums below
    a2, b2 = sq[sampled & correct].sum(), sq[sampled & ~correct].sum()  # A2, B2
    u_pos2, u_neg2 = sq[~sampled & correct].sum(), sq[~sampled & ~correct].sum()  # U_pos2, U_neg2
    scale = lr / n  # eta / N
    terms = (scale * (r_correct - batch_mood) * q_neg * a2,
             scale * (batch_mood - r_wrong) * q_pos * b2,
             scale * batch_mood * (q_pos * u_neg2 - q_neg * u_pos2))
    return MassBalance(*(t.item() for t in terms), total=sum(terms).item())


def expected_unsampled_mass(probs, n, mask=None):
    """Lemma 2: E[sum of p_i^2 over tokens missed by n i.i.d. draws] = sum_i p_i^2 (1 - p_i)^n.

    mask (V,) bool restricts the sum (mask=correct gives E[U_pos2], ~correct gives E[U_neg2]).
    """
    p = torch.as_tensor(probs, dtype=torch.float64)
    if p.ndim != 1 or n < 0:
        raise ValueError(f"need probs of shape (V,) and n >= 0, got {tuple(p.shape)}, n={n}")
    terms = p ** 2 * (1.0 - p) ** n  # (V,) p_i^2 times P(token i never drawn)
    return (terms if mask is None else terms[torch.as_tensor(mask)]).sum().item()


def expected_terms(probs, correct, n, draws=50, seed=0):
    """Monte Carlo mean of Theorem 1's terms (times n/lr) over `draws` batches of n draws.

    Rewards +-1 centred by the batch mean, as in the simulation, so R_c = 1 - mean >= 0 >= R_w.
    """
    probs = torch.as_tensor(probs, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    total = torch.zeros(4, dtype=torch.float64)
    for _ in range(draws):
        picks = torch.multinomial(probs, n, replacement=True, generator=gen)  # (n,)
        mean_r = 2.0 * correct[picks].double().mean().item() - 1.0  # batch-mean reward
        sampled = torch.zeros_like(correct).index_fill_(0, picks, True)  # (V,) distinct tokens
        total += torch.tensor(mass_balance_terms(probs, correct, sampled, 1.0 - mean_r,
                                                 -1.0 - mean_r, lr=1.0, n=n)) * n
    return MassBalance(*(total / draws).tolist())


# ----------------------------------------------------------------------------------------------
# 2. Simulation: the paper's Figure 3, batched over (N, seed)


def init_logits(vocab, n_correct, anchor="wrong"):
    """Paper's start: logits 0, correct tokens (the first n_correct) at 3, one anchor token at 5.

    anchor: "wrong" (ours: token n_correct), "correct" (token 0) or "none". Q_pos at the start
    is 0.6296 / 0.6301 / 0.6299 with the paper's sizes: all "near 0.63", so it cannot tell.
    """
    if not 0 < n_correct < vocab or anchor not in ("wrong", "correct", "none"):
        raise ValueError(f"need 0 < n_correct < vocab and a known anchor, got "
                         f"{n_correct}, {vocab}, {anchor!r}")
    z = torch.zeros(vocab)  # (V,)
    z[:n_correct] = 3.0
    if anchor != "none":
        z[n_correct if anchor == "wrong" else 0] = 5.0
    return z


def surrogate_grad(p, counts, reward, n):
    """Closed-form gradient of -(1/n) sum_j rtilde_j p_{k_j} w.r.t. the logits.

    p, counts (S, V): probabilities and how often each token was drawn; reward (V,) per token.
    rtilde_j = R_{k_j} - mean reward of the batch; with w_i = p_i counts_i rtilde(i), the
    gradient is -(w_i - p_i sum_k w_k) / n.
    """
    mean_r = (counts * reward).sum(1, keepdim=True) / n  # (S, 1) batch-mean reward
    w = p * counts * (reward - mean_r)  # (S, V)
    return (p * w.sum(1, keepdim=True) - w) / n  # (S, V)


def adamw_(z, grad, m, v, t, lr, betas, eps, weight_decay):
    """One in-place AdamW step, the same arithmetic as torch.optim.AdamW (t counts from 1).

    Written out so each N group updates its own rows (S_n, V) and the step stays readable.
    """
    b1, b2 = betas
    z.mul_(1.0 - lr * weight_decay)  # decoupled weight decay
    m.mul_(b1).add_(grad, alpha=1.0 - b1)
    v.mul_(b2).addcmul_(grad, grad, value=1.0 - b2)
    denom = (v.sqrt() / (1.0 - b2 ** t) ** 0.5).add_(eps)
    z.addcdiv_(m, denom, value=-lr / (1.0 - b1 ** t))


def simulate(ns, seeds=3, vocab=128_000, n_correct=10_000, steps=1000, lr=1e-3,
             betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, anchor="wrong", seed=0,
             log_every=100):
    """Run every (N, seed) pair for `steps` AdamW steps; return per-step metrics as numpy.

    Rows are grouped by N (torch.multinomial draws one sample count per call). Returns a dict:
    "n" (S,) the N of each row, and (steps+1, S) arrays "q_pos" (correct mass),
    "improved_pct" (% of correct tokens whose probability is above its step-0 value) and
    "worst_drop" (largest step-0-minus-now probability among correct tokens, 0 if none fell).
    """
    if not ns or min(ns) < 1 or seeds < 1 or steps < 1:
        raise ValueError(f"need N values >= 1, seeds >= 1, steps >= 1; got {ns}, {seeds}, {steps}")
    gen = torch.Generator().manual_seed(seed)
    z0 = init_logits(vocab, n_correct, anchor)  # (V,)
    p0 = z0.softmax(-1)[:n_correct]  # (C,) step-0 probabilities of the correct tokens
    reward = torch.full((vocab,), -1.0)  # (V,) paper: +1 correct, -1 incorrect
    reward[:n_correct] = 1.0
    row_n = [n for n in ns for _ in range(seeds)]  # (S,) rows grouped by N
    z = z0.repeat(len(row_n), 1)  # (S, V) one independent logit vector per row
    m, v = torch.zeros_like(z), torch.zeros_like(z)  # (S, V) AdamW moments
    logs = {k: torch.zeros(steps + 1, len(row_n), dtype=torch.float64) for k in METRICS}
    start = time.time()
    for t in range(steps + 1):
        for g, n in enumerate(ns):
            rows = slice(g * seeds, (g + 1) * seeds)  # this N's rows: contiguous views
            p = z[rows].softmax(-1)  # (seeds, V)
            pc = p[:, :n_correct]  # (seeds, C) correct tokens
            logs["q_pos"][t, rows] = pc.sum(1, dtype=torch.float64)
            logs["improved_pct"][t, rows] = 100.0 * (pc > p0).double().mean(1)
            logs["worst_drop"][t, rows] = (p0 - pc).amax(1).clamp(min=0).double()
            if t == steps:
                continue  # the last pass only logs the final state
            draws = torch.multinomial(p, n, replacement=True, generator=gen)  # (seeds, n)
            ones = torch.ones_like(p[:, :1]).expand(-1, n)  # (seeds, n) one count per draw
            counts = torch.zeros_like(p).scatter_add_(1, draws, ones)  # (seeds, V)
            grad = surrogate_grad(p, counts, reward, n)  # (seeds, V)
            # AdamW rescales each logit's step by its own gradient history: the tiny coupling
            # gradients of unsampled tokens fall under eps (see 'What we found' above)
            adamw_(z[rows], grad, m[rows], v[rows], t + 1, lr, betas, eps, weight_decay)
        if log_every and t % log_every == 0:
            q = logs["q_pos"][t]
            print(f"step {t:5d} | Q_pos {q.min():.4f}..{q.max():.4f} | {time.time() - start:.0f}s",
                  flush=True)
    return {"n": np.array(row_n), **{k: x.numpy() for k, x in logs.items()}}


def summarize(res):
    """Final-step mean, std, min and max over seeds of each metric, one dict per N (sorted)."""
    rows = []
    for n in sorted(set(res["n"].tolist())):
        row = {"n": int(n)}
        for key in METRICS:
            x = res[key][-1, res["n"] == n]  # (seeds,) this N's final values
            row.update({f"{key}_{f}": float(getattr(np, f)(x))
                        for f in ("mean", "std", "min", "max")})
        rows.append(row)
    return rows


# ----------------------------------------------------------------------------------------------
# 3. Plots


def plot_curves(res, ns, path, title):
    """Paper Figure 3: Q_pos, % correct tokens improved and worst drop per step, for each N.

    Lines are the mean over seeds, bands the min..max over seeds.
    """
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    panels = [("q_pos", "Q_pos (total correct mass)"),
              ("improved_pct", "% correct tokens above their step-0 prob."),
              ("worst_drop", "worst prob. drop among correct tokens")]
    colors = plt.cm.viridis(np.linspace(0, 0.9, len(ns)))
    for ax, (key, label) in zip(axes, panels):
        for n, c in zip(ns, colors):
            y = res[key][:, res["n"] == n]  # (steps+1, seeds)
            x = np.arange(len(y))
            ax.plot(x, y.mean(1), color=c, label=f"N = {n}")
            ax.fill_between(x, y.min(1), y.max(1), color=c, alpha=0.25, lw=0)
        ax.set(xlabel="step", ylabel=label, title=label)
        ax.grid(alpha=0.3)
    axes[2].ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    axes[0].legend(title="rollouts per step")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def plot_sweep(q_pos0, summary, p0, correct, path, title):
    """Top: final Q_pos, % improved, worst drop against N (log x). Bottom: the theory at step 0."""
    ns = np.array([r["n"] for r in summary])  # (len(ns),)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    axes = axes.ravel()
    panels = [("q_pos", "final Q_pos"), ("improved_pct", "final % correct tokens improved"),
              ("worst_drop", "final worst prob. drop (correct tokens)")]
    for ax, (key, label) in zip(axes, panels):
        mean, lo, hi = (np.array([r[f"{key}_{f}"] for r in summary])
                        for f in ("mean", "min", "max"))  # (len(ns),) each
        ax.errorbar(ns, mean, yerr=[mean - lo, hi - mean], marker="o", capsize=3)
        ax.set(ylabel=label, title=f"simulation: {label}")
    axes[0].axhline(q_pos0, color="gray", ls="--", label="step 0")
    axes[0].legend()
    axes[2].ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    # Lemma 2 on the step-0 distribution: the share of squared mass that N draws leave unsampled
    grid = np.unique(np.geomspace(1, ns.max(), 60).astype(int))
    for mask, label in ((correct, "correct: E[U_pos2] / sum_P p^2"),
                        (~correct, "incorrect: E[U_neg2] / sum_N p^2")):
        total = expected_unsampled_mass(p0, 0, mask)  # N = 0: all squared mass
        axes[3].plot(grid, [expected_unsampled_mass(p0, n, mask) / total for n in grid],
                     label=label)
    axes[3].set(ylabel="share left unsampled", title="Lemma 2 at step 0: unsampled squared mass")
    axes[3].legend()
    # Theorem 1 at step 0 for one plain gradient step: how much of the sampled gain the coupling
    # term takes back (-1 would cancel it; > 0 adds to it)
    terms = [expected_terms(p0, correct, int(n)) for n in ns]
    ratio = [t.unsampled_coupling / (t.sampled_correct + t.sampled_incorrect) for t in terms]
    axes[4].plot(ns, ratio, marker="o")
    axes[4].axhline(0, color="gray", ls="--")
    axes[4].set(ylabel="E[unsampled coupling] / E[sampled terms]",
                title="Theorem 1 at step 0 (centred rewards, 50 batches)")
    for ax in axes[:5]:
        ax.set(xscale="log", xlabel="N (draws per step)")
        ax.grid(alpha=0.3, which="both")
    axes[5].axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# 4. CLI


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.massbalance", description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--vocab", type=int, default=128_000, help="vocabulary size V (paper)")
    ap.add_argument("--n-correct", type=int, default=10_000, help="correct tokens (paper)")
    ap.add_argument("--anchor", default="wrong", choices=["wrong", "correct", "none"],
                    help="is the logit-5 anchor token correct? (paper silent)")
    ap.add_argument("--steps", type=int, default=1000, help="AdamW steps (paper)")
    ap.add_argument("--ns", type=int, nargs="+", default=[4, 8, 16, 512, 51200],
                    help="N values of the curves figure (paper)")
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="also run --sweep-ns and plot final values against N")
    ap.add_argument("--sweep-ns", type=int, nargs="+",
                    default=[4 * 2 ** k for k in range(14)] + [51200],
                    help="N values of the sweep (log-spaced; contains the paper's)")
    ap.add_argument("--seeds", type=int, default=3, help="independent runs per N")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the sampler")
    ap.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (paper)")
    ap.add_argument("--betas", type=float, nargs=2, default=[0.9, 0.999],
                    help="AdamW betas (paper silent; torch default)")
    ap.add_argument("--eps", type=float, default=1e-8, help="AdamW eps (torch default)")
    ap.add_argument("--weight-decay", type=float, default=0.01,
                    help="AdamW weight decay (paper silent; torch default)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads; 1 is fastest on a shared 2-core machine")
    ap.add_argument("--out", default="assets/massbalance", help="folder for PNGs and JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)

    ns = sorted(set(args.ns) | (set(args.sweep_ns) if args.sweep else set()))
    print(f"simulating N = {ns}, {args.seeds} seeds, {args.steps} steps, V = {args.vocab}")
    start = time.time()
    res = simulate(ns, args.seeds, args.vocab, args.n_correct, args.steps, args.lr,
                   tuple(args.betas), args.eps, args.weight_decay, args.anchor, args.seed)
    wall = time.time() - start
    summary = summarize(res)

    print(f"\nfinal step {args.steps} ({wall:.0f}s wall, {args.seeds} seeds; "
          f"Q_pos at step 0 = {res['q_pos'][0, 0]:.4f})")
    print(f"{'N':>6} | {'Q_pos mean +- sd':>19} | {'% improved':>10} | {'worst drop':>10}")
    for r in summary:
        print(f"{r['n']:6d} | {r['q_pos_mean']:.5f} +- {r['q_pos_std']:.5f} | "
              f"{r['improved_pct_mean']:10.2f} | {r['worst_drop_max']:10.2e}")

    setup = (f"V = {args.vocab:,}, {args.n_correct:,} correct, AdamW lr {args.lr:g} "
             f"wd {args.weight_decay:g}, {args.seeds} seeds (band/bars = min..max)")
    plot_curves(res, sorted(args.ns), os.path.join(args.out, "simulation.png"),
                f"Mass balance simulation (paper Fig. 3): {setup}")
    if args.sweep:
        z0 = init_logits(args.vocab, args.n_correct, args.anchor)
        correct = torch.arange(args.vocab) < args.n_correct  # (V,)
        plot_sweep(res["q_pos"][0, 0], summary, z0.double().softmax(-1), correct,
                   os.path.join(args.out, "sweep.png"),
                   f"Sweep of N after {args.steps} steps: {setup}")
    # curves every 10 steps keep the JSON small; the final step is always included
    every = max(1, args.steps // 100)
    idx = sorted(set(range(0, args.steps + 1, every)) | {args.steps})
    curves = {str(n): {k: res[k][idx][:, res["n"] == n].mean(1).round(7).tolist()
                       for k in METRICS} for n in sorted(args.ns)}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"config": vars(args), "wall_s": round(wall, 1),
                   "q_pos_step0": float(res["q_pos"][0, 0]), "final": summary,
                   "curve_steps": idx, "curves_seed_mean": curves}, f, indent=1)
    print(f"wrote simulation.png{', sweep.png' if args.sweep else ''}, results.json to {args.out}")


if __name__ == "__main__":
    main()
