"""
brorl: BroRL (arXiv 2510.01180) in one file. RL with verifiable rewards, scaled along the
*breadth* axis: hundreds of rollouts per prompt instead of more steps.

One step, as implemented (docs/paper.md §2 is the ProRL v2 recipe that BroRL keeps):
  1. rollout     sample N completions for each prompt (sampler.py): each prompt is prefilled ONCE,
                 and its N rollouts decode against that one copy of its keys and values.
  2. reward      the verifier (verify.py): 1 correct, 0 otherwise; on math, its rules or
                 Math-Verify (--verifier).
  3. dynamic     drop the groups whose N rewards are all equal (no signal) and keep sampling new
     sampling    prompts until B groups survive, or until a cap on rounds (then fewer; with none,
                 no update). --alloc adaptive instead draws B prompts once and splits R rollouts
                 among them by each one's estimated Q (lib/allocation.py).
  4. advantages  REINFORCE++-baseline: r - mean_group(r), whitened over the batch's valid response
                 tokens (as verl); or over responses, or GRPO's / std_group, or nothing more
                 (Dr. GRPO).
  5. update      PPO-clip with decoupled bounds (clip-higher, 0.2 / 0.28) and dual-clip (c = 3),
                 token-level mean over the mini-batch's response tokens, truncated importance
                 sampling for the sampler/trainer drift, optional k2 KL to a periodically reset
                 reference, a fixed number of mini-batch updates, AdamW, gradient clipping (or the
                 alternatives of lib/objectives.py). Every log-prob comes from kernels.py: the
                 update's by kernels.linear_logprobs (from hidden states, the logits never whole;
                 a head that is not a plain linear layer: kernels.token_logprobs on its logits),
                 the sampler's by kernels.token_logprobs on each decoded position's logits.
  6. eval/log    held-out pass@1 (temperature 0.6, top_p 0.95, and greedy) and unbiased pass@k;
                 the correct mass Q(x) (Theorem 1's Q_pos, per prompt: docs/paper.md §3), sampled
                 on a probe set and exact where the answer is one token sequence
                 (lib/diagnostics.py); one log line per step, metrics.jsonl and metrics.png; a
                 checkpoint at every eval.

Where this simplifies the paper:
  1. One engine: the trainer samples its own rollouts (no vLLM server), in memory-bounded chunks.
     In float32 the sampler's log-probs serve as the old policy's (--old_logp; max|ratio-1|
     checks it); in bf16 the old log-probs are a trainer forward's, and the drift is logged and
     corrected by TIS (--tis_cap).
  2. The default is a toy: a 0.62M-parameter character-level model warm-started on right and
     wrong addition procedures (data.py); RL selects the right one, as RLVR selects among a
     model's behaviours.
  3. The learning rate is not scaled by sqrt(samples per step) automatically; set --lr.

Run:
  python brorl.py                             # the embedded tiny model and task: CPU, minutes
  python brorl.py --preset gsm8k-0.5b         # a real one-GPU job (also math-1.5b; --plan: memory)
  python brorl.py --resume runs/<run> --steps 200   # continue (or extend) a run from its checkpoint
  torchrun --standalone --nproc_per_node=K brorl.py [flags]   # the same run on K processes
  python brorl.py --help                      # every flag

Beside it: sampler.py (rollouts), kernels.py (log-probs), verify.py (rewards), data.py (tasks, the
embedded model); lib/ what a reader may skip (flags, run harness, model plumbing, planner,
processes, the eval's diagnostics); tools/ the programs run beside training. The paper, restated:
docs/paper.md. Every figure: docs/results/.
"""

import math
import random
import time
from dataclasses import dataclass

import torch

import data
import verify
from lib import (allocation, balance, config, diagnostics, distributed, evalonly, harness, samples,
                 setup, steplog)
from lib.config import fail
from lib.objectives import (aggregation, cispo_token_loss, focal_weight, gspo_token_loss,
                            max_variance_subset)
from lib.policy import (autocast, clip_gradients, make_reference, old_logprobs, pack_groups,
                        response_logprobs, trainable)
from sampler import Rollouts, draw_seeds, generate, round_seeds

# ----------------------------------------------------------------------------
# Config: the one typed source of truth. Every field is a --flag, and its comment is its --help.


