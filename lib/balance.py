"""
balance.py: the mass balance of Theorem 1 (docs/paper.md section 3), measured per update inside the
transformer (--mass_balance, the sets task, one process). Before and after a step's updates, each
trained group's prompt has its whole answer distribution (lib/answers.py), the mass outside the
answer space counted as one more wrong answer. The group splits its prompt's answers four ways:
sampled right (the set A of the theorem), sampled wrong (B), unsampled right (U and P), unsampled
wrong (U and N); each part's mass is kept before and after.

The theorem's first-order terms, from the same sets, read each answer's log-probability as a logit
of one softmax (p the answer distribution before the step; the group's rewards centred by its mean
r, so R_c = 1 - r and R_w = -r; each distinct sampled answer once):
  S_R = R_c P_pos + R_w P_neg,  A2, B2, U_pos2, U_neg2 the sums of p^2 over the four sets,
  term1 = (R_c - S_R) Q_neg A2,  term2 = (S_R - R_w) Q_pos B2,
  term3 = S_R (Q_pos U_neg2 - Q_neg U_pos2)      (dQ_pos = eta/N (term1 + term2 + term3))
and the free-logit model's first-order change of the unsampled right mass, dz_j = p_j (R_j - S_R),
dp_j = p_j (dz_j - sum_k p_k dz_k), summed over U and P (up to the same positive factor eta/N).
A transformer is not free logits: its update moves every prompt through shared weights, and several
mini-batch steps of AdamW are not one gradient step. So the record also holds the change of Q of the
exact-Q set's prompts that were not in the step: what the other prompts' updates did to them.

Two approximations, both small under --preset sets. A sampled response is matched to the space by
its text: one the integer rule accepts in another spelling (" 123", "0123") is rewarded right but
counted in the outside mass, which is wrong; with 4 new tokens at most (the preset's) no such
response fits. And a prompt drawn in two rounds of one step is two groups, whose measured change
is their joint one.
"""

import math

import torch

from lib import answers
from lib.mass import exact_log_mass, measured_task
from lib.step import Group


def sampled_sets(group: Group, keep: torch.Tensor, space_index: dict) -> tuple:
    """The distinct answers a group's trained rollouts (those in keep) drew, as indices into the
    space (A: outside the space, a truncated response included), and their mean reward."""
    ro = group.rollouts.group(group.index, keep)
    drawn = {space_index.get(t, len(space_index)) if not cut else len(space_index)
             for t, cut in zip(ro.texts, ro.truncated.tolist())}
    return sorted(drawn), group.rewards[keep].mean().item()


def theorem_terms(p: torch.Tensor, right: torch.Tensor, drawn: list, mean_reward: float) -> dict:
    """Theorem 1's quantities for one group: p (A+1,) the answer distribution (the last entry the
    mass outside the space), right (A+1,) bool, drawn the sampled answers' indices, mean_reward
    r."""
    sampled = torch.zeros_like(right)
    sampled[drawn] = True
    R_c, R_w = 1 - mean_reward, -mean_reward  # rewards centred by the group's mean
    sets = dict(A=sampled & right, B=sampled & ~right, U_pos=~sampled & right,
                U_neg=~sampled & ~right)
    Q_pos = p[right].sum().item()
    Q_neg = 1 - Q_pos
    P_pos, P_neg = p[sets["A"]].sum().item(), p[sets["B"]].sum().item()
    S_R = R_c * P_pos + R_w * P_neg
    sq = {k: (p[s] ** 2).sum().item() for k, s in sets.items()}  # A2, B2, U_pos2, U_neg2
    t = dict(S_R=S_R, A2=sq["A"], B2=sq["B"], U_pos2=sq["U_pos"], U_neg2=sq["U_neg"],
             term1=(R_c - S_R) * Q_neg * sq["A"], term2=(S_R - R_w) * Q_pos * sq["B"],
             term3=S_R * (Q_pos * sq["U_neg"] - Q_neg * sq["U_pos"]))
    reward = torch.where(sets["A"], R_c, torch.where(sets["B"], R_w, 0.0)).to(p.dtype)  # (A+1,)
    dz = p * (reward - S_R)  # the surrogate's gradient on the logits (eta/N left out)
    dp = p * (dz - (p * dz).sum())  # the softmax's first-order response
    t.update(pred_dq=dp[right].sum().item(), pred_du_pos=dp[sets["U_pos"]].sum().item())
    return t, sets


