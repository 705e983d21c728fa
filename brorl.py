"""
brorl: BroRL (ICML 2026, PMLR 306; arXiv 2510.01180), a function a phase. RLVR, scaled along
the *breadth* axis: hundreds of rollouts per prompt instead of more steps.

One step, as implemented (docs/paper.md §2 is the ProRL v2 recipe that BroRL keeps):
  1. rollout     sample N completions for each prompt (sampler.py): each prompt is prefilled ONCE,
                 and its N rollouts decode against that one copy of its keys and values.
  2. reward      the verifier (verify.py, called by lib/step.score): 1 correct, 0 otherwise; on
                 math, its rules or Math-Verify (--verifier).
  3. dynamic     drop the groups whose N rewards are all equal (no signal) and keep sampling new
     sampling    prompts until B groups survive, or until a cap on rounds (then fewer; with none,
                 no update). --alloc adaptive samples its own way (lib/allocation.py).
  4. advantages  REINFORCE++-baseline: r - mean_group(r), whitened over the batch's valid response
                 tokens (as verl); or over responses, or GRPO's / std_group, or none (Dr. GRPO).
  5. update      PPO-clip with decoupled bounds (clip-higher, 0.2 / 0.28) and dual-clip (c = 3),
                 token-level mean over the mini-batch's response tokens, truncated importance
                 sampling for the sampler/trainer drift, optional k2 KL to a periodically reset
                 reference, a fixed number of mini-batch updates, AdamW, gradient clipping (or the
                 alternatives of lib/objectives.py). Its forward, lib/logprobs.response_logprobs,
                 runs each prompt once, its N rows attending to its keys and values. Log-probs:
                 kernels.linear_logprobs from hidden states, the logits never whole (another head:
                 kernels.token_logprobs on its logits); the sampler's kernels.token_logprobs.
  6. eval/log    held-out pass@1 (temperature 0.6, top_p 0.95, and greedy) and unbiased pass@k;
                 the correct mass Q(x) (Theorem 1's Q_pos, per prompt: docs/paper.md §3), sampled
                 on a probe set and exact where the answer is one token sequence
                 (lib/diagnostics.py); a log line a step, metrics.jsonl, metrics.png; checkpoints.

Where this simplifies the paper:
  1. One engine: the trainer samples its own rollouts (no vLLM server), in memory-bounded chunks.
     In float32 the sampler's log-probs serve as the old policy's (--old_logp; max|ratio-1|
     checks it); in bf16 the old log-probs are a trainer forward's, and the drift is logged and
     corrected by TIS (--tis_cap).
  2. The default is a toy: a 0.62M-parameter character-level model warm-started on right and
     wrong addition procedures (data.py); RL selects the right one, as RLVR a model's behaviour.
  3. The learning rate is not scaled by sqrt(samples per step) automatically; set --lr.

Run: `python brorl.py` (the tiny model, a CPU, minutes); `--preset gsm8k-0.5b` (one GPU); `--resume
runs/<run>`; `torchrun ... brorl.py` (K processes); `--help`, every flag (docs/running.md).

Beside it: sampler.py (rollouts), kernels.py (log-probs), verify.py (rewards), data.py (tasks, the
embedded model); lib/ the machinery (flags, harness, model plumbing, planner, processes,
diagnostics), which a reader may skip but for step.py (what the phases hand each other: scored
rollouts, a prompt's Group, the step's statistics) and logprobs.response_logprobs; tools/ the
programs run beside training; docs/paper.md the paper restated; docs/results/ every figure.
"""

import math
import random
import time
from dataclasses import dataclass, replace

import torch

import data
from lib import (allocation, config, diagnostics, distributed, evalonly, harness, plan, samples,
                 setup, steplog)
from lib.errors import fail
from lib.logprobs import old_logprobs, reference_logprobs, response_logprobs
from lib.lora import make_reference, trainable
from lib.objectives import OBJECTIVES, aggregation, focal_weight, max_variance_subset
from lib.policy import autocast, clip_gradients
from lib.step import (Batch, Group, SampleStep, StepStats, pack_groups, sample_groups,
                      sample_share)
from sampler import draw_seeds, round_seeds

# ----------------------------------------------------------------------------
# Config: the recipe and its alternatives (it extends lib/config.RunOptions, the run around it,
# which carries the flags an alternative run by lib/ declares beside its code: each loss's own in
# its lib/objectives.OBJECTIVES entry, LoRA's --lora_rank, --lora_alpha and --lora_targets); each
# field a --flag, its comment its help. CONTRIBUTING.md, rule 7, says which fields go here.