@dataclass
class Config:
    # The model and the task.
    model: str = str(data.EMBEDDED_MODEL)  # HF hub id (id@revision: a branch, tag or commit) or
                                           # local dir (default: the embedded tiny model)
    task: str = "arith"  # arith or keys (embedded: data.py), or gsm8k:/math: + a
                         # .jsonl/.json/.parquet path or hub id[:config][@split]
    eval_task: str = ""  # a separate held-out source, same syntax, all its rows
                         # (default: --task's held-out split)
    eval_overlap: bool = False  # allow an --eval_task sharing prompts with the training set
                                # (else refused: not held out)
    system_prompt: str = ""  # system message before each prompt,
                             # which needs a chat template (default: none)
    digits: int = 3  # arith: digits per operand (the difficulty knob)
    dtype: str = "auto"  # compute dtype (autocast); weights and AdamW stay fp32.
                         # auto: fp32 CPU, bf16 CUDA
    device: str = "auto"  # auto = cuda if available else cpu
    seed: int = 0  # seeds prompts, sampling and init of everything random
    # Rollouts. The paper samples N = 512 rollouts for each of B = 128 prompts a step.
    n_rollouts: int = 512  # N: rollouts per prompt (paper 512; ProRL 16)
    prompts_per_step: int = 2  # B: groups kept per step after dynamic sampling (paper 128)
    max_new_tokens: int = 6  # response length cap; a truncated response gets reward 0
    temperature: float = 1.0  # rollout temperature, also used by every training log-prob
    top_p: float = 1.0  # rollout nucleus; must be 1.0 to train: the loss's log-probs are
                        # the full tempered softmax's
    max_rows: int = 4096  # most rollouts decoded at once; the planner lowers it to fit --memory_gb
    long_prompts: str = "refuse"  # prompt + new tokens past the context: refuse, drop or allow
    # Dynamic sampling, as DAPO's.
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal (zero advantage)
    max_rounds: int = 8  # rounds a step at most (then < B groups); each draws distinct prompts anew
    train_prompts: int = 0  # keys, sets (train = eval): train on the eval set's first n prompts
                            # alone (with B = n, each of them every step); 0: all
    # Breadth in sampling but not in the update (PODS, arXiv 2504.13818): the update trains on the
    # m rollouts of a group whose rewards vary most.
    train_rollouts: int = 0  # m: rollouts per group the update trains on (2 <= m <= N); 0: all N
    # Rollouts per prompt (lib/allocation.py). Uniform gives each prompt N, drawing rounds until B
    # groups survive; adaptive draws B candidates once and splits R rollouts among them by each
    # one's estimated Q, to make informative groups likely (with PODS, min(m, n) a group).
    alloc: str = "uniform"  # uniform (N a prompt) or adaptive
                            # (R a step by each prompt's Q; PODS: min(m, n))
    rollout_budget: int = 0  # R: adaptive's rollouts a step, spent exactly (0: B x N)
    min_rollouts: int = 4  # adaptive: every candidate's floor (>= 2): no prompt is dropped for good
    max_rollouts: int = 512  # adaptive: the most rollouts one prompt gets a step
    alloc_decay: float = 0.95  # adaptive: the estimate's counts x this a step (the policy moves)
    # Advantages are r - mean_group(r), then whitened (compute_advantages): over the batch's
    # response tokens with batch (verl's REINFORCE++-baseline, which ProRL v2 and BroRL run), over
    # its responses with response, or by each group's std with group (GRPO's).
    adv_norm: str = "batch"  # batch, response, group or none (r - mean_group only, no division)
    focal_gamma: float = 0.0  # F-GRPO's focal weight (arXiv 2602.06717): each group's advantages
                              # x (1 - mu)^gamma, mu its success rate; 0: off
    # The policy update.
    lr: float = 2e-4  # AdamW, constant (paper: ProRL v2's 1e-6 x sqrt(64k/8k)
                      # for a 1.5B model; 5e-4 here overshoots)
    weight_decay: float = 0.0  # AdamW weight decay (unstated in the paper)
    n_minibatches: int = 2  # optimizer updates per step; BroRL keeps this fixed as N grows
    micro_batch: int = 512  # rows per forward/backward: memory, never the gradient;
                            # lowered to fit --memory_gb
    # LoRA (peft): the optimizer and the checkpoint hold the adapter alone, and the KL's reference
    # shares the base model.
    lora_rank: int = 0  # r: train a rank-r LoRA adapter on the frozen model; 0: full fine-tuning
    lora_alpha: float = 0.0  # LoRA's scale is alpha / r; 0: alpha = 2r
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # Qwen/Llama
        # attention and MLP
    grad_ckpt: bool = False  # recompute each decoder layer in the backward: activations of one
                             # layer, not all (~1/3 more compute)
    # The old policy's log-probs are the sampler's (in fp32, a trainer forward's up to rounding) or
    # a trainer forward's.
    old_logp: str = "auto"  # sampler, recompute, or auto: sampler in float32, recompute otherwise
    # The objective (policy_token_loss). Dr. GRPO is ppo with --adv_norm none --loss_agg constant;
    # the README gives each one's command.
    loss: str = "ppo"  # ppo, gspo or cispo (policy_token_loss)
    gspo_clip_low: float = 3e-4  # GSPO's eps_low on the sequence ratio (GSPO paper,
                                 # arXiv 2507.18071: 3e-4)
    gspo_clip_high: float = 4e-4  # GSPO's eps_high (the paper: 4e-4)
    clip_low: float = 0.2  # PPO eps_low
    clip_high: float = 0.28  # PPO eps_high (clip-higher, DAPO; ProRL v1 used 0.4);
                             # CISPO's eps_high on its weight
    clip_ratio_c: float = 3.0  # dual-clip (verl; ppo only): a negative-advantage token's loss
                               # is at most -c*A; need c > 1
    # Truncated importance sampling corrects for the sampler's numerics differing from the
    # trainer's (its weight is 1 with --old_logp sampler).
    tis_cap: float = 2.0  # C: policy loss x min(exp(logp_old - logp_sampler), C)
                          # (C = 2 as verl's examples); 0: off
    # The loss's aggregation. token: the mean over the mini-batch's tokens (DAPO); sequence: each
    # row's mean, then the mean over rows (GSPO's); constant: the sum / (max_new_tokens x the
    # mini-batch's rows), a normaliser no response changes (Dr. GRPO).
    loss_agg: str = "auto"  # token, sequence or constant; auto: sequence with --loss gspo
                            # (its paper's), else token
    kl_coef: float = 0.0  # k2 KL to a reference; 0 disables it (ProRL v2 configs: 1e-4)
    ref_reset_every: int = 100  # steps between reference resets to the current policy
    grad_clip: float = 1.0  # max global grad norm
    # The math verifier: rules (verify.py), math_verify, or both, correct if either accepts
    # (the paper's).
    verifier: str = "auto"  # rules, math_verify, both;
                            # auto: both if math-verify is installed, else rules
    # The schedule, the evaluation and the output.
    steps: int = 100  # training steps (the most, with --time_budget)
    time_budget: float = 0.0  # seconds of training (evaluations excluded);
                              # stop at the first step past it (0: off)
    budget_clock: str = "wall"  # --time_budget's clock: wall, or cpu (this process's CPU time:
                                # others' load cannot inflate it)
    eval_every: int = 25  # held-out eval period in steps (also at the start and the end)
    eval_prompts: int = 64  # held-out prompts per eval
    eval_seed: int = 0  # draws the held-out problems (eval and probe),
                        # apart from --seed: every seed scores the same ones
    eval_samples: int = 32  # samples per eval prompt (pass@1 is their mean,
                            # pass@k unbiased; paper 16)
    eval_max_new_tokens: int = 0  # response length cap at eval; 0: --max_new_tokens
    probe_prompts: int = 16  # fixed held-out prompts whose correct mass Q(x) is tracked
    probe_samples: int = 512  # samples per probe prompt, whatever N is:
                              # Q(x) is measured alike across N
    mass_prompts: int = 0  # exact correct mass Q (lib/mass.py; arith, keys) at every eval of: 0 the
                           # eval set; n > 0 n train prompts
    gate_small_n: int = 16  # exact-Q zones: Q >= 1/this is high;
                            # 1/gate_large_n <= Q < 1/this is the gate; below, low
    gate_large_n: int = 512  # (the gate: N = 512 samples the right answer, N = 16 mostly not)
    # The sets task: every answer's exact probability (lib/answers.py) for the first n eval prompts
    # at every eval, Figure 3's measures for a transformer (about 0.1 CPU s a prompt on one thread).
    answer_prompts: int = 0  # n prompts; 0: off
    # The sets task, one process: each trained group's mass balance and Theorem 1's terms
    # (lib/balance.py).
    mass_balance: int = 0  # every this many steps (about 5 CPU s a measured step at B = 8); 0: off
    sample_prompts: int = 4  # held-out prompts whose responses each eval writes
                             # to samples.jsonl (lib/samples.py)
    sample_responses: int = 4  # responses kept per prompt: the eval's first, and with
                               # --sample_groups the trained ones'
    sample_groups: int = 0  # training groups a step whose responses go to samples.jsonl,
                            # with their advantages
    memory_gb: float = 0.0  # memory the planner fits into; 0: the CUDA device's less 10%,
                            # on a CPU the machine's RAM
    plan: bool = False  # print the memory plan (lib/planner.py) for these flags and exit,
                        # loading no weights
    save: bool = True  # checkpoint to <out>/ckpt at every eval:
                       # the policy (HF format) + what --resume needs
    out: str = ""  # run directory (default: runs/<task>-<time>)
    report_to: str = "none"  # also send each row to tensorboard, wandb, or tensorboard,wandb
                             # (lib/report.py)
    resume: str = ""  # run directory to continue from its checkpoint: its config.json,
                      # then the flags given
    init_from: str = ""  # a run directory (or its ckpt/): start from its policy,
                         # at step 0, in a new run directory
    init_optimizer: bool = False  # with --init_from: its AdamW moments too (lr and weight decay are
                                  # this run's); else a fresh AdamW
    preset: str = ""  # a named bundle of overrides, applied before the other flags
    eval_only: bool = False  # evaluate --model on the held-out set,
                             # write <out>/eval.json, train nothing



