"""
steplog.py: what a step reports: its row of metrics.jsonl (step_metrics: the rollouts' statistics
and the update's), the one line printed per step, and metrics.png, the plots refreshed at every
evaluation from the rows of metrics.jsonl.
"""

from pathlib import Path

import torch

from lib.rundir import replace_atomic
from lib.step import StepStats


def step_metrics(stats: StepStats, t_roll, t_upd, upd) -> dict:
    """The per-step dict: rollout statistics over ALL generated groups, before filtering. Groups of
    unequal n (--alloc adaptive): reward and pass@1 over all rollouts, zero_adv_frac and pass@N
    over groups, as with one N; and the allocation's."""
    rewards = torch.cat(stats.rewards)  # (rollouts generated,) every rollout's, group-major
    top = torch.stack([g.max() for g in stats.rewards])  # (groups,)
    bottom = torch.stack([g.min() for g in stats.rewards])  # (groups,)
    # --alloc adaptive's statistics; with keys and sets, the prompts a rollout got right.
    extra = {**(vars(stats.alloc) if stats.alloc else {}), "sampled_right": stats.sampled_right}
    return {
        "reward_mean": rewards.mean().item(),
        # The share of generated groups that survived, before the truncation to B.
        "keep_rate": stats.groups_survived / max(stats.groups_generated, 1),
        "groups_kept": stats.groups_kept, "sample_rounds": stats.rounds,
        "samples": rewards.numel(),  # rollouts generated this step, dropped groups included
        "zero_adv_frac": (top == bottom).float().mean().item(),
        "pass@1": rewards.mean().item(), "pass@N": (top > 0).float().mean().item(),
        "resp_len": stats.tokens / rewards.numel(),
        "tokens_per_s": stats.tokens / max(t_roll, 1e-9),
        "time_rollout": t_roll, "time_update": t_upd,
        **{k: v for k, v in extra.items() if v is not None}, **upd,
    }


def log_line(m: dict) -> str:
    """The one line printed per step (README.md#what-you-will-see shows one; tests/test_docs.py
    checks it)."""
    line = (f"step {m['step']:4d} | reward {m['reward_mean']:.3f} | keep {m['keep_rate']:.2f} | "
            f"ent {m.get('entropy', 0):.3f} | clip {m.get('clip_frac', 0):.3f} | "
            f"|r-1| {m.get('max_ratio_dev', 0):.1e} drift {m.get('drift_max', 0):.1e} | "
            f"len {m['resp_len']:.1f} | {m['tokens_per_s']:.0f} tok/s | "
            f"roll {m['time_rollout']:.2f}s upd {m['time_update']:.2f}s")
    # --alloc adaptive: rollouts per prompt, informative groups per 1,000 rollouts
    if "alloc_n_min" in m:
        line += (f" | n {m['alloc_n_min']}/{m['alloc_n_median']:g}/{m['alloc_n_max']}"
                 f" inf/1k {m['informative_per_1k']:.1f} dropped {m['rollouts_dropped']}")
    if "eval_pass@1" in m:
        line += (f" | eval pass@1 {m['eval_pass@1']:.3f} pass@k {m['eval_pass@k']:.3f}"
                 f" probe Q {m['mass_mean']:.3f}")  # sampled: the probe's share of right rollouts
        if "mass_exact_mean" in m:  # computed: the right answer's probability (lib/mass.py)
            line += f" exact Q {m['mass_exact_mean']:.3f}"
    return line


PLOTS = [("reward_mean", "train reward"), ("eval_pass@1", "held-out pass@1 (T=0.6)"),
         ("eval_pass@k", "held-out pass@k (k = eval samples)"),
         ("keep_rate", "dynamic-sampling keep rate"), ("entropy", "token entropy"),
         ("resp_len", "response length"), ("mass_mean", "probe Q (sampled correct mass)"),
         ("kl", "k2 KL to reference (0 if off)"),
         ("mass_exact_zones", "exact Q: prompts per zone (lib/mass.py)")]
ZONES = [("mass_exact_high", "Q >= 1/small N"), ("mass_exact_gate", "gate"),
         ("mass_exact_low", "Q < 1/large N")]


def plot_metrics(rows, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 3, figsize=(13, 9))
    for ax, (key, title) in zip(axes.flat, PLOTS):
        # the zones: three lines
        for k, label in ZONES if key == "mass_exact_zones" else [(key, None)]:
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3, label=label)
        if key == "mass_exact_zones" and ax.lines:
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    try:  # whole or not at all, as every file of the run directory
        replace_atomic(path, lambda tmp: fig.savefig(tmp, dpi=90, format="png"))
    finally:
        plt.close(fig)