@dataclass
class Config(config.RunOptions):
    # The model and the task.
    model: str = str(data.EMBEDDED_MODEL)  # the policy model: HF hub id (id@revision: a branch,
        # tag or commit) or local dir (default: the embedded tiny model)
    task: str = "arith"  # training task: arith, keys or sets (embedded: data.py), or gsm8k:/math:
        # + a .jsonl/.json/.parquet path or hub id[:config][@split]
    digits: int = 3  # arith's digits per operand (the difficulty knob)
    seed: int = 0  # random seed of the prompts' draw, the sampling and every init
    dtype: str = "auto"  # compute dtype (autocast; weights, AdamW fp32); auto: a run's checkpoint's
    # own, else bf16 on CUDA and on a CPU with native bf16 (AVX512_BF16, AMX) at hidden size >= 512,
    # else fp32 (policy.py)
    # Rollouts. The paper samples N = 512 rollouts for each of B = 128 prompts a step.
    n_rollouts: int = 512  # N: rollouts per prompt (paper 512; ProRL 16)
    prompts_per_step: int = 2  # B: groups kept per step after dynamic sampling (paper 128);
        # under --alloc adaptive, the candidate prompts of its one round, all-equal ones dropped
    max_new_tokens: int = 6  # response length cap in tokens; a truncated response gets reward 0
    temperature: float = 1.0  # rollout temperature, also used by every training log-prob
    top_p: float = 1.0  # rollouts' top-p nucleus; 1.0 to train (the loss's is the full softmax)
    # Dynamic sampling, as DAPO's.
    dynamic_sampling: bool = True  # dynamic sampling: drop groups whose rewards are all equal
    max_rounds: int = 8  # dynamic sampling's most rounds a step, each of new prompts (then < B)
    # Rollouts per prompt (lib/allocation.py). Uniform gives each prompt N, drawing rounds until B
    # groups survive; adaptive draws B candidates once and splits R rollouts among them by each
    # one's estimated Q, to make informative groups likely (with PODS, min(m, n) a group).
    alloc: str = "uniform"  # rollout allocation: uniform (N a prompt) or adaptive (a step's R
        # split by each prompt's estimated Q; with PODS, min(m, n) trained)
    rollout_budget: int = 0  # R: --alloc adaptive's rollouts a step, spent exactly (0: B x N)
    min_rollouts: int = 4  # --alloc adaptive's floor of rollouts per candidate prompt (>= 2):
                           # no prompt is dropped for good
    max_rollouts: int = 512  # --alloc adaptive's most rollouts one prompt gets a step
    alloc_decay: float = 0.95  # --alloc adaptive's forgetting: its estimate's counts x this a
                               # step (the policy moves)
    # Advantages (compute_advantages). PODS (arXiv 2504.13818) keeps the breadth of sampling but
    # trains on the m rollouts of a group whose rewards vary most.
    adv_norm: str = "batch"  # advantages' normalisation: batch, response, group or none
    focal_gamma: float = 0.0  # F-GRPO's focal weight: advantages x (1 - success rate)^gamma; 0: off
    train_rollouts: int = 0  # m: rollouts per group the update trains on (PODS); 0: all N
    # The policy update.
    lr: float = 2e-4  # learning rate of AdamW, constant (paper: ProRL v2's 1e-6 x sqrt(64k/8k)
                      # for a 1.5B model; 5e-4 here overshoots)
    weight_decay: float = 0.0  # weight decay of AdamW (unstated in the paper)
    n_minibatches: int = 2  # mini-batches a step, one AdamW update each (fixed as N grows)
    grad_clip: float = 1.0  # gradient clipping: max global grad norm
    old_logp: str = "auto"  # the old policy's log-probs: sampler, recompute; auto: sampler in fp32
    # The objective (policy_token_loss). Dr. GRPO is PPO with --adv_norm none --loss_agg constant;
    # GSPO's and SAPO's own flags are their entries' (lib/objectives.py).
    loss: str = "ppo"  # policy loss per token (policy_token_loss; lib/objectives.OBJECTIVES)
    clip_low: float = 0.2  # PPO's eps_low: the ratio's clip floor is 1 - eps_low
    clip_high: float = 0.28  # PPO's eps_high: clip ceiling 1 + eps_high (clip-higher), CISPO's too
    clip_ratio_c: float = 3.0  # dual-clip's c (PPO's): a negative-advantage token's loss <= -c*A
    tis_cap: float = 2.0  # truncated importance sampling's cap C on the sampler ratio; 0: off
    loss_agg: str = "auto"  # loss aggregation: token (mini-batch's token mean), sequence (rows'
        # means' mean) or constant (Dr. GRPO); auto: the --loss's own (lib/objectives.OBJECTIVES)
    kl_coef: float = 0.0  # coefficient of the k2 KL to a reference; 0: off (ProRL v2: 1e-4)
    ref_reset_every: int = 100  # steps between resets of the KL's reference to the current policy
    verifier: str = "auto"  # math verifier: rules, math_verify or both; auto: both if installed
    # The schedule and the evaluation.
    steps: int = 100  # training steps to run (the most, with --time_budget)
    eval_every: int = 25  # held-out eval period in steps (also at the start and the end)
    eval_prompts: int = 64  # held-out prompts per eval
    eval_samples: int = 32  # samples per eval prompt (pass@1 their mean, pass@k unbiased; paper 16)
    eval_max_new_tokens: int = 0  # response length cap in tokens at eval; 0: --max_new_tokens

    def __post_init__(self):
        # --loss_agg auto becomes the --loss's own (lib/objectives.OBJECTIVES), so that the config
        # (and config.json) says what runs.
        self.loss_agg = aggregation(self.loss, self.loss_agg)