def with_outside(logp: torch.Tensor) -> torch.Tensor:
    """p (P, A+1) from log p (P, A): the answers' probabilities, then the mass outside the space."""
    p = logp.exp()
    return torch.cat([p, (1 - p.sum(1, keepdim=True)).clamp(min=0)], 1)


class Snapshot:
    """What a step's mass balance needs before (and again after) its updates: the trained prompts'
    whole answer distributions and the log Q of the other prompts followed (the exact-Q set's).
    kept: the step's Groups; followed: the prompts followed, those of kept excepted."""

    def __init__(self, model, tok, cfg, kept: list[Group], followed: list):
        trained = [k.example for k in kept]
        trained_prompts = {x["prompt"] for x in trained}
        others = [x for x in followed if x["prompt"] not in trained_prompts]
        self.followed = followed  # (the snapshot after the update follows the same prompts)
        self.space = answers.space(cfg.task)
        self.logp = answers.distribution(model, tok, trained, self.space, cfg.temperature,
                                         cfg.system_prompt)  # (G, A)
        # (O,) the right values' sequences
        self.others_log_q = exact_log_mass(model, tok, others, measured_task(cfg).right_answers,
                                           cfg.temperature, cfg.system_prompt)


def records(before: Snapshot, after: Snapshot, kept: list[Group], keep: torch.Tensor) -> dict:
    """The step's mass balance: per trained group its four parts' mass before and after, the
    theorem's terms and the measured change of Q; and the mean change of log10 Q of the other
    prompts. kept: the step's Groups; keep (G, m): the rollouts of each that the update trained on.
    The per-group list goes to metrics.jsonl under "balance_groups"."""
    space = before.space
    index = {a: i for i, a in enumerate(space)}
    right = answers.right_mask([k.example for k in kept], space)  # (G, A)
    right = torch.cat([right, torch.zeros(len(kept), 1, dtype=torch.bool)], 1)  # outside: wrong
    p0, p1 = with_outside(before.logp), with_outside(after.logp)  # (G, A+1)
    groups = []
    for g, k in enumerate(kept):
        drawn, r = sampled_sets(k, keep[g], index)
        t, sets = theorem_terms(p0[g], right[g], drawn, r)
        rec = dict(prompt=k.example["prompt"], n=len(k.rewards), mean_reward=r, drawn=len(drawn),
                   q_before=p0[g][right[g]].sum().item(), q_after=p1[g][right[g]].sum().item(), **t)
        for name, s in sets.items():
            rec[f"{name}_before"], rec[f"{name}_after"] = (p0[g][s].sum().item(),
                                                           p1[g][s].sum().item())
        groups.append({k: float(f"{v:.6g}") if isinstance(v, float) else v for k, v in rec.items()})
    d_others = (after.others_log_q - before.others_log_q) / math.log(10)  # (O,)
    du = [x["U_pos_after"] - x["U_pos_before"] for x in groups]
    with_u = [(x, d) for x, d in zip(groups, du) if x["U_pos_before"] > 0]
    return {"balance_groups": groups,
            "balance_term3_neg": sum(x["term3"] < 0 for x in groups) / max(len(groups), 1),
            "balance_du_pos_mean": sum(du) / max(len(du), 1),
            # over the groups that left right mass unsampled, as the sign's agreement below
            "balance_du_pos_fell": sum(d < 0 for _, d in with_u) / max(len(with_u), 1),
            "balance_sign_agree": sum((x["pred_du_pos"] < 0) == (d < 0) for x, d in with_u)
            / max(len(with_u), 1),
            "balance_dq_trained": sum(x["q_after"] - x["q_before"] for x in groups)
            / max(len(groups), 1),
            "balance_others_dlog10q": d_others.mean().item() if len(d_others) else 0.0,
            "balance_others": len(d_others)}