def parse_config(argv=None) -> Config:
    """Config from the command line (lib/config.py): a preset, then the flags given, checked; or a
    --resume."""
    return config.parse_config(Config, " ".join(__doc__.split("\n\n")[0].split()), argv)


# ----------------------------------------------------------------------------
# Rollouts: sampler.generate makes them (tokens, mask, the sampler's log-probs and entropies,
# truncation flags and texts; row i belongs to prompt i // N). With K processes each rank samples
# a share of the prompts, and every rank gets the scores of all.


def sample_share(model, tok, examples, n, temperature, top_p, cfg, seeds, max_new=None):
    """This rank's share of the prompts, n rollouts each (one int, or a list of each prompt's n:
    one sampler call either way), sampled and scored: its Rollouts (None if the share is empty),
    the share (a range into examples), and ALL prompts' rewards, lengths and truncation flags: (P,
    n) each, or, for a list, lists of P tensors (n_p,)."""
    mine = distributed.share(len(examples))
    sizes = [n] * len(examples) if isinstance(n, int) else list(n)
    # Each prompt's rewards, lengths and truncation flags, padded to the largest n.
    # (len(mine), 3, max n)
    scores = torch.zeros(len(mine), 3, max(sizes, default=0), dtype=torch.float64)
    ro = None
    if len(mine):
        ro = generate(model, tok, [examples[i]["prompt"] for i in mine],
                      n if isinstance(n, int) else sizes[mine.start: mine.stop],
                      max_new or cfg.max_new_tokens, temperature, top_p, cfg.max_rows,
                      seeds[mine.start: mine.stop], cfg.system_prompt)
        answers, task = [examples[i]["answer"] for i in mine], examples[0]["task"]
        if isinstance(n, int):
            r = score(ro, answers, task, cfg.verifier, tok)  # (len(mine), n) this rank's rewards
            scores = torch.stack([r, ro.mask.sum(1).view(-1, n), ro.truncated.view(-1, n)],
                                 1).double()
        else:  # one prompt at a time: score() takes one n
            for j, answer in enumerate(answers):
                g = ro.group(j)  # its n_j rollouts
                r = score(g, [answer], task, cfg.verifier, tok)[0]  # (n_j,)
                scores[j, :, : g.n] = torch.stack([r, g.mask.sum(1), g.truncated]).double()
    r, lengths, truncated = distributed.gather(scores).unbind(1)  # (len(examples), max n) each
    if isinstance(n, int):
        return ro, mine, r.float(), lengths, truncated
    # Each prompt's own n: P tensors (n_p,) each.
    r, lengths, truncated = ([x[i, :k] for i, k in enumerate(sizes)]
                             for x in (r.float(), lengths, truncated))
    return ro, mine, r, lengths, truncated