def parse_config(argv=None) -> Config:
    """The Config of the command line (lib/config.py): a preset, the flags, checked; or --resume."""
    return config.parse_config(Config, " ".join(__doc__.split("\n\n")[0].split()), argv)


# ----------------------------------------------------------------------------
# Rollouts, reward and dynamic sampling. lib/step.py holds what this phase and lib/ share:
# sample_groups samples each prompt's group (sampler.generate; each of K ranks a share of the
# prompts) and scores it (lib/step.score: verify.py's verdict, 0 for a truncated response), every
# rank given every group's rewards; a Group is a prompt's, StepStats what the phase reports.


def sample_step_groups(model, tok, cfg, train_set, rng, step, keep_est) -> tuple:
    """Sample groups until B survive dynamic sampling (or max_rounds hits): at most B kept Groups,
    and the StepStats. Every rank draws the same prompts and sees every group's rewards, so all
    keep the same groups (lib/step.SampleStep states this phase's signature)."""
    B, N = cfg.prompts_per_step, cfg.n_rollouts
    kept, stats = [], StepStats()
    while len(kept) < B and stats.rounds < cfg.max_rounds:
        # Ask for enough prompts to fill B at the keep rate seen so far (this step's, else recent
        # steps'), at most 4B a round. Without dynamic sampling every group is kept, so exactly
        # the B needed are drawn.
        rate = (stats.groups_survived / stats.groups_generated if stats.groups_generated
                else keep_est)
        want = (min(math.ceil((B - len(kept)) / max(rate, 0.1)), 4 * B) if cfg.dynamic_sampling
                else B - len(kept))
        want = min(want, len(train_set))  # A round's prompts are distinct: at most the whole set.
        batch = rng.sample(train_set, want)  # the same prompts on every rank
        seeds = round_seeds(cfg.seed, step, stats.rounds, want)
        groups = sample_groups(model, tok, cfg, batch, N, seeds)  # want Groups of N rollouts
        stats.count(groups, cfg.task)  # (keys, sets: also the prompts sampled right)
        informative = [x for x in groups if x.rewards.min() != x.rewards.max()]
        kept += informative if cfg.dynamic_sampling else groups
        stats.groups_survived = len(kept)
    kept = kept[:B]  # DAPO keeps exactly B, so the last round's extra survivors are dropped.
    stats.groups_kept = len(kept)
    return kept, stats


# ----------------------------------------------------------------------------
# Advantages, over the rows the update trains on: flat, group-major, each with its group's index


def trained_rows(kept: list[Group], m: int = 0) -> tuple:
    """The rows trained on, of each kept group the m whose rewards vary most (PODS; m = 0: all):
    the chosen (G tensors (m_j,), indices among n), each row's group, reward, tokens (R,) each."""
    chosen = [max_variance_subset(k.rewards[None], m)[0] if 0 < m < len(k.rewards)
              else torch.arange(len(k.rewards)) for k in kept]
    sizes = torch.tensor([len(c) for c in chosen])  # (G,) rows per group
    group = torch.arange(len(kept)).repeat_interleave(sizes)  # (R,)
    rewards = torch.cat([k.rewards[c] for k, c in zip(kept, chosen)])  # (R,)
    lengths = torch.cat([k.lengths[c] for k, c in zip(kept, chosen)])  # (R,)
    return chosen, group, rewards, lengths


