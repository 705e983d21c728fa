"""
objectives.py: the alternatives to the paper's objective that brorl.py offers as flags, each a
drop-in for one piece of it. OBJECTIVES is the table of --loss: each name's token loss (PPO-clip's,
the paper's, stays in brorl.policy_token_loss; the others replace it), what --loss_agg auto runs
with it (GSPO's and SAPO's papers' per-sequence mean: aggregation) and the flags it alone reads,
declared here as a small dataclass of its own (LossFlags gathers them; lib/config.RunOptions
extends it, so brorl.Config holds the recipe's fields alone); the help, the checks, the update and
the docs' lists read it, so a new loss is one entry.
--focal_gamma scales each group's advantages by F-GRPO's focal weight; --train_rollouts m trains
each group on the m of its N rollouts whose rewards vary most (PODS), keeping the breadth of
sampling without the update's cost. The paper's own pieces (PPO-clip with dual-clip, TIS, the k2
KL, the normalisers) are in brorl.py.
"""

import dataclasses
from dataclasses import dataclass
from typing import Callable

import torch


def aggregation(loss: str, loss_agg: str) -> str:
    """--loss_agg as run: auto is the loss's own (OBJECTIVES): the per-sequence mean with GSPO (its
    paper's objective, and what verl hard-codes inside its GSPO loss: a token mean would weigh each
    sequence's ratio by its length, another gradient on ragged batches) and with SAPO (what verl
    hard-codes and TRL runs for it: each sequence's token mean, then the mean over sequences), the
    token mean (DAPO's) otherwise. brorl.Config resolves it as it is made; an unknown --loss is
    left to lib/checks' line."""
    return OBJECTIVES[loss].aggregation if loss_agg == "auto" and loss in OBJECTIVES else loss_agg


def max_variance_subset(rewards: torch.Tensor, m: int) -> torch.Tensor:
    """PODS's max-variance down-sampling (arXiv 2504.13818): rewards (G, N) -> indices (G, m),
    ascending, of the m rollouts of each group whose rewards have the largest variance. The
    maximiser is always the i highest and the m - i lowest rewards for some i (PODS, Lemma 3.1):
    try all m + 1. With binary rewards it is the balanced set, as many right as wrong as the group
    allows. m = N keeps all, in order."""
    G, N = rewards.shape
    order = rewards.argsort(dim=1, descending=True, stable=True)  # (G, N)
    # (m+1, G, m): candidate i is the i highest rewards and the m - i lowest.
    cands = torch.stack([torch.cat([order[:, :i], order[:, N - (m - i):]], 1)
                         for i in range(m + 1)])
    # (G,) the first of the candidates with the largest variance.
    best = rewards[torch.arange(G)[:, None], cands].var(2, unbiased=False).argmax(0)
    return cands[best, torch.arange(G)].sort(1).values  # (G, m)


def focal_weight(success: torch.Tensor, gamma: float) -> torch.Tensor:
    """F-GRPO's focal weight (arXiv 2602.06717): success (G,), each group's success rate mu (the
    mean of its 0/1 rewards) -> (G,), each group's (1 - mu)^gamma, the factor its advantages are
    multiplied by. A group that is mostly right (mu near 1) is damped, so that the
    update leans on the groups whose right answers are rare: the paper's remedy for the unsampled
    right mass that a sharpening update takes away."""
    return (1 - success).clamp(min=0) ** gamma


def gspo_token_loss(logp, old_logp, adv, mask, clip_low, clip_high):
    """GSPO (arXiv 2507.18071), per token (r, T). Where PPO has a ratio per token, GSPO has one per
    sequence, s = exp(mean over its tokens of logp - logp_old) (the geometric mean of its token
    ratios: length-normalised, so it stays near 1), clipped per sequence, [1 - 3e-4, 1 + 4e-4] in
    the paper: a clipped sequence gives no gradient at all. Returned in the paper's GSPO-token
    form, ratio_t = sg(s) * exp(logp_t - sg(logp_t)): each token's value is its sequence's, and
    the per-row mean (--loss_agg sequence, the paper's) gives exactly the gradient of
    -min(s A, clip(s) A) per sequence."""
    n = mask.sum(1).clamp(min=1)  # (r,) valid tokens per row
    log_s = ((logp - old_logp) * mask).sum(1) / n  # (r,) log of the sequence ratio
    # (r, T): each token's value is its sequence's ratio s.
    ratio = torch.exp((logp - logp.detach() + log_s.detach()[:, None]).clamp(-20, 20))
    a = adv[:, None]  # (r, 1)
    return torch.max(-ratio * a, -ratio.clamp(1 - clip_low, 1 + clip_high) * a), ratio  # (r, T)


