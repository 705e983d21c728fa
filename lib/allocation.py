"""
allocation.py: a step's rollout budget spent per prompt, by what each prompt can still learn
(--alloc adaptive). BroRL gives every prompt the same N; a prompt the policy already solves (Q near
1) or cannot reach (Q far below 1/N) returns an all-equal group that dynamic sampling drops. Here
each training prompt carries an estimate of Q, its chance that a rollout is right, and a step's R
rollouts go where a group is most likely to be informative (its rewards not all equal).

The estimate (Estimate): a Beta posterior per training prompt, counts a (right) and b (wrong) as
float64 tensors indexed by the prompt's position in the training set. Every generated group adds
its rewards (every rank sees all rewards, so the state is the same on every rank); every step the
counts are multiplied by --alloc_decay, since the policy moves and old rollouts speak of an older
policy. The prior is PRIOR_COUNT pseudo-rollouts at the recent mean reward of the step's batches,
so an unseen prompt is taken for a typical one. The point estimate is the posterior mean.

The value of n rollouts for a prompt of right-chance q is the chance its group is informative,
v(n, q) = 1 - q^n - (1 - q)^n. Its gain per extra rollout, v(n+1, q) - v(n, q) = q^n (1 - q) +
(1 - q)^n q, never grows with n (v is concave in n), so giving each rollout in turn to the prompt
whose next one gains most (allocate) maximises the sum of v over prompts exactly, for the integer
budget: the tests check it against brute force. Knapsack RL allocates by a value of the same kind;
Reinforce-Ada and sGPO size groups from the success rate too.

A step under --alloc adaptive (sample_allocated_groups) replaces brorl.sample_step_groups: the
rollout, reward and dynamic sampling phases, with one round of B candidates sized by allocate.
"""

import functools
from dataclasses import dataclass

import torch

from lib.step import SampleStep, StepStats, sample_groups
from sampler import round_seeds

# the prior: PRIOR_COUNT pseudo-rollouts (an unseen prompt's estimate moves with its first group) at
# a mean that follows each step's mean reward with this momentum (as brorl.train's keep_est)
PRIOR_COUNT = 2.0
PRIOR_MOMENTUM = 0.8


def informative_chance(n, q: torch.Tensor) -> torch.Tensor:
    """v(n, q) = 1 - q^n - (1 - q)^n: the chance that n rollouts of right-chance q are not all equal
    (neither all right nor all wrong), the chance dynamic sampling keeps the group."""
    q = torch.as_tensor(q, dtype=torch.float64)
    return 1 - q ** n - (1 - q) ** n