def compute_advantages(rewards: torch.Tensor, group: torch.Tensor, norm: str = "batch",
                       lengths=None, focal_gamma: float = 0.0) -> torch.Tensor:
    """rewards (R,), one per response, group (R,) the index of its prompt's group (groups of equal
    or unequal N alike), lengths (R,) its valid tokens -> advantages (R,). r - mean_group(r), then
      batch:    whitened over all valid response tokens of the batch (verl's masked whitening, as
                ProRL v2 and BroRL): each response counts once per token, so with the token-mean
                loss the advantages sum to 0 over tokens whatever the lengths. Unbiased variance,
                eps 1e-8 inside the sqrt. response: over responses; group: GRPO's /
                (std_group + 1e-6); none: nothing more (Dr. GRPO, 2503.20783).
    An all-equal group (only with --dynamic_sampling 0) is centred to 0, then whitened with the
    rest, as verl: -mean/std for all its rows, which keeps the zero token-sum exact (group, none: it
    stays 0). focal_gamma > 0: each group's advantages x (1 - mu)^gamma, mu its success rate."""
    if norm == "batch" and lengths is None:
        raise ValueError("adv_norm batch whitens over tokens: pass the responses' lengths")
    each = [rewards[group == j] for j in range(int(group.max()) + 1)]  # G tensors (n_j,)
    mean = torch.stack([r.mean() for r in each])  # (G,) each group's mean reward
    centred = rewards - mean[group]  # (R,)
    if norm == "group":
        adv = centred / (torch.stack([r.std() for r in each])[group] + 1e-6)  # (R,)
    elif norm == "none":
        adv = centred
    else:  # Over the whole batch: with K processes every rank holds all rows' rewards and
        # lengths. Each response weighs its valid tokens (batch) or 1 (response). (R,)
        adv = whiten(centred, lengths if norm == "batch" else torch.ones_like(centred))
    return adv * focal_weight(mean, focal_gamma)[group] if focal_gamma else adv  # (R,)