def cispo_token_loss(logp, old_logp, adv, clip_high):
    """CISPO (MiniMax-M1, arXiv 2506.13585), per token (r, T): -sg(min(ratio, 1 + eps_high)) * A *
    logp. Where PPO drops a token whose ratio left the trust region (zero gradient), CISPO keeps
    every token's REINFORCE gradient and clips only its importance weight, detached. The paper sets
    no lower bound and tunes eps_high without publishing it: here --clip_high (0.28), verl's
    clip_ratio_high."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # (r, T)
    return -ratio.clamp(max=1 + clip_high).detach() * adv[:, None] * logp, ratio


def sapo_token_loss(logp, old_logp, adv, tau_pos, tau_neg):
    """SAPO (arXiv 2511.20347), per token (r, T): -sigmoid(tau (ratio - 1)) * (4 / tau) * A, tau
    tau_pos where A > 0 and tau_neg otherwise (TRL's sapo_temperature_pos / _neg, verl's tau_pos /
    tau_neg: 1.0 and 1.05). Where PPO's clip cuts a token's gradient off at the trust region's
    edge, SAPO's sigmoid gate fades it smoothly: the objective's gradient is 4 s (1 - s) ratio A
    d logp, s the sigmoid, so at ratio 1 (s = 1/2) it is the policy gradient exactly, and it
    shrinks as the ratio leaves 1; the larger tau_neg fades negative-advantage tokens faster, as
    they are the less stable. On policy (the first mini-batch of a step, fp32) it is the policy
    gradient."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # (r, T)
    a = adv[:, None]  # (r, 1) each row's advantage, along its tokens
    tau = torch.where(a > 0, tau_pos, tau_neg).to(ratio.dtype)  # (r, 1)
    return -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * a, ratio


# ----------------------------------------------------------------------------
# The table of --loss. Each alternative's entry reads its own flags from the Config and returns
# the loss per token (r, T), the ratio (r, T) and where its clip binds (r, T), as
# brorl.policy_token_loss does for PPO. The flags it alone reads are a dataclass of its own, each
# field a --flag whose comment is its --help, as brorl.Config's are.


@dataclass
class GSPOFlags:
    """--loss gspo's own flags (lib/objectives.OBJECTIVES)"""
    gspo_clip_low: float = 3e-4  # GSPO's eps_low on the sequence ratio (arXiv 2507.18071: 3e-4)
    gspo_clip_high: float = 4e-4  # GSPO's eps_high on the sequence ratio (the paper: 4e-4)


def gspo_loss(logp, old_logp, adv, mask, cfg):
    """--loss gspo: its clip binds where a sequence's ratio left [1 - eps_low, 1 + eps_high] on its
    advantage's side (no dual clip: that is PPO's alone)."""
    lo, hi = cfg.gspo_clip_low, cfg.gspo_clip_high
    loss, ratio = gspo_token_loss(logp, old_logp, adv, mask, lo, hi)
    a = adv[:, None]  # (r, 1)
    return loss, ratio, ((ratio > 1 + hi) & (a > 0)) | ((ratio < 1 - lo) & (a < 0))  # (r, T)


def cispo_loss(logp, old_logp, adv, mask, cfg):
    """--loss cispo: its clip binds where the weight is truncated (the gradient kept)."""
    loss, ratio = cispo_token_loss(logp, old_logp, adv, cfg.clip_high)
    return loss, ratio, ratio > 1 + cfg.clip_high


@dataclass
class SAPOFlags:
    """--loss sapo's own flags (lib/objectives.OBJECTIVES)"""
    sapo_tau_pos: float = 1.0  # SAPO's gate temperature where A > 0 (arXiv 2511.20347; TRL: 1.0)
    sapo_tau_neg: float = 1.05  # SAPO's gate temperature where A <= 0 (TRL: 1.05)


def sapo_loss(logp, old_logp, adv, mask, cfg):
    """--loss sapo: no clip binds, its gate only fades."""
    loss, ratio = sapo_token_loss(logp, old_logp, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    return loss, ratio, torch.zeros_like(mask, dtype=torch.bool)


@dataclass(frozen=True)
class Objective:
    """One --loss: what the update, --loss_agg auto and the checks need of it."""
    token_loss: Callable | None  # (logp, old_logp, adv, mask, cfg) -> loss, ratio, clipped,
    # each (r, T); None: PPO-clip, written out in brorl.policy_token_loss
    aggregation: str  # what --loss_agg auto runs with it: token or sequence
    flags: tuple = ()  # the Config fields that count only with it (checks.COUNTS_ONLY_WITH):
    # brorl.Config's it reads (PPO-clip's bounds), then its own flags' (options), added below
    options: type | None = None  # the dataclass of the flags it alone reads, declared beside it

    def __post_init__(self):
        own = tuple(f.name for f in dataclasses.fields(self.options)) if self.options else ()
        object.__setattr__(self, "flags", self.flags + own)  # (frozen: set once, here)


# --loss's names, in --help's order; the first is Config's default, the paper's.
OBJECTIVES = {
    "ppo": Objective(None, "token", ("clip_low", "clip_high", "clip_ratio_c")),
    "gspo": Objective(gspo_loss, "sequence", options=GSPOFlags),
    "cispo": Objective(cispo_loss, "token", ("clip_high",)),
    "sapo": Objective(sapo_loss, "sequence", options=SAPOFlags),
}

# Every entry's own flags in one dataclass, which lib/config.RunOptions extends: each is a --flag
# and a field of brorl.Config like any other (config.json, presets, --resume), declared here. Its
# bases in reverse, so that its fields come in the table's order.
LossFlags = dataclasses.make_dataclass(
    "LossFlags", [], bases=tuple(o.options for o in reversed(OBJECTIVES.values()) if o.options))