def allocate(q_hat: torch.Tensor, budget: int, n_min: int, n_max: int) -> torch.Tensor:
    """Rollouts per prompt (B,) int64 for estimates q_hat (B,): n_min <= n <= n_max, summing to
    budget exactly, maximising the sum of informative_chance. Each prompt starts at n_min (the
    exploration floor: no prompt is dropped, however solved or out of reach it looks); the other
    budget - B * n_min rollouts go to the largest marginal gains among all (prompt, n) pairs, which,
    as each prompt's gains never grow with n, is the greedy allocation and the optimum. Ties go to
    the earlier prompt (a stable sort): the result is a function of q_hat alone."""
    B = len(q_hat)
    if not B * n_min <= budget <= B * n_max:
        raise ValueError(f"budget {budget} outside [{B} x {n_min}, {B} x {n_max}]")
    q = q_hat.double()[:, None]  # (B, 1)
    n = torch.arange(n_min, n_max, dtype=torch.float64)[None]  # (1, n_max - n_min) the current size
    gain = informative_chance(n + 1, q) - informative_chance(n, q)  # (B, n_max - n_min)
    order = torch.sort(-gain.flatten(), stable=True).indices[: budget - B * n_min]  # the best pairs
    extra = torch.bincount(order // gain.shape[1], minlength=B)  # (B,) pairs taken per prompt
    return n_min + extra


class Estimate:
    """Each training prompt's Beta posterior over Q (counts a right, b wrong; float64 (P,)), with
    the prior's mean from recent batches. state_dict / load_state_dict: the checkpoint's
    (Run.checkpoint), so that --resume continues it bit-exactly."""

    def __init__(self, n_prompts: int, decay: float):
        self.decay = decay
        self.a = torch.zeros(n_prompts, dtype=torch.float64)  # (P,) right rollouts, decayed
        self.b = torch.zeros(n_prompts, dtype=torch.float64)  # (P,) wrong rollouts, decayed
        self.seen = torch.zeros(n_prompts, dtype=torch.bool)  # (P,) ever sampled
        self.prior = 0.5  # the prior's mean reward before the first batch: no knowledge
        self.updates = 0  # steps seen: the first sets the prior's mean outright

    def q_hat(self, idx) -> torch.Tensor:
        """The posterior mean (len(idx),) of the prompts at positions idx of the training set."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        return (self.a[idx] + PRIOR_COUNT * self.prior) / (self.a[idx] + self.b[idx] + PRIOR_COUNT)

    def update(self, idx: list, rewards: list):
        """One step: every count decayed once, then each generated group's rewards (n_i,) added to
        its prompt's (idx[i]); the prior's mean moves toward the step's mean reward. A reward in
        [0, 1] counts as that share of a right rollout (binary rewards: 0 or 1 rollout)."""
        self.a *= self.decay
        self.b *= self.decay
        for i, r in zip(idx, rewards):
            right = r.double().sum().item()
            self.a[i] += right
            self.b[i] += len(r) - right
            self.seen[i] = True
        step_mean = sum(r.double().sum().item() for r in rewards) / max(sum(map(len, rewards)), 1)
        mean = step_mean if self.updates == 0 else (PRIOR_MOMENTUM * self.prior
                                                    + (1 - PRIOR_MOMENTUM) * step_mean)
        self.prior = min(max(mean, 1e-3), 1 - 1e-3)  # off 0 and 1: unseen prompts' estimate never 0
        self.updates += 1

    def state_dict(self) -> dict:
        return dict(a=self.a.clone(), b=self.b.clone(), seen=self.seen.clone(), prior=self.prior,
                    updates=self.updates)

    def load_state_dict(self, state: dict):
        if len(state["a"]) != len(self.a):
            raise ValueError(f"the checkpoint's estimate covers {len(state['a'])} prompts, the "
                             f"training set {len(self.a)}")
        self.a, self.b = state["a"].clone(), state["b"].clone()
        self.seen, self.prior = state["seen"].clone(), float(state["prior"])
        self.updates = int(state["updates"])


def calibration(estimate: Estimate, positions: list, log10_q: list) -> dict:
    """The estimate against the exact Q (lib/mass.py's mass_exact_log10) of the eval prompts at
    training-set positions `positions` (None: not a training prompt), over those the estimate has
    seen: their count, the mean |log10 q_hat - log10 Q|, and the correlation of log10 q_hat with
    log10 Q over prompts (nan with fewer than 2)."""
    pairs = [(p, x) for p, x in zip(positions, log10_q) if p is not None and estimate.seen[p]]
    if not pairs:
        return {"alloc_calib_prompts": 0}
    est = estimate.q_hat([p for p, _ in pairs]).log10()  # (S,)
    exact = torch.tensor([x for _, x in pairs], dtype=torch.float64)  # (S,)
    corr = (torch.corrcoef(torch.stack([est, exact]))[0, 1].item() if len(pairs) > 1
            else float("nan"))
    return {"alloc_calib_prompts": len(pairs),
            "alloc_calib_abs_log10": (est - exact).abs().mean().item(), "alloc_calib_corr": corr}


@dataclass
class AllocStats:
    """What a step under --alloc adaptive reports beside its StepStats (its field alloc), each a
    column of metrics.jsonl."""
    alloc_n_min: int  # the fewest rollouts a candidate prompt got
    alloc_n_median: float  # the median rollouts per candidate prompt
    alloc_n_max: int  # the most rollouts a candidate prompt got
    informative_per_1k: float  # informative groups (rewards not all equal) per 1,000 rollouts
    rollouts_dropped: int  # the rollouts of the groups dynamic sampling dropped


def sample_allocated_groups(model, tok, cfg, train_set, rng, step, keep_est,
                            estimate: Estimate) -> tuple:
    """One step's rollouts under --alloc adaptive, in brorl.sample_step_groups' signature
    (lib/step.SampleStep; keep_est unused): one round of B candidate prompts, each given its n of
    the step's R rollouts from its estimated Q (allocate), all sampled in one call (the sampler
    takes each prompt's own n). Every group's rewards update the estimate; dynamic sampling drops
    the all-equal groups, and no further round is drawn, since the budget is spent. Returns the
    kept Groups in candidate order, and the StepStats with the allocation's."""
    B, R = cfg.prompts_per_step, cfg.rollout_budget or cfg.prompts_per_step * cfg.n_rollouts
    idx = rng.sample(range(len(train_set)), B)  # the candidates' positions, the same on every rank
    n = allocate(estimate.q_hat(idx), R, cfg.min_rollouts, cfg.max_rollouts).tolist()
    seeds = round_seeds(cfg.seed, step, 0, B)  # one a candidate: rollouts of (seed, step, prompt)
    # One sampler call for all B candidates, each its own n: B Groups of n_j rollouts.
    groups = sample_groups(model, tok, cfg, [train_set[i] for i in idx], n, seeds)
    estimate.update(idx, [x.rewards for x in groups])  # identical on every rank: all rewards
    informative = [bool(x.rewards.min() != x.rewards.max()) for x in groups]  # (B,)
    kept = [x for x, useful in zip(groups, informative) if useful or not cfg.dynamic_sampling]
    stats = StepStats()
    stats.count(groups, cfg.task)  # one round (keys, sets: also the prompts sampled right)
    stats.groups_survived = stats.groups_kept = len(kept)
    # The allocation's statistics; the rollouts of the groups dropped.
    dropped = sum(s for s, useful in zip(n, informative) if not useful)
    stats.alloc = AllocStats(min(n), torch.tensor(n).double().quantile(0.5).item(), max(n),
                             1000 * sum(informative) / R, dropped if cfg.dynamic_sampling else 0)
    return kept, stats


def sampler(estimate: Estimate) -> SampleStep:
    """--alloc adaptive's sampling phase for brorl.rl_step: sample_allocated_groups with
    `estimate`."""
    return functools.partial(sample_allocated_groups, estimate=estimate)