def whiten(centred: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """(centred - mean) / sqrt(var + 1e-8), in float64, the mean and the unbiased variance taken
    over all entries, each counted `weights` times (verl's masked whitening when the weights are
    the responses' valid tokens). With a total weight of 1 or less, centred comes back as it is."""
    w, x = weights.double(), centred.double()
    n = w.sum()  # the valid tokens (batch) or the responses (response)
    mean = (w * x).sum() / n
    if n <= 1:  # There is no variance to divide by.
        return centred
    # Unbiased, as verl's masked_var.
    var = ((w * x * x).sum() / n - mean * mean).clamp(min=0) * n / (n - 1)
    return ((centred - mean) * torch.rsqrt(var + 1e-8)).float()


# ----------------------------------------------------------------------------
# Policy update: the loss per token (r, T) of r rows, its normaliser, the mini-batches' loop


def loss_weights(mask: torch.Tensor, agg: str, n_tokens=None, n_rows=None, max_len=None,
                 dtype=torch.float32):
    """Per-token weights (r, T) in the loss's dtype, from the mini-batch's counts (n_tokens valid
    tokens, n_rows rows; by default the rows given; with K processes, over all ranks): each row's
    weights are its own, so any micro-batching gives the same gradient. token: 1 / n_tokens (DAPO,
    ProRL v2); sequence: 1 / (row length * n_rows) (GSPO's); constant: 1 / (max_len * n_rows), Dr.
    GRPO's, so that no response's length scales its own tokens' gradient."""
    m = mask.to(dtype)  # (r, T)
    n_tokens = (m.sum() if n_tokens is None
                else torch.as_tensor(n_tokens, dtype=dtype, device=m.device))
    n_rows = m.shape[0] if n_rows is None else n_rows
    if agg == "token":
        return m / n_tokens.clamp(min=1)
    if agg == "constant":
        return m / (max_len * n_rows)
    return m / m.sum(1, keepdim=True).clamp(min=1) / n_rows


def ppo_token_loss(logp, old_logp, adv, clip_low, clip_high, clip_ratio_c=3.0):
    """PPO-clip with decoupled bounds, per token (r, T): the README's first three lines. As verl:
    the log-ratio clamped to +-20 before exp (no inf), and dual-clip caps a negative-advantage
    token's loss at -c*A."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # (r, T)
    a = adv[:, None]  # (r, 1) each row's advantage, along its tokens
    pg = torch.max(-ratio * a, -ratio.clamp(1 - clip_low, 1 + clip_high) * a)  # (r, T) clip
    pg = torch.where(a < 0, torch.min(pg, -clip_ratio_c * a), pg)  # (r, T) dual clip
    return pg, ratio


def policy_token_loss(logp, old_logp, adv, mask, cfg):
    """--loss: the policy loss per token (r, T), the ratio, where the clip binds (PPO, GSPO: zero
    gradient there; CISPO: the weight truncated, the gradient kept; SAPO: none, its gate only
    fades). PPO's is here; an alternative is its entry of lib/objectives.OBJECTIVES. Dual-clip is
    PPO's alone (verl): the others' bounds cap it."""
    if alternative := OBJECTIVES[cfg.loss].token_loss:  # None: PPO-clip, the paper's, below
        return alternative(logp, old_logp, adv, mask, cfg)
    a = adv[:, None]  # (r, 1)
    lo, hi = cfg.clip_low, cfg.clip_high
    loss, ratio = ppo_token_loss(logp, old_logp, adv, lo, hi, cfg.clip_ratio_c)
    clipped = ((ratio > 1 + hi) & (a > 0)) | ((ratio < 1 - lo) & (a < 0))  # (r, T)
    # Dual-clip also binds where a negative advantage's ratio passes c.
    return loss, ratio, clipped | ((ratio > cfg.clip_ratio_c) & (a < 0))


def tis_weight(old_logp, sampler_logp, cap):
    """Truncated importance sampling (r, T): min(exp(logp_old - logp_sampler), C), the sampler's
    tokens reweighted to the trainer's old policy, truncated against rare outliers; exactly 1 when
    both are the same tensor."""
    return (torch.exp((old_logp - sampler_logp).clamp(max=20)).clamp(max=cap) if cap
            else torch.ones_like(old_logp))


def kl_k2(logp, ref_logp):
    """k2 estimator of KL(policy || ref) per token: 0.5 * log-ratio^2, log-ratio clamped to +-10."""
    return 0.5 * (logp - ref_logp).clamp(-10, 10) ** 2


def token_loss(logp, old_logp, sampler_logp, ref_logp, adv, mask, w, cfg):
    """The README's loss, line for line, per token (r, T): the policy term (PPO's ratio, clip and
    dual clip, or --loss's objective), its TIS weight (a constant: no gradient), the k2 KL to the
    reference (ref_logp None: none), each token weighted by w (loss_weights). Returns the loss,
    ratio, where the clip binds, KL."""
    pg, ratio, clipped = policy_token_loss(logp, old_logp, adv, mask, cfg)  # (r, T) each
    # The TIS weight applies to the policy term only, as verl's. (r, T)
    tis = tis_weight(old_logp, sampler_logp, cfg.tis_cap).detach()
    kl = kl_k2(logp, ref_logp) if ref_logp is not None else torch.zeros_like(logp)  # (r, T)
    loss = w * (tis * pg + cfg.kl_coef * kl)  # (r, T), summed over the mini-batch: its loss
    return loss, ratio, clipped, kl


def update_policy(model, ref_model, opt, batch: Batch, adv, cfg, gen_cpu):
    """n_minibatches optimizer steps over the step's R rows, each on a mini-batch's summed
    token_loss; the metrics. batch: this rank's rows (K = 1: all), its lengths all rows' valid
    tokens (G tensors (m_j,)); adv (r,): its rows'."""
    dev = adv.device
    # All ranks' R rows (G*m, or sum m_j), which of them this rank holds, and their valid tokens.
    layout = distributed.RowLayout(batch.lengths, cfg.micro_batch, dev)
    R = len(layout)
    sampler_logp, valid = batch.sampler_logp, batch.resp_mask  # (r, T) each
    # Before any update: the old policy's log-probs and entropies (the sampler's or a forward's),
    # and with --kl_coef the reference's log-probs. (r, T) each
    mine = layout.mine(torch.arange(R))
    old_logp, ent = old_logprobs(model, batch, mine, cfg, dev)
    ref_logp = reference_logprobs(ref_model, batch, mine, cfg, dev) if cfg.kl_coef > 0 else None
    # The drift of the loss's old policy from the sampler's (0 with its log-probs). (tokens,)
    drift = (torch.exp(old_logp - sampler_logp) - 1).abs()[valid]
    sums = dict(entropy=ent[valid].sum().item(), drift_mean=drift.sum().item(), clip_frac=0.0,
                kl=0.0, drift_max=drift.max().item() if len(drift) else 0.0, max_ratio_dev=0.0)
    grad_norm = 0.0
    # Even mini-batches of a permutation that is the same on every rank: 10 rows in 4 make 3, 3,
    # 2, 2, and fewer rows than mini-batches make one row each.
    minibatches = torch.randperm(R, generator=gen_cpu).tensor_split(min(cfg.n_minibatches, R))
    for k, mb in enumerate(minibatches):
        opt.zero_grad(set_to_none=True)
        for rows in layout.mine(mb):  # this rank's rows of the mini-batch, micro-batched
            mask, ref = valid[rows], ref_logp[rows] if ref_logp is not None else None  # (r, T) each
            with autocast(cfg, dev):  # A fresh region per forward sees the last opt.step().
                logp = response_logprobs(model, batch, rows, cfg.temperature)  # (r, T)
            # The weights count the whole mini-batch's tokens and rows, over all ranks. (r, T)
            w = loss_weights(mask, cfg.loss_agg, *layout.counts(mb), cfg.max_new_tokens,
                             logp.dtype)
            loss, ratio, clipped, kl = token_loss(logp, old_logp[rows], sampler_logp[rows], ref,
                                                  adv[rows], mask, w, cfg)
            loss.sum().backward()
            sums["kl"] += (kl * mask).sum().item()
            sums["clip_frac"] += (clipped & mask).sum().item()
            # Before the first update the ratio is 1 up to the rounding of sampler vs trainer.
            if k == 0 and len(rows):
                sums["max_ratio_dev"] = max(sums["max_ratio_dev"],
                                            ((ratio - 1).abs() * mask).max().item())
        norm = clip_gradients(model, cfg.grad_clip)  # over all ranks' gradients
        if not math.isfinite(norm):  # Never step on a NaN or inf gradient.
            raise FloatingPointError(f"gradient norm is {norm} in mini-batch {k}; "
                                     "it was not applied")
        grad_norm += norm / len(minibatches)
        opt.step()
    opt.zero_grad(set_to_none=True)  # Otherwise the gradients would sit through the next rollout.
    if distributed.world_size() > 1:  # Summed (or maxed) over all ranks' rows.
        sums = distributed.reduce(sums, maxes=("drift_max", "max_ratio_dev"))
    # The per-token metrics divide by all ranks' valid tokens, each token counted once.
    n_tok = max(layout.tokens.sum().item(), 1)
    per_token = ("entropy", "drift_mean", "clip_frac", "kl")
    return {**{k: v / n_tok if k in per_token else v for k, v in sums.items()},
            "grad_norm": grad_norm}


# ----------------------------------------------------------------------------
# One step


def rl_step(model, replica, ref_model, opt, tok, cfg, train_set, rng, step, gen_cpu, keep_est,
            sample: SampleStep = sample_step_groups, record=None) -> dict:
    """rollout -> reward -> dynamic sampling -> advantages -> policy update; returns the metrics.
    replica: the policy's full weights, for the rollouts (the policy itself when K = 1). sample:
    the rollout, reward and dynamic sampling phases (train() gives the run's own). record: what
    the instruments record after the update (lib/diagnostics.step_records), or None."""
    replica.eval()
    t0 = time.perf_counter()
    # No weight changes while sampling, so the autocast region's cache stays valid.
    with autocast(cfg, replica.device):
        kept, stats = sample(replica, tok, cfg, train_set, rng, step, keep_est)
    t_roll = time.perf_counter() - t0
    upd = {}
    if kept:  # Else every group was all right or all wrong: nothing to learn from this step.
        # The rows trained on (--train_rollouts m, PODS: m of each group; else all), flat. (R,)
        chosen, group, rewards, lengths = trained_rows(kept, cfg.train_rollouts)
        adv = compute_advantages(rewards, group, cfg.adv_norm, lengths, cfg.focal_gamma)  # (R,)
        batch, my_adv = pack_rows(kept, chosen, adv, model.device)
        model.train()
        upd = update_policy(model, ref_model, opt, batch, my_adv, cfg, gen_cpu)
        if replica is not model:  # K > 1: the replica follows the update, one gather a step.
            distributed.refresh(model, replica)
        if record is not None:  # The mass balance; samples.jsonl's responses (not metrics').
            upd.update(record(replica, tok, cfg, kept, chosen, adv, stats))
        # The reward of the kept groups' rollouts and of the rows trained on.
        upd.update(reward_kept=torch.cat([k.rewards for k in kept]).mean().item(),
                   reward_trained=rewards.mean().item())
    return steplog.step_metrics(stats, t_roll, time.perf_counter() - t0 - t_roll, upd)


def pack_rows(kept: list[Group], chosen: list, adv: torch.Tensor, dev) -> tuple:
    """The update's Batch: each kept group's chosen rollouts on the rank that trains it (K = 1:
    all here), this rank's groups packed into one batch (pack_groups) that carries every rank's
    rows' lengths (G tensors (m_j,)); and this rank's rows' advantages (its rows,)."""
    # Each group's chosen rollouts where this rank sampled it, else None.
    groups = [k.rollouts.group(k.index, c) if k.rollouts is not None else None
              for k, c in zip(kept, chosen)]
    if distributed.world_size() > 1:  # Each group moved to the rank whose share holds it.
        groups = distributed.balance(groups)
    mine = [j for j, x in enumerate(groups) if x is not None]
    lengths = [k.lengths[c] for k, c in zip(kept, chosen)]  # G tensors (m_j,)
    batch = replace(pack_groups([groups[j] for j in mine], dev), lengths=lengths)
    each = adv.split([len(c) for c in chosen])  # G tensors (m_j,)
    return batch, torch.cat([each[j] for j in mine] or [torch.zeros(0)]).to(dev)


# ----------------------------------------------------------------------------
# Evaluation: pass@k on the held-out set. The diagnostics that follow it (the probe's Q, the exact
# Q, the answer distributions) are lib/diagnostics.py's.


def evaluate(model, tok, examples, cfg, gen) -> dict:
    """Held-out pass@1 and pass@k at the paper's eval sampling (T=0.6, top_p=0.95), and greedy.
    pass@k is the unbiased 1 - C(n-c, k) / C(n, k) from n samples (data.pass_at_k), for k = 1, 2,
    4, ... and n itself; the responses' mean length, truncated share and first few. The same
    responses scored twice: by the task's rules and leniently (verify.py: the rules' verdict or
    the last number's), so that a gain splits into the answer's form and its value."""
    n, max_new = cfg.eval_samples, cfg.eval_max_new_tokens or cfg.max_new_tokens
    seeds = draw_seeds(gen, len(examples))  # the same seeds on every rank
    # Each prompt's n samples scored, by the rules and leniently. (P, n) each
    ro, mine, correct, lengths, truncated, lenient = sample_share(
        model, tok, examples, n, 0.6, 0.95, cfg, seeds, max_new, lenient=True)
    # The rollouts are freed before the greedy pass.
    responses, ro = samples.eval_records(examples, ro, mine, correct, lengths, truncated, cfg), None
    _, _, greedy, _, _, greedy_lenient = sample_share(model, tok, examples, 1, 0.0, 1.0, cfg,
                                                      seeds, max_new, lenient=True)  # (P, 1) each
    ks = sorted({2 ** i for i in range(int(math.log2(n)) + 1)} | {n})
    m = {"eval_pass@1": correct.mean().item(), "eval_greedy_pass@1": greedy.mean().item()}
    for k in ks[1:]:
        m[f"eval_pass@{k}"] = sum(data.pass_at_k(n, int(c), k)
                                  for c in correct.sum(1)) / len(examples)
    m["eval_pass@k"] = m[f"eval_pass@{n}"]  # k = --eval_samples
    # Each held-out problem's correct samples of n (for paired tests between runs); the mean
    # response length in tokens and the share cut at the length cap; the first few responses
    # (samples.jsonl's, written by harness.Run.log, not metrics.jsonl's).
    # The lenient reading's pass@1 and greedy pass@1, and its correct samples of each problem.
    lenient_m = {"eval_lenient_pass@1": lenient.mean().item(),
                 "eval_greedy_lenient_pass@1": greedy_lenient.mean().item(),
                 "eval_lenient_correct": [int(c) for c in lenient.sum(1)]}
    return {**m, "eval_correct": [int(c) for c in correct.sum(1)], "eval_resp_len":
            lengths.mean().item(), "eval_truncated": truncated.mean().item(),
            **lenient_m, "eval_responses": responses}


def eval_only(cfg: Config) -> dict:
    """--eval_only: --model's held-out evaluation, drawn exactly as a run's step-0 evaluation,
    with the exact Q; eval.json written (lib/evalonly.py). Nothing is trained."""
    ev = evalonly.start(cfg)
    with torch.no_grad(), autocast(ev.cfg, ev.device):
        m = evaluate(ev.model, ev.tok, ev.eval_set, ev.cfg, ev.gen)
    return evalonly.finish(ev, m)


# ----------------------------------------------------------------------------
# The loop


def train(cfg: Config) -> list:
    """Evaluate, then train --steps steps (or until --time_budget), evaluating every --eval_every
    steps; returns the logged rows."""
    # Seeds, processes, data, the policy (LoRA, --grad_ckpt, FSDP), the memory plan, the run dir.
    run = harness.start(cfg)
    cfg, model, replica, tok = run.cfg, run.model, run.replica, run.tok
    # The KL's reference: a frozen copy of the starting policy.
    ref_model = make_reference(replica) if cfg.kl_coef > 0 else None
    opt = torch.optim.AdamW(trainable(model), lr=cfg.lr, weight_decay=cfg.weight_decay,
                            betas=(0.9, 0.999))
    # Two random streams: rng draws the prompts, gen_cpu the mini-batches.
    rng, gen_cpu = random.Random(cfg.seed), torch.Generator().manual_seed(cfg.seed)
    # --alloc adaptive: each training prompt's estimated Q (lib/allocation.py), checkpointed.
    estimate = (allocation.Estimate(len(run.train_set), cfg.alloc_decay)
                if cfg.alloc == "adaptive" else None)
    # With --resume, where the run left off.
    start, keep_est, q_start = run.restore(opt, ref_model, rng, gen_cpu, estimate)
    # What each eval measures beyond pass@k: the probe's Q, the exact Q, and the rest.
    diag = diagnostics.Diagnostics(cfg, run, estimate)
    # The step's sampling: sample_step_groups, or --alloc adaptive's.
    sample = allocation.sampler(estimate) if estimate else sample_step_groups
    if cfg.mass_balance:  # It also takes the kept groups' answer distributions before the update.
        sample = diagnostics.watch_sampling(sample, cfg, diag.exact_set)
    # What the instruments record after each update: the mass balance, samples.jsonl's responses.
    record = diagnostics.step_records if cfg.mass_balance or cfg.sample_groups else None

    def log_eval(step, q_start=None):
        """Held-out pass@k, then the diagnostics (the probe's Q relative to step 0's), on the
        eval's own random stream; returns the metrics and the probe's Q."""
        replica.eval()
        gen = setup.eval_generator(run.device, cfg.seed, step)
        with run.amp():
            m = evaluate(replica, tok, run.eval_set, cfg, gen)
            mq, q = diag.measure(replica, tok, gen, step, q_start)
        return {**m, **mq}, q

    if start == 0:
        m, q_start = log_eval(0)
        run.log({"step": 0, **m})
    for step in run.steps(start):  # None after the step that spends --time_budget.
        with run.clock:  # Training time: evaluations and checkpoints are excluded.
            try:
                m = {"step": step, **rl_step(model, replica, ref_model, opt, tok, cfg,
                                             run.train_set, rng, step, gen_cpu, keep_est, sample,
                                             record)}
            except FloatingPointError as e:
                # The bad mini-batch was not applied: stop before training on it.
                fail(f"step {step}: {e}")
            # Dynamic sampling's expected keep rate, a moving average.
            keep_est = 0.8 * keep_est + 0.2 * m["keep_rate"]
            if ref_model is not None and step % cfg.ref_reset_every == 0:
                # ProRL resets the reference and keeps Adam's state.
                ref_model.load_state_dict(replica.state_dict())
        # Evaluate every --eval_every steps, at the last, and when the budget is spent.
        if run.eval_due(step):
            m.update(log_eval(step, q_start)[0])
        # The log line and metrics.jsonl; at an eval, also metrics.png and the checkpoint.
        run.log(m, keep_est, q_start)
    return run.finish()


if __name__ == "__main__":
    cfg = parse_config()
    if cfg.plan:
        plan.plan(cfg)  # the memory plan, loading no weights
    elif cfg.eval_only:
        eval_only(cfg)  # eval.json of --model
    else:
        train(cfg)