# ----------------------------------------------------------------------------
# Reward and dynamic sampling


def score(rollouts: Rollouts, answers, task: str, verifier: str = "rules",
          tok=None) -> torch.Tensor:
    """Rewards (B, N): the verifier on each response; a truncated one scores 0. A response is scored
    with the <think> its prompt opened (R1-Distill's template ends with one), so that an unfinished
    think block does not count."""
    prompts = [tok.decode(ids) if tok is not None else "" for ids in rollouts.prompt_ids]
    # Whether each prompt leaves a think block open. (B,)
    opened = ["<think>" if p.rfind("<think>") > p.rfind("</think>") else "" for p in prompts]
    texts = [opened[i // rollouts.n] + t for i, t in enumerate(rollouts.texts)]
    golds = [a for a in answers for _ in range(rollouts.n)]
    # Each response's verdict; a truncated response's is then set to 0. (B*N,)
    r = torch.tensor(verify.rewards(texts, golds, task=task, verifier=verifier),
                     dtype=torch.float32)
    r[rollouts.truncated] = 0.0
    return r.view(-1, rollouts.n)


@dataclass
class Group:
    """A prompt's group: its rewards and lengths (on every rank), and its rollouts at `index` (only
    on the rank that sampled it)."""
    rewards: torch.Tensor  # (N,) one per rollout
    lengths: torch.Tensor  # (N,) valid tokens per response
    rollouts: Rollouts = None
    index: int = None
    example: dict = None  # its prompt (the mass balance's)


def sample_groups(model, tok, cfg, batch, n, seeds) -> tuple:
    """n rollouts of each prompt of batch (one int, or a list of each prompt's n) at the training
    temperature, this rank's share sampled, all scored: a Group for each prompt, and all the
    rewards and lengths, (P, n) or lists of P tensors (n_p,)."""
    ro, mine, r, lengths, _ = sample_share(model, tok, batch, n, cfg.temperature, cfg.top_p, cfg,
                                           seeds)
    # Groups of unequal n each hold their own rollouts (index 0), so that a group's rows are
    # always found at g * n + j.
    own = (lambda g: (ro, g - mine.start)) if isinstance(n, int) else (
        lambda g: (ro.group(g - mine.start), 0))
    groups = [Group(r[g], lengths[g], *(own(g) if g in mine else ()), example=batch[g])
              for g in range(len(batch))]
    return groups, r, lengths


def sample_step_groups(model, tok, cfg, train_set, rng, step, keep_est):
    """Sample groups until B survive dynamic sampling (or max_rounds hits): at most B kept Groups,
    and the statistics. Every rank draws the same prompts and sees every group's rewards, so all
    keep the same groups."""
    B, N = cfg.prompts_per_step, cfg.n_rollouts
    kept, stats = [], dict(groups_generated=0, groups_survived=0, rounds=0, rewards=[], tokens=0)
    while len(kept) < B and stats["rounds"] < cfg.max_rounds:
        # Ask for enough prompts to fill B at the keep rate seen so far (this step's, else recent
        # steps'), at most 4B a round. Without dynamic sampling every group is kept, so exactly
        # the B needed are drawn.
        rate = (stats["groups_survived"] / stats["groups_generated"] if stats["groups_generated"]
                else keep_est)
        want = (min(math.ceil((B - len(kept)) / max(rate, 0.1)), 4 * B) if cfg.dynamic_sampling
                else B - len(kept))
        want = min(want, len(train_set))  # A round's prompts are distinct: at most the whole set.
        batch = rng.sample(train_set, want)  # the same prompts on every rank
        seeds = round_seeds(cfg.seed, step, stats["rounds"], want)
        groups, r, lengths = sample_groups(model, tok, cfg, batch, N, seeds)  # (want, N) each
        stats["rounds"] += 1
        stats["groups_generated"] += want
        stats["tokens"] += int(lengths.sum())
        stats["rewards"].append(r)
        steplog.note_sampled_right(stats, cfg.task, groups)  # (keys, sets: the prompts right)
        informative = [x for x in groups if x.rewards.min() != x.rewards.max()]
        kept += informative if cfg.dynamic_sampling else groups
        stats["groups_survived"] = len(kept)
    kept = kept[:B]  # DAPO keeps exactly B, so the last round's extra survivors are dropped.
    stats["groups_kept"] = len(kept)
    return kept, stats


# ----------------------------------------------------------------------------
# Advantages


def compute_advantages(rewards: torch.Tensor, norm: str = "batch", lengths=None,
                       focal_gamma: float = 0.0) -> torch.Tensor:
    """rewards (G, N), lengths (G, N) valid tokens per response -> advantages (G, N), one per
    response. r - mean_group(r), then
      batch:    whitened over all valid response tokens of the batch (verl's masked whitening, as
                ProRL v2 and BroRL): each response counts once per token, so with the token-mean
                loss the advantages sum to 0 over tokens whatever the lengths. Unbiased variance,
                eps 1e-8 inside the sqrt.
      response: over responses; group: GRPO's / (std_group + 1e-6); none: nothing more (Dr. GRPO,
                2503.20783).
    An all-equal group (only with --dynamic_sampling 0) is centred to 0, then whitened with the
    rest, as verl: -mean/std for all its rows, which keeps the zero token-sum exact (group, none: it
    stays 0). Groups of unequal N (--alloc adaptive): rewards and lengths as lists of G tensors
    (n_j,): each group centred on its own mean (group: its own std), the batch's whitening over all
    valid tokens (or responses) of all groups, each response weighted by its length as before; a
    list back. focal_gamma > 0: each group's advantages then x (1 - mu)^gamma (F-GRPO's focal
    weight, lib/objectives.py), mu its success rate."""
    if norm == "batch" and lengths is None:
        raise ValueError("adv_norm batch whitens over tokens: pass the responses' lengths")
    if focal_gamma:
        adv = compute_advantages(rewards, norm, lengths)
        if isinstance(rewards, list):
            return [a * focal_weight(r[None], focal_gamma)[0] for a, r in zip(adv, rewards)]
        return adv * focal_weight(rewards, focal_gamma)  # (G, N) x (G, 1)
    if isinstance(rewards, list):
        return compute_ragged_advantages(rewards, norm, lengths)
    centred = rewards - rewards.mean(1, keepdim=True)  # (G, N)
    if norm == "group":
        return centred / (rewards.std(1, keepdim=True) + 1e-6)
    if norm == "none":
        return centred
    # Whitened over the whole batch: with K processes every rank holds all groups' rewards and
    # lengths. Each response weighs its valid tokens (batch) or 1 (response). (G, N)
    return whiten(centred, lengths if norm == "batch" else torch.ones_like(centred))


def compute_ragged_advantages(rewards: list, norm: str, lengths: list) -> list:
    """compute_advantages for G groups of unequal N, each (n_j,): the same arithmetic on the flat
    (sum n_j,) rollouts, so that equal n_j give the rectangular path's numbers."""
    if norm == "group":
        return [(r - r.mean()) / (r.std() + 1e-6) for r in rewards]
    centred = torch.cat([r - r.mean() for r in rewards])  # (sum n_j,)
    if norm in ("batch", "response"):
        centred = whiten(centred, torch.cat(lengths) if norm == "batch"
                         else torch.ones_like(centred))  # (sum n_j,)
    return list(centred.split([len(r) for r in rewards]))


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
# Policy update: the loss per token (r, T) of r response rows, its normaliser, and the loop
# over mini-batches.


def loss_weights(mask: torch.Tensor, agg: str, n_tokens=None, n_rows=None, max_len=None,
                 dtype=torch.float32):
    """Per-token weights (r, T) in the loss's dtype, from the mini-batch's counts (n_tokens valid
    tokens, n_rows rows): each row's weights are its own, so any micro-batching gives the same
    gradient. token: 1 / n_tokens (DAPO, ProRL v2); sequence: 1 / (row length * n_rows) (GSPO's);
    constant: 1 / (max_len * n_rows), Dr. GRPO's, so that no response's length scales its own
    tokens' gradient. Counts default to the rows given (with K processes: the mini-batch's over all
    ranks)."""
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
    gradient there; CISPO: the weight truncated, the gradient kept). Dual-clip is PPO's alone
    (verl): the others' bounds cap it."""
    a = adv[:, None]  # (r, 1)
    if cfg.loss == "cispo":
        loss, ratio = cispo_token_loss(logp, old_logp, adv, cfg.clip_high)
        return loss, ratio, ratio > 1 + cfg.clip_high
    if cfg.loss == "gspo":
        lo, hi = cfg.gspo_clip_low, cfg.gspo_clip_high
        loss, ratio = gspo_token_loss(logp, old_logp, adv, mask, lo, hi)
    else:
        lo, hi = cfg.clip_low, cfg.clip_high
        loss, ratio = ppo_token_loss(logp, old_logp, adv, lo, hi, cfg.clip_ratio_c)
    clipped = ((ratio > 1 + hi) & (a > 0)) | ((ratio < 1 - lo) & (a < 0))  # (r, T)
    # Under PPO, dual-clip also binds where a negative advantage's ratio passes c.
    return loss, ratio, clipped | ((ratio > cfg.clip_ratio_c) & (a < 0) & (cfg.loss == "ppo"))


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


def update_policy(model, ref_model, opt, batch, adv, cfg, gen_cpu):
    """n_minibatches optimizer steps over the step's R = G*m rows, each on a mini-batch's summed
    token_loss; the metrics. batch: this rank's rows (K = 1: all), ["lengths"] (G, m) all rows'
    valid tokens; adv (r,): its rows'."""
    dev = adv.device
    # All ranks' R rows (G*m, or sum m_j), which of them this rank holds, and their valid tokens.
    layout = distributed.RowLayout(batch["lengths"], cfg.micro_batch, dev)
    R = len(layout)
    sampler_logp, valid = batch["sampler_logp"], batch["resp_mask"]  # (r, T) each
    agg = aggregation(cfg.loss, cfg.loss_agg)
    # Before any update: the old policy's log-probs and entropies (the sampler's or a forward's),
    # and the reference's log-probs. (r, T) each
    old_logp, ent, ref_logp = old_logprobs(model, ref_model, batch,
                                           layout.mine(torch.arange(R)), cfg, dev)
    # The sampler/trainer drift: how far the policy that drew the tokens is from the loss's old
    # policy. It is 0 by construction with the sampler's log-probs, and then the first
    # mini-batch's max|ratio-1| measures it instead. (valid tokens,)
    drift = (torch.exp(old_logp - sampler_logp) - 1).abs()[valid]
    # Sums over tokens, then two maxima.
    sums = dict(entropy=ent[valid].sum().item(), drift_mean=drift.sum().item(),
                clip_frac=0.0, kl=0.0,
                drift_max=drift.max().item() if len(drift) else 0.0, max_ratio_dev=0.0)
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
            w = loss_weights(mask, agg, *layout.counts(mb), cfg.max_new_tokens, logp.dtype)
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
    total = distributed.reduce(sums, maxes=("drift_max", "max_ratio_dev"))  # over all ranks' rows
    # The per-token metrics divide by all ranks' valid tokens, each token counted once.
    n_tok = max(layout.tokens.sum().item(), 1)
    per_token = ("entropy", "drift_mean", "clip_frac", "kl")
    return {**{k: v / n_tok if k in per_token else v for k, v in total.items()},
            "grad_norm": grad_norm}


# ----------------------------------------------------------------------------
# One step


def rl_step(model, replica, ref_model, opt, tok, cfg, train_set, rng, step, gen_cpu, keep_est,
            followed=(), estimate=None) -> dict:
    """rollout -> reward -> dynamic sampling -> advantages -> policy update; returns the metrics.
    replica: the policy's full weights, for the rollouts (the policy itself when K = 1).
    followed: with --mass_balance, the prompts whose Q is followed when not trained.
    estimate: --alloc adaptive's per-prompt Q (lib/allocation.py), updated here."""
    replica.eval()
    t0 = time.perf_counter()
    # No weight changes while sampling, so the autocast region's cache stays valid.
    with autocast(cfg, replica.device):
        if estimate is None:
            kept, stats = sample_step_groups(replica, tok, cfg, train_set, rng, step, keep_est)
        else:  # --alloc adaptive: one round, its R rollouts split by each prompt's estimated Q.
            sample = lambda batch, n, seeds: sample_groups(replica, tok, cfg, batch, n, seeds)
            kept, stats = allocation.sample_allocated_groups(sample, cfg, train_set, rng, step,
                                                             estimate)
    t_roll = time.perf_counter() - t0
    upd = {}
    if kept:  # Else every group was all right or all wrong: nothing to learn from this step.
        # --train_rollouts m (PODS): the update trains on m rows of each group and takes the
        # advantages over those m; m = N is exactly the run without it.
        trains_on = lambda n: min(cfg.train_rollouts or n, n)  # a group of n rollouts trains on m
        if len({len(k.rewards) for k in kept}) == 1:  # One N, as always with --alloc uniform.
            all_rewards = torch.stack([k.rewards for k in kept])  # (G, N), every rank has all
            chosen = max_variance_subset(all_rewards, trains_on(all_rewards.shape[1]))  # (G, m)
            rewards = all_rewards.gather(1, chosen)  # (G, m)
            # Each chosen response's valid tokens. (G, m)
            lengths = torch.stack([k.lengths for k in kept]).gather(1, chosen)
        else:
            # Groups of unequal N (--alloc adaptive): lists of G tensors, (m_j,) each.
            chosen = [max_variance_subset(k.rewards[None], trains_on(len(k.rewards)))[0]
                      for k in kept]
            rewards = [k.rewards[i] for k, i in zip(kept, chosen)]  # G tensors (m_j,)
            lengths = [k.lengths[i] for k, i in zip(kept, chosen)]  # G tensors (m_j,) valid tokens
            all_rewards = torch.cat([k.rewards for k in kept])  # (all kept rollouts,)
        # (G, m), or G tensors (m_j,)
        adv = compute_advantages(rewards, cfg.adv_norm, lengths, cfg.focal_gamma)
        # Each kept group moves to the rank that trains it (K = 1: all stay here); this rank's
        # groups become one batch, which carries every rank's lengths.
        groups = distributed.balance([k.rollouts.group(k.index, chosen[j])
                                      if k.rollouts is not None else None
                                      for j, k in enumerate(kept)])
        my_groups = [j for j, x in enumerate(groups) if x is not None]
        batch = dict(pack_groups([groups[j] for j in my_groups], model.device), lengths=lengths)
        # On --mass_balance's steps, the answer distributions before the update (lib/balance.py).
        balanced = cfg.mass_balance and step % cfg.mass_balance == 0
        before = balance.Snapshot(replica, tok, cfg, kept, followed) if balanced else None
        model.train()
        # The advantages of this rank's rows. (its rows,)
        my_adv = torch.cat([adv[j].flatten() for j in my_groups] or [torch.zeros(0)])
        upd = update_policy(model, ref_model, opt, batch, my_adv.to(model.device), cfg, gen_cpu)
        distributed.refresh(model, replica)  # The replica follows the update: one gather a step.
        if balanced:  # And after it: the four parts' mass, Theorem 1's terms, the others' Q.
            replica.eval()
            after = balance.Snapshot(replica, tok, cfg, kept, followed)
            upd.update(balance.records(before, after, kept, chosen))
        # The rewards of the rows trained on, against all N of the kept groups. (G, m) or (sum m_j,)
        trained = rewards if torch.is_tensor(rewards) else torch.cat(rewards)
        upd.update(reward_kept=all_rewards.mean().item(), reward_trained=trained.mean().item())
        # The trained groups' responses go to samples.jsonl, not to metrics.jsonl.
        upd["train_responses"] = samples.group_records(kept, chosen, adv, tok, cfg)
    return steplog.step_metrics(stats, t_roll, time.perf_counter() - t0 - t_roll, upd)


# ----------------------------------------------------------------------------
# Evaluation: pass@k on the held-out set. The diagnostics that follow it (the probe's Q, the exact
# Q, the answer distributions) are lib/diagnostics.py's.


def evaluate(model, tok, examples, cfg, gen) -> dict:
    """Held-out pass@1 and pass@k at the paper's eval sampling (T=0.6, top_p=0.95), and greedy.
    pass@k is the unbiased 1 - C(n-c, k) / C(n, k) from n samples (data.pass_at_k), for k = 1, 2,
    4, ... and n itself; the sampled responses' mean length and truncated share; the first few of
    them (samples.jsonl)."""
    n, max_new = cfg.eval_samples, cfg.eval_max_new_tokens or cfg.max_new_tokens
    seeds = draw_seeds(gen, len(examples))  # the same seeds on every rank
    # Each prompt's n samples scored. (P, n) each
    ro, mine, correct, lengths, truncated = sample_share(model, tok, examples, n, 0.6, 0.95, cfg,
                                                         seeds, max_new)
    # The rollouts are freed before the greedy pass.
    responses, ro = samples.eval_records(examples, ro, mine, correct, lengths, truncated, cfg), None
    greedy = sample_share(model, tok, examples, 1, 0.0, 1.0, cfg, seeds, max_new)[2]  # (P, 1)
    ks = sorted({2 ** i for i in range(int(math.log2(n)) + 1)} | {n})
    m = {"eval_pass@1": correct.mean().item(), "eval_greedy_pass@1": greedy.mean().item()}
    for k in ks[1:]:
        m[f"eval_pass@{k}"] = sum(data.pass_at_k(n, int(c), k)
                                  for c in correct.sum(1)) / len(examples)
    m["eval_pass@k"] = m[f"eval_pass@{n}"]  # k = --eval_samples
    # Each held-out problem's correct samples of n, for paired tests between runs.
    m["eval_correct"] = [int(c) for c in correct.sum(1)]
    # The mean response length in tokens, and the share cut at the length cap.
    m.update(eval_resp_len=lengths.mean().item(), eval_truncated=truncated.mean().item())
    # The first few responses go to samples.jsonl (harness.Run.log), not to metrics.jsonl.
    m["eval_responses"] = responses
    return m


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

    def log_eval(step, q_start=None):
        """Held-out pass@k, then the diagnostics (the probe's Q relative to step 0's), on the
        eval's own random stream; returns the metrics and the probe's Q."""
        replica.eval()
        gen = setup.eval_generator(run.device, cfg.seed, step)
        with run.amp():
            m = evaluate(replica, tok, run.eval_set, cfg, gen)
            mq, q = diag.measure(replica, tok, gen, sample_share, step, q_start)
        return {**m, **mq}, q

    if start == 0:
        m, q_start = log_eval(0)
        run.log({"step": 0, **m})
    for step in run.steps(start):  # None after the step that spends --time_budget.
        with run.clock:  # Training time: evaluations and checkpoints are excluded.
            try:
                m = {"step": step, **rl_step(model, replica, ref_model, opt, tok, cfg,
                                             run.train_set, rng, step, gen_cpu, keep_est,
                                             diag.exact_set, estimate)}
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
        setup.plan(cfg)  # the memory plan, loading no weights
    elif cfg.eval_only:
        evalonly.eval_only(cfg, evaluate)  # eval.json of --model
    else:
        train(cfg)
