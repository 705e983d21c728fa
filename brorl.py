"""
brorl: BroRL (arXiv 2510.01180) in one file. RL with verifiable rewards, scaled along the
*breadth* axis: hundreds of rollouts per prompt instead of more steps.

One step, as implemented (docs/paper.md §2 is the ProRL v2 recipe that BroRL keeps):
  1. rollout     sample N completions for each prompt (sampler.py). Each prompt is prefilled
                 ONCE; its N rollouts decode against that single copy of its keys/values (cascade
                 attention: the shared prefix read by one batched matmul for all N rows, each
                 rollout's own tokens separately, one exact softmax over both).
  2. reward      verifier (verify.py): 1 correct, 0 otherwise; on math, the rules or Math-Verify (--verifier).
  3. dynamic     drop groups whose N rewards are all equal (no signal) and keep sampling new
     sampling    prompts until B groups survive, or a cap on rounds is hit (then fewer:
                 metrics.jsonl records groups_kept and sample_rounds).
  4. advantages  REINFORCE++-baseline: r - mean_group(r), then whitened over the batch's valid
                 response tokens (default, as verl); or over responses; or GRPO's / std_group; or
                 nothing more (Dr. GRPO). --train_rollouts m: each group trains on the m of its N
                 rollouts whose rewards vary most (PODS), its advantages over those m.
  5. update      PPO-clip with decoupled bounds (clip-higher, 0.2 / 0.28) and dual-clip (c = 3),
                 token-level mean over the mini-batch's response tokens, truncated importance
                 sampling for the sampler/trainer drift, optional k2 KL to a periodically reset
                 reference, a fixed number of mini-batch updates, AdamW, gradient clipping. Or
                 --loss gspo (one clipped ratio per sequence) or cispo (a clipped, detached weight on
                 every token's gradient); --lora_rank r trains a LoRA adapter alone (policy.py, peft).
                 Every log-prob (old, reference, current) goes through the one log-prob kernel
                 (kernels.linear_logprobs: from hidden states, the logits never whole).
  6. eval/log    held-out pass@1 (temperature 0.6, top_p 0.95, and greedy) and unbiased pass@k,
                 drawn from the evaluation's own random stream (it never moves the training's);
                 the correct mass Q(x) of a fixed probe set (per prompt, an analogy to Theorem 1's
                 Q_pos: docs/paper.md §3); one log line per step, metrics.jsonl and metrics.png in --out; a
                 checkpoint at every eval, from which --resume continues the run exactly.

Where this simplifies the paper:
  1. One engine: the trainer samples its own rollouts (on one device, or on K data-parallel
     processes with torchrun: distributed.py). In float32 the
     sampler's log-probs serve as the old policy's (--old_logp; no second forward; max|ratio-1| of
     the first mini-batch checks it: 0 up to rounding). In bf16 the old log-probs are a trainer
     forward, whose rounding differs from the decode's: that drift is logged (drift_max) and
     corrected by truncated importance sampling (--tis_cap), as the paper does for vLLM.
  2. The default is a toy: a 0.62M-parameter character-level model warm-started on a mixture
     of right and systematically wrong addition procedures (data.py). RL has to select the right
     one, as RLVR selects among behaviours a real model already has.
  3. Rollouts of a step are sampled in memory-bounded chunks of prompts, not by a server.
  4. The learning rate is not scaled by sqrt(samples per step) automatically; set --lr.

Run:
  python brorl.py                              # embedded tiny model + task, CPU, a few minutes
  python brorl.py --preset hard                # the correct procedure is rare (~3% of samples)
  python brorl.py --preset math-1.5b           # a real one-GPU job (also gsm8k-0.5b; paper: many GPUs)
  python brorl.py --preset math-1.5b --plan    # its memory plan and time estimate, no weights loaded
  python brorl.py --task gsm8k:openai/gsm8k:main --eval_task math:HuggingFaceH4/MATH-500@test ...
  python brorl.py --eval_only --model runs/<run> --task math:aime.jsonl --eval_samples 16  # eval.json
  python brorl.py --resume runs/<run> --steps 200   # continue (or extend) a run from its checkpoint
  python brorl.py --init_from runs/<run> --lr 1e-4 # a new run from its checkpoint's policy (fresh AdamW; or --init_optimizer)
  python brorl.py --time_budget 20 --budget_clock cpu --steps 100000   # stop after 20 s of this process's CPU
  torchrun --standalone --nproc_per_node=K brorl.py [flags]   # the same run on K processes (distributed.py)
  python brorl.py --help                       # every flag

The rest of the house: sampler.py (rollouts), kernels.py (log-probs), verify.py (rewards), data.py
(tasks and the embedded model; tasks.py reads real datasets by schema), harness.py (command line,
run directory, checkpoints, plots, the --eval_only report), policy.py (the model: loading, dtype and
autocast, the update's forward plumbing), planner.py (memory: --plan, the fitted max_rows and
micro_batch), distributed.py (K processes: who samples what, the reductions, FSDP2); on top of this file, ablate.py (sweeps of runs over flags and seeds)
and bench.py (speed).
The paper, restated: docs/paper.md. Every measured figure, with its command: NOTES.md.
"""

import dataclasses
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

import data
from lib import distributed
from lib import harness
from lib import planner
import verify
from lib.policy import (ReplayCache, add_lora, as_reference, autocast, compute_dtype, enable_grad_ckpt, is_lora, load_policy,
                    make_reference, plain_head, split_revision, trainable)
from lib.harness import fail, log_line, make_run_dir, open_metrics, plot_metrics, read_metrics, save_atomic
from kernels import linear_logprobs, token_logprobs
from sampler import Rollouts, cache_kwarg, draw_seeds, generate  # importing it registers attn_implementation="brorl"

# ----------------------------------------------------------------------------
# Config: one typed source of truth; every field is a --flag, its comment is the --help


@dataclass
class Config:
    # model and task
    model: str = str(data.EMBEDDED_MODEL)  # HF hub id (id@revision: a branch, tag or commit) or local dir (default: the embedded tiny model)
    task: str = "arith"  # arith (embedded), or gsm8k:/math: + a .jsonl/.json/.parquet path or hub id[:config][@split]
    eval_task: str = ""  # a separate held-out source, same syntax (all its rows); default: --task's held-out split
    system_prompt: str = ""  # system message before each prompt (needs a chat template; default: none)
    digits: int = 3  # arith: digits per operand (the difficulty knob)
    dtype: str = "auto"  # compute dtype (autocast); weights and AdamW stay fp32. auto: fp32 CPU, bf16 CUDA
    device: str = "auto"  # auto = cuda if available else cpu
    seed: int = 0  # seeds prompts, sampling and init of everything random
    # rollout (paper: N=512 rollouts, B=128 prompts per step)
    n_rollouts: int = 512  # N: rollouts per prompt (paper 512; ProRL 16)
    prompts_per_step: int = 2  # B: groups kept per step after dynamic sampling (paper 128)
    max_new_tokens: int = 6  # response length cap; a truncated response gets reward 0
    temperature: float = 1.0  # rollout temperature, also used by every training log-prob
    top_p: float = 1.0  # rollout nucleus; must be 1.0 to train: the loss's log-probs are the full tempered softmax's
    max_rows: int = 4096  # most rollouts decoded at once; the planner lowers it to fit --memory_gb
    # dynamic sampling (DAPO)
    dynamic_sampling: bool = True  # drop groups whose rewards are all equal (zero advantage)
    max_rounds: int = 8  # cap on sampling rounds per step; fewer than B groups are used if hit
    # breadth in sampling without breadth in the update (PODS, arXiv 2504.13818): each kept group trains on the
    # m of its N rollouts whose rewards vary most, its advantages taken over those m
    train_rollouts: int = 0  # m: rollouts per group the update trains on (2 <= m <= N); 0: all N
    # advantages
    # r - mean_group(r), then whitened (compute_advantages); verl's REINFORCE++-baseline, which ProRL v2 and BroRL
    # run, whitens over tokens
    # batch: over the batch's response tokens (the paper); response: over responses; group: GRPO; none: Dr. GRPO
    adv_norm: str = "batch"  # batch, response, group or none (r - mean_group only, no division)
    # policy update
    lr: float = 2e-4  # AdamW, constant (paper: ProRL v2's 1e-6 x sqrt(64k/8k) for a 1.5B model; 5e-4 here overshoots)
    weight_decay: float = 0.0  # AdamW weight decay (unstated in the paper)
    n_minibatches: int = 2  # optimizer updates per step; BroRL keeps this fixed as N grows
    micro_batch: int = 512  # rows per forward/backward: memory, never the gradient; lowered to fit --memory_gb
    # LoRA (peft, needed only then): the optimizer, its state and the checkpoint hold the adapter alone; the KL's
    # reference shares the frozen base weights (policy.py)
    lora_rank: int = 0  # r: train a rank-r LoRA adapter on the frozen model; 0: full fine-tuning
    lora_alpha: float = 0.0  # LoRA's scale is alpha / r; 0: alpha = 2r
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # Qwen/Llama attention and MLP
    grad_ckpt: bool = False  # recompute each decoder layer in the backward: activations of one layer, not all (~1/3 more compute)
    # The old policy's log-probs: the sampler's own (same weights: in fp32 they agree with a trainer forward up
    # to rounding; saves a forward over every row) or a trainer forward (the paper's setup, needed in bf16)
    old_logp: str = "auto"  # sampler, recompute, or auto: sampler in float32, recompute otherwise
    # the objective: PPO-clip per token (the paper's), GSPO (one clipped ratio per sequence), CISPO (a clipped,
    # detached weight on every token's REINFORCE gradient); Dr. GRPO is ppo + --adv_norm none --loss_agg constant
    loss: str = "ppo"  # ppo, gspo or cispo (policy_token_loss)
    gspo_clip_low: float = 3e-4  # GSPO's eps_low on the sequence ratio (GSPO paper, arXiv 2507.18071: 3e-4)
    gspo_clip_high: float = 4e-4  # GSPO's eps_high (the paper: 4e-4)
    clip_low: float = 0.2  # PPO eps_low
    clip_high: float = 0.28  # PPO eps_high (clip-higher, DAPO; ProRL v1 used 0.4); CISPO's eps_high on its weight
    clip_ratio_c: float = 3.0  # dual-clip (verl; ppo only): a negative-advantage token's loss is at most -c*A; need c > 1
    # truncated importance sampling corrects for the sampler's numerics differing from the trainer's; its weight
    # is exactly 1 when the old log-probs ARE the sampler's (--old_logp sampler)
    tis_cap: float = 2.0  # C: policy loss x min(exp(logp_old - logp_sampler), C) (C = 2 as verl's examples); 0: off
    # token: mean over the mini-batch's tokens (DAPO); sequence: per-row mean, then over rows (GSPO's);
    # constant: the sum / (max_new_tokens x the mini-batch's rows), a normaliser no response changes (Dr. GRPO)
    loss_agg: str = "token"  # token, sequence or constant
    kl_coef: float = 0.0  # k2 KL to a reference; 0 disables it (ProRL v2 configs: 1e-4)
    ref_reset_every: int = 100  # steps between reference resets to the current policy
    grad_clip: float = 1.0  # max global grad norm
    # math tasks: rules (verify.py), math_verify, or both = correct if either accepts (the paper's)
    verifier: str = "auto"  # rules, math_verify, both; auto: both if math-verify is installed, else rules
    # schedule, eval, output
    steps: int = 100  # training steps (the most, with --time_budget)
    time_budget: float = 0.0  # seconds of training (evaluations excluded); stop at the first step past it (0: off)
    budget_clock: str = "wall"  # --time_budget's clock: wall, or cpu (this process's CPU time: others' load cannot inflate it)
    eval_every: int = 25  # held-out eval period in steps (also at the start and the end)
    eval_prompts: int = 64  # held-out prompts per eval
    eval_seed: int = 0  # draws the held-out problems (eval and probe), apart from --seed: every seed scores the same ones
    eval_samples: int = 32  # samples per eval prompt (pass@1 is their mean, pass@k unbiased; paper 16)
    eval_max_new_tokens: int = 0  # response length cap at eval; 0: --max_new_tokens
    probe_prompts: int = 16  # fixed held-out prompts whose correct mass Q(x) is tracked
    probe_samples: int = 512  # samples per probe prompt, whatever N is: Q(x) is measured alike across N
    memory_gb: float = 0.0  # memory the planner fits into; 0: the CUDA device's less 10%, on a CPU the machine's RAM
    plan: bool = False  # print the memory plan (planner.py) for these flags and exit, loading no weights
    save: bool = True  # checkpoint to <out>/ckpt at every eval: the policy (HF format) + what --resume needs
    out: str = ""  # run directory (default: runs/<task>-<time>)
    resume: str = ""  # run directory to continue from its checkpoint: its config.json, then the flags given
    init_from: str = ""  # a run directory (or its ckpt/): start from its policy, at step 0, in a new run directory
    init_optimizer: bool = False  # with --init_from: its AdamW moments too (lr and weight decay are this run's); else a fresh AdamW
    preset: str = ""  # a named bundle of overrides, applied before the other flags
    eval_only: bool = False  # evaluate --model on the held-out set, write <out>/eval.json, train nothing


# Presets are named bundles of overrides, never a second source of defaults.
PRESETS = {
    # the correct procedure is rare in the warm start (~3% of samples): where breadth should matter
    "hard": dict(model=str(data.EMBEDDED_MODEL_HARD)),
    # One-GPU jobs (bf16 autocast on CUDA, --grad_ckpt); the planner lowers max_rows and micro_batch to
    # fit the device (`python brorl.py --preset X --plan`). Learning rates are untuned starting points.
    # A 0.5B instruct model on grade-school math
    "gsm8k-0.5b": dict(model="Qwen/Qwen2.5-0.5B-Instruct", task="gsm8k:openai/gsm8k:main", n_rollouts=256, prompts_per_step=16,
                       max_new_tokens=512, lr=1e-6, n_minibatches=4, grad_ckpt=True, steps=200, eval_every=25,
                       eval_prompts=256, eval_samples=16),
    # A 1.5B reasoning model on DeepScaleR's competition math, 4k-token responses
    "math-1.5b": dict(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", task="math:agentica-org/DeepScaleR-Preview-Dataset",
                      n_rollouts=128, prompts_per_step=8, max_new_tokens=4096, lr=2e-6, n_minibatches=4,
                      grad_ckpt=True, steps=200, eval_every=25, eval_prompts=128, eval_samples=16),
    # The paper's run (docs/paper.md §5): BroRL continues the ProRL v2 checkpoint, the hub repository
    # below at its v2 revision (pin the revision with --model id@revision; BroRL's own result is the
    # revision `brorl`), on DeepScaleR's math, 128 prompts x 512 rollouts x 16k tokens a step, on 64 GPUs. lr: ProRL v2's
    # 1e-6 (its public verl configs; the paper gives only the rule) x sqrt(65,536 / 8,192 samples a
    # step); 4 mini-batches (ProRL's 256 / 64); k2 KL 1e-4 (ProRL v2's public configs); the reference
    # reset interval is not published: 100 is ours. Evaluation as the paper's: 16 samples at T 0.6,
    # top_p 0.95 (brorl.evaluate), 32k tokens. A multi-GPU job: on one 80 GB GPU even one row's update
    # does not fit (the step's (rows, T) tensors alone are 29 GB); on 8 it fits with --grad_ckpt (--plan)
    "paper": dict(model="nvidia/Nemotron-Research-Reasoning-Qwen-1.5B", task="math:agentica-org/DeepScaleR-Preview-Dataset",
                  n_rollouts=512, prompts_per_step=128, max_new_tokens=16384, lr=1e-6 * math.sqrt(8),
                  n_minibatches=4, kl_coef=1e-4, ref_reset_every=100, grad_ckpt=True, steps=200, eval_every=25,
                  eval_prompts=256, eval_samples=16, eval_max_new_tokens=32768),
}


# Flags that --resume cannot change: the checkpoint's restored state decides them (the random streams
# drawn from --seed, the weights rather than --model, the probe's step-0 mass per held-out problem).
# The rest take effect on resume; the learning rate and weight decay too (load_optimizer sets them).
FIXED_ON_RESUME = ("seed", "model", "task", "digits", "eval_task", "eval_seed", "eval_prompts", "probe_prompts",
                   "init_from", "init_optimizer")


def parse_config(argv=None) -> Config:
    """Config from the command line (harness.py): a preset, then the flags given; or a run to --resume."""
    description = " ".join(__doc__.split("\n\n")[0].split())  # the docstring's first paragraph
    return harness.parse_config(Config, PRESETS, check_config, description, argv, FIXED_ON_RESUME)


def check_config(cfg: Config) -> str:
    """The first thing wrong with cfg, as one line naming the flag, or ''."""
    checks = [
        (cfg.n_rollouts >= 2, f"--n_rollouts {cfg.n_rollouts}: need N >= 2 (advantages compare rollouts)"),
        (cfg.prompts_per_step >= 1, f"--prompts_per_step {cfg.prompts_per_step}: need B >= 1"),
        (cfg.train_rollouts == 0 or 2 <= cfg.train_rollouts <= cfg.n_rollouts,
         f"--train_rollouts {cfg.train_rollouts}: need 2 <= m <= N = {cfg.n_rollouts} (0: all N)"),
        (cfg.max_new_tokens >= 1, f"--max_new_tokens {cfg.max_new_tokens}: need >= 1"),
        (cfg.temperature > 0, f"--temperature {cfg.temperature}: need > 0 for rollouts"),
        # a nucleus draw would need the nucleus-renormalised log-prob on both sides of the ratio (and a
        # policy gradient through the nucleus's cut); the loss uses the full softmax's: refuse, do not bias
        (cfg.top_p == 1, f"--top_p {cfg.top_p}: training needs top_p = 1 (the loss's log-probs are the full "
                         "tempered softmax's, not the nucleus's); eval samples at top_p 0.95 anyway"),
        (cfg.adv_norm in ("batch", "response", "group", "none"),
         f"--adv_norm {cfg.adv_norm!r}: choose batch, response, group or none"),
        (cfg.loss in ("ppo", "gspo", "cispo"), f"--loss {cfg.loss!r}: choose ppo, gspo or cispo"),
        (0 <= cfg.gspo_clip_low < 1 and cfg.gspo_clip_high >= 0, "--gspo_clip_low must be in [0, 1), --gspo_clip_high >= 0"),
        (cfg.clip_ratio_c > 1, f"--clip_ratio_c {cfg.clip_ratio_c}: need c > 1 (dual-clip caps the loss at -c*A)"),
        (cfg.tis_cap >= 0, f"--tis_cap {cfg.tis_cap}: need C >= 0 (0 disables)"),
        (cfg.verifier in ("auto",) + verify.VERIFIERS, f"--verifier {cfg.verifier!r}: choose auto, rules, math_verify or both"),
        (cfg.loss_agg in ("token", "sequence", "constant"), f"--loss_agg {cfg.loss_agg!r}: choose token, sequence or constant"),
        (cfg.old_logp in ("auto", "sampler", "recompute"), f"--old_logp {cfg.old_logp!r}: choose auto, sampler, recompute"),
        (cfg.n_minibatches >= 1 and cfg.micro_batch >= 1, "--n_minibatches and --micro_batch must be >= 1"),
        (cfg.max_rows >= 1, f"--max_rows {cfg.max_rows}: need >= 1"),
        (cfg.dtype in ("auto", "float32", "bfloat16"), f"--dtype {cfg.dtype!r}: choose auto, float32 or bfloat16"),
        (cfg.steps >= 0 and cfg.eval_every >= 1, "--steps must be >= 0 and --eval_every >= 1"),
        (cfg.max_rounds >= 1, f"--max_rounds {cfg.max_rounds}: need >= 1"),
        (cfg.eval_prompts >= 1 and cfg.eval_samples >= 1, "--eval_prompts and --eval_samples must be >= 1"),
        (cfg.eval_max_new_tokens >= 0, f"--eval_max_new_tokens {cfg.eval_max_new_tokens}: need >= 0"),
        (not (cfg.eval_only and cfg.resume), "--eval_only evaluates --model: give a run's ckpt dir there, not --resume"),
        (not (cfg.init_from and cfg.resume), "--init_from starts a new run from a checkpoint; --resume continues one: not both"),
        (cfg.init_from or not cfg.init_optimizer, "--init_optimizer loads the AdamW state of --init_from: name one"),
        (cfg.memory_gb >= 0, f"--memory_gb {cfg.memory_gb}: need >= 0 (0 = the device's)"),
        (cfg.probe_samples >= 1, f"--probe_samples {cfg.probe_samples}: need >= 1"),
        (cfg.lora_rank >= 0 and cfg.lora_alpha >= 0, f"--lora_rank {cfg.lora_rank}, --lora_alpha {cfg.lora_alpha}: need >= 0"),
        (cfg.lora_rank == 0 or distributed.world_size() == 1, "--lora_rank: LoRA runs on one process (not under torchrun)"),
        (cfg.time_budget >= 0, f"--time_budget {cfg.time_budget}: need >= 0 seconds (0: no budget)"),
        (cfg.budget_clock in ("wall", "cpu"), f"--budget_clock {cfg.budget_clock!r}: choose wall or cpu"),
        # each step's first round asks for at least B prompts: B / K of them, at least, on every rank
        (cfg.prompts_per_step % distributed.world_size() == 0, f"--prompts_per_step {cfg.prompts_per_step}: "
         f"must be a multiple of the {distributed.world_size()} processes (each samples its share of the prompts)"),
    ]
    return next((msg for ok, msg in checks if not ok), "")


# ----------------------------------------------------------------------------
# Rollouts: sampler.generate (sampler.py) prefills each prompt once and decodes its N rollouts
# against that one copy of its keys/values (cascade attention), returning Rollouts: tokens, mask,
# the sampler's log-probs and entropies, truncation flags and texts, row r belonging to prompt r // N.
# With K processes each samples a share of the prompts; the rewards of all come back to every rank.


def round_seeds(seed: int, step: int, rnd: int, n: int) -> list:
    """One seed per prompt of a sampling round: rollouts are a function of (seed, step, prompt) only,
    never of the process that draws them nor of how many there are."""
    stream = random.Random(f"rollouts/{seed}/{step}/{rnd}")  # a str seeds Random the same everywhere
    return [stream.getrandbits(62) for _ in range(n)]


def sample_share(model, tok, examples, n, temperature, top_p, cfg, seeds, max_new=None):
    """This rank's share of the prompts, n rollouts each, sampled and scored. Returns its Rollouts
    (None if its share is empty), the share (a range of indices into examples) and the rewards
    (len(examples), n) of ALL prompts, gathered from every rank."""
    mine = distributed.share(len(examples))
    ro, r = None, torch.zeros(0, n)
    if len(mine):
        ro = generate(model, tok, [examples[i]["prompt"] for i in mine], n, max_new or cfg.max_new_tokens,
                      temperature, top_p, cfg.max_rows, seeds[mine.start: mine.stop], cfg.system_prompt)
        r = score(ro, [examples[i]["answer"] for i in mine], examples[0]["task"], cfg.verifier, tok)  # (len(mine), n)
    return ro, mine, distributed.gather(r)


# ----------------------------------------------------------------------------
# Reward and dynamic sampling


def score(rollouts: Rollouts, answers, task: str, verifier: str = "rules", tok=None) -> torch.Tensor:
    """Rewards (B, N): the verifier on each response; a truncated response scores 0. A response is
    scored with the <think> its prompt opened (R1-Distill's template ends with "<think>\n"), so that
    an answer inside an unfinished think block does not count."""
    prompts = [tok.decode(ids) if tok is not None else "" for ids in rollouts.prompt_ids]
    opened = ["<think>" if p.rfind("<think>") > p.rfind("</think>") else "" for p in prompts]  # (B,)
    texts = [opened[i // rollouts.n] + t for i, t in enumerate(rollouts.texts)]
    golds = [a for a in answers for _ in range(rollouts.n)]
    r = torch.tensor(verify.rewards(texts, golds, task=task, verifier=verifier), dtype=torch.float32)  # (B*N,)
    r[rollouts.truncated] = 0.0
    return r.view(-1, rollouts.n)


def sample_step_groups(model, tok, cfg, train_set, rng, step, keep_est):
    """Sample groups until B survive dynamic sampling (or max_rounds hits). Returns the kept
    groups as (rollouts, group index, rewards (N,)), at most B of them, and bookkeeping. Every rank
    draws the same prompts and sees every group's rewards, so all keep the same groups; only the
    rank that sampled a group holds its rollouts (on the others, rollouts is None)."""
    B, N = cfg.prompts_per_step, cfg.n_rollouts
    kept, stats = [], dict(groups_generated=0, groups_survived=0, rounds=0, rewards=[], tokens=0)
    while len(kept) < B and stats["rounds"] < cfg.max_rounds:
        # ask for enough prompts to fill B at the keep rate seen so far (this step's, else recent steps');
        # without dynamic sampling every group is kept: exactly the B needed
        rate = stats["groups_survived"] / stats["groups_generated"] if stats["groups_generated"] else keep_est
        want = min(math.ceil((B - len(kept)) / max(rate, 0.1)), 4 * B) if cfg.dynamic_sampling else B - len(kept)
        batch = rng.sample(train_set, want)  # the same prompts on every rank
        seeds = round_seeds(cfg.seed, step, stats["rounds"], want)
        ro, mine, r = sample_share(model, tok, batch, N, cfg.temperature, cfg.top_p, cfg, seeds)  # r (want, N)
        stats["rounds"] += 1
        stats["groups_generated"] += want
        stats["tokens"] += int(distributed.all_sum(ro.mask.sum() if ro else 0))
        stats["rewards"].append(r)
        for g in range(want):
            if not cfg.dynamic_sampling or r[g].min() != r[g].max():
                kept.append((ro, g - mine.start, r[g]) if g in mine else (None, None, r[g]))
        stats["groups_survived"] = len(kept)
    kept = kept[:B]  # DAPO keeps exactly B; extra survivors of the last round are dropped
    stats["groups_kept"] = len(kept)
    return kept, stats


def balance_groups(kept) -> list:
    """The kept groups, each on the rank that trains it: an even share of them per rank (distributed.move),
    not the ranks' own survivors (which dynamic sampling and the truncation to B leave uneven). A moved
    group travels as a one-group Rollouts. K = 1: kept."""
    if distributed.world_size() == 1:
        return kept
    owner = distributed.all_sum(torch.tensor([distributed.rank() * (ro is not None) for ro, _, _ in kept]))  # (G,)
    one = [None if ro is None else one_group(ro, g) for ro, g, _ in kept]
    moved = distributed.move(one, owner.long().tolist())
    return [(ro, 0, r) if ro is not None else (None, None, r) for ro, (_, _, r) in zip(moved, kept)]


def one_group(ro: Rollouts, g: int) -> Rollouts:
    """Group g of a Rollouts as a Rollouts of its own: its prompt, copies of its n rows (a view would
    travel with its whole storage)."""
    rows = slice(g * ro.n, (g + 1) * ro.n)
    pick = lambda name, x: ([x[g]] if name == "prompt_ids" else x[rows].clone() if isinstance(x, torch.Tensor)
                            else x[rows] if isinstance(x, list) else x)
    return dataclasses.replace(ro, **{f.name: pick(f.name, getattr(ro, f.name)) for f in dataclasses.fields(ro)})


def pack_groups(kept, dev=None, keep=None) -> dict:
    """Kept groups -> one training batch on `dev` (default: where the rollouts are): G prompts,
    left-padded to P, and R = G*n responses, right-padded to T, each row pointing at its prompt (`group`).
    keep (G, n): which of each group's N rollouts (default: all, n = N). `row` and `n_rows` place the
    rows among all ranks' (rl_step sets them when K > 1). G = 0 gives an empty batch on `dev`."""
    G, N, dev = len(kept), (kept[0][0].n if kept else 1), (dev or kept[0][0].tokens.device)
    keep = torch.arange(N).expand(G, N) if keep is None else keep  # (G, n)
    n = keep.shape[1]
    P = max((len(ro.prompt_ids[g]) for ro, g, _ in kept), default=1)
    prompt = torch.zeros(G, P, dtype=torch.long)  # (G, P), pad id irrelevant: masked
    prompt_mask = torch.zeros(G, P, dtype=torch.bool)  # (G, P)
    for i, (ro, g, _) in enumerate(kept):
        ids = ro.prompt_ids[g]
        prompt[i, P - len(ids):], prompt_mask[i, P - len(ids):] = torch.tensor(ids), True
    empty = dict(tokens=torch.long, mask=torch.bool, logp=torch.float32, entropy=torch.float32)
    cat = lambda field: torch.cat([getattr(ro, field)[g * N + keep[i]] for i, (ro, g, _) in enumerate(kept)]
                                  or [torch.zeros(0, 1, dtype=empty[field])])  # (R, T_max)
    mask = cat("mask")
    # drop all-padding columns, but keep at least 2: response_logprobs always makes its two model calls
    T = max(int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1, 2)
    rows = lambda field: F.pad(cat(field), (0, 1))[:, :T].to(dev)  # (R, T), one padding column if T_max = 1
    return dict(prompt=prompt.to(dev), prompt_mask=prompt_mask.to(dev), resp=rows("tokens"),
                resp_mask=rows("mask"), group=torch.arange(G, device=dev).repeat_interleave(n),
                sampler_logp=rows("logp"), sampler_entropy=rows("entropy"), row=torch.arange(G * n), n_rows=G * n)


# One empty row (a 1-token prompt, 2 padding response tokens): what a rank computes, with no effect,
# when it holds no row of a micro-batch that other ranks hold rows of (response_logprobs)
IDLE_BATCH = dict(prompt=torch.zeros(1, 1, dtype=torch.long), prompt_mask=torch.ones(1, 1, dtype=torch.bool),
                  resp=torch.zeros(1, 2, dtype=torch.long), resp_mask=torch.zeros(1, 2, dtype=torch.bool),
                  group=torch.zeros(1, dtype=torch.long))


def max_variance_subset(rewards: torch.Tensor, m: int) -> torch.Tensor:
    """PODS's max-variance down-sampling (arXiv 2504.13818): rewards (G, N) -> indices (G, m), ascending,
    of the m rollouts of each group whose rewards have the largest variance. The maximiser is always the
    i highest and the m - i lowest rewards for some i (PODS, Lemma 3.1): try all m + 1. With binary
    rewards it is the balanced set, as many right as wrong as the group allows. m = N keeps all, in order."""
    G, N = rewards.shape
    order = rewards.argsort(dim=1, descending=True, stable=True)  # (G, N)
    cands = torch.stack([torch.cat([order[:, :i], order[:, N - (m - i):]], 1) for i in range(m + 1)])  # (m+1, G, m)
    best = rewards[torch.arange(G)[:, None], cands].var(2, unbiased=False).argmax(0)  # (G,) first of the best
    return cands[best, torch.arange(G)].sort(1).values  # (G, m)


# ----------------------------------------------------------------------------
# Advantages


def compute_advantages(rewards: torch.Tensor, norm: str = "batch", lengths=None) -> torch.Tensor:
    """rewards (G, N), lengths (G, N) valid tokens per response -> advantages (G, N), one per response.
    r - mean_group(r), then
      batch:    whitened over all valid response tokens of the batch (verl's masked whitening, on which
                ProRL v2 and BroRL run): each response's value counts once per token, so with the
                token-mean loss the advantages sum to 0 over tokens even when right and wrong answers
                differ in length. Mean and unbiased variance over tokens, as verl; eps 1e-8 inside the sqrt.
      response: the same over responses (one vote each; ProRL v2's formula read per sequence).
      group:    GRPO: / (std_group + 1e-6).
      none:     nothing more (Dr. GRPO, arXiv 2503.20783: the std division up-weights near-solved and
                near-hopeless prompts, a difficulty bias).
    A group whose rewards are all equal (only with --dynamic_sampling 0) is centred to 0 and then
    whitened with the rest, as verl does: it gets -mean/std, the same for all its rows (positive when
    right answers are shorter than wrong ones: the token mean of the centred values is then
    negative). That keeps the batch form's zero token-sum exact; under group and none it stays 0."""
    centred = rewards - rewards.mean(1, keepdim=True)  # (G, N)
    if norm == "group":
        return centred / (rewards.std(1, keepdim=True) + 1e-6)
    if norm == "none":
        return centred
    if norm == "batch" and lengths is None:
        raise ValueError("adv_norm batch whitens over tokens: pass the responses' lengths")
    # over the whole batch (with K processes every rank holds all groups' rewards and lengths)
    w = (lengths if norm == "batch" else torch.ones_like(centred)).double()  # (G, N) each response's weight
    x, n = centred.double(), w.sum()  # n: valid tokens (batch) or responses (response)
    mean = (w * x).sum() / n
    if n <= 1:  # no variance to divide by
        return centred
    var = ((w * x * x).sum() / n - mean * mean).clamp(min=0) * n / (n - 1)  # unbiased, as verl's masked_var
    return ((centred - mean) * torch.rsqrt(var + 1e-8)).float()  # (G, N)


# ----------------------------------------------------------------------------
# Policy update


def response_logprobs(model, batch, rows, temperature, with_entropy=False):
    """Log-probs (r, T) of the response tokens of batch rows `rows`, through the one log-prob
    kernel. Like the sampler, each prompt is run once (not once per row) and no logits are made
    at prompt positions: the responses attend to their prompt's keys/values, gathered per row,
    so the gradient of all N rows flows back into the one prompt pass. With a plain linear head
    the decoder's hidden states go to kernels.linear_logprobs, which never holds the (r, T, V)
    logits; any other head (plain_head) gives logits, then kernels.token_logprobs."""
    if len(rows) == 0:  # this rank holds none of these rows (K > 1): one empty row makes the same
        # calls to the model as any micro-batch, so that every rank joins each of FSDP's collectives
        dev = batch["resp"].device
        idle = response_logprobs(model, {k: v.to(dev) for k, v in IDLE_BATCH.items()},
                                 torch.zeros(1, dtype=torch.long, device=dev), temperature)  # (1, 2)
        out = batch["sampler_logp"][:0] + 0.0 * idle.sum()  # (0, T), in the graph: backward joins too
        return (out, out) if with_entropy else out
    # K > 1: the whole pass is one forward of the sharded model (distributed.in_forward), so that FSDP
    # gathers the root's parameters (embeddings, final norm, head) for all of it, head included
    return distributed.in_forward(model, lambda: logprobs_pass(model, batch, rows, temperature, with_entropy))


def logprobs_pass(model, batch, rows, temperature, with_entropy):
    """response_logprobs' forward: the prompts once, then the responses against their prompt's keys."""
    head = plain_head(model)
    net = model.get_decoder() if head is not None else model  # hidden states, or logits
    states = lambda out: out.last_hidden_state if head is not None else out.logits
    keep_last = {} if head is not None else dict(logits_to_keep=1)  # no (g, P, V) prompt logits
    groups, row_group = batch["group"][rows].unique(return_inverse=True)  # (g,), (r,)
    pm = batch["prompt_mask"][groups]  # (g, P)
    resp, mask = batch["resp"][rows], batch["resp_mask"][rows]  # (r, T)
    T = max(int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1, 2)  # trim trailing padding, keep 2
    # 1. each prompt once; its last position predicts response token 0. Prompts are left-padded: a
    # padding position attends to itself (its output is never used), as a row with no key at all
    # gives NaN in some CUDA attention kernels
    g, P = pm.shape
    eye = torch.eye(P, dtype=torch.bool, device=pm.device)  # (P, P)
    prompt_attn = eye.new_ones(P, P).tril() & pm[:, None, :] | eye  # (g, P, P): causal over real keys, + itself
    cache = ReplayCache(model.config)
    first = states(net(batch["prompt"][groups], attention_mask=prompt_attn[:, None],
                       position_ids=(pm.long().cumsum(1) - 1).clamp(min=0),
                       **keep_last, **{cache_kwarg(net): cache}))[:, -1:]  # (g, 1, H) or (g, 1, V)
    # index_select, not x[row_group]: its backward (index_add_) is deterministic on a CPU, while
    # indexing's (index_put_ with accumulate) adds the N rows' gradients in a racy order
    x = first.index_select(0, row_group)  # (r, 1, H or V)
    # 2. response tokens 0..T-2 predict tokens 1..T-1 (T >= 2: always two calls to the model, as FSDP
    # needs the same calls on every rank; a 1-token batch has a padding column, pack_groups)
    row_cache = ReplayCache(model.config, [(layer.keys.index_select(0, row_group), layer.values.index_select(0, row_group))
                                           for layer in cache.layers])  # per layer (g, Hkv, P, D) -> (r, Hkv, P, D)
    r = len(rows)
    causal = torch.ones(T - 1, T - 1, dtype=torch.bool, device=pm.device).tril()  # (T-1, T-1): every row sees itself
    attn = torch.cat([pm[row_group, None, :].expand(r, T - 1, P), causal.expand(r, -1, -1)], -1)  # (r, T-1, P+T-1)
    pos = pm.sum(1)[row_group, None] + torch.arange(T - 1, device=pm.device)  # (r, T-1)
    rest = states(net(resp[:, : T - 1], attention_mask=attn[:, None], position_ids=pos,
                      **{cache_kwarg(net): row_cache}))  # (r, T-1, H or V)
    x = torch.cat([x, rest], 1)  # (r, T, H or V): hidden states are small, logits only without a plain head
    targets = resp[:, :T].masked_fill(~mask[:, :T], -100)  # (r, T)
    if head is not None:
        out = linear_logprobs(x, head, targets, temperature, with_entropy=with_entropy)
    else:
        out = token_logprobs(x, targets, temperature, with_entropy=with_entropy)
    pad = lambda x: F.pad(x, (0, mask.shape[1] - T))  # back to the batch's T
    return tuple(pad(x) for x in out) if with_entropy else pad(out)


def loss_weights(mask: torch.Tensor, agg: str, n_tokens=None, n_rows=None, max_len=None) -> torch.Tensor:
    """Per-token weights (r, T) of a mini-batch, fixed BEFORE micro-batching so that any micro-batch
    size gives the same gradient. token: 1 / (valid tokens in the mini-batch) (DAPO, ProRL v2);
    sequence: 1 / (row length * rows), the older per-sequence mean (GSPO's); constant: 1 / (max_len *
    rows), Dr. GRPO's (arXiv 2503.20783) constant normaliser, the generation budget, so that no
    response's length scales its own tokens' gradient. With K processes `mask` is this rank's rows of
    the mini-batch, n_tokens and n_rows the mini-batch's counts over all ranks."""
    m = mask.float()
    n_tokens = m.sum() if n_tokens is None else torch.as_tensor(n_tokens, dtype=m.dtype, device=m.device)
    n_rows = m.shape[0] if n_rows is None else n_rows
    if agg == "token":
        return m / n_tokens.clamp(min=1)
    if agg == "constant":
        return m / (max_len * n_rows)
    return m / m.sum(1, keepdim=True).clamp(min=1) / n_rows


def ppo_token_loss(logp, old_logp, adv, clip_low, clip_high, clip_ratio_c=3.0):
    """PPO-clip with decoupled bounds, per token (r, T); adv (r,) broadcast along T. As verl: the
    log-ratio is clamped to +-20 before exp (no overflow to inf), and dual-clip caps a negative-advantage
    token's loss at -c*A, however far its ratio has run."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # (r, T)
    a = adv[:, None]  # (r, 1)
    loss = torch.max(-ratio * a, -ratio.clamp(1 - clip_low, 1 + clip_high) * a)  # (r, T)
    return torch.where(a < 0, torch.min(loss, -clip_ratio_c * a), loss), ratio


def gspo_token_loss(logp, old_logp, adv, mask, clip_low=3e-4, clip_high=4e-4):
    """GSPO (arXiv 2507.18071), per token (r, T). Where PPO has a ratio per token, GSPO has one per
    sequence, s = exp(mean over its tokens of logp - logp_old) (the geometric mean of its token ratios:
    length-normalised, so it stays near 1), clipped per sequence, [1 - 3e-4, 1 + 4e-4] in the paper:
    a clipped sequence gives no gradient at all. Returned in the paper's GSPO-token form, ratio_t =
    sg(s) * exp(logp_t - sg(logp_t)): each token's value is its sequence's, and the per-row mean
    (--loss_agg sequence, the paper's) gives exactly the gradient of -min(s A, clip(s) A) per sequence."""
    n = mask.sum(1).clamp(min=1)  # (r,) valid tokens per row
    log_s = ((logp - old_logp) * mask).sum(1) / n  # (r,) log of the sequence ratio
    ratio = torch.exp((logp - logp.detach() + log_s.detach()[:, None]).clamp(-20, 20))  # (r, T), value s
    a = adv[:, None]  # (r, 1)
    return torch.max(-ratio * a, -ratio.clamp(1 - clip_low, 1 + clip_high) * a), ratio  # (r, T)


def cispo_token_loss(logp, old_logp, adv, clip_high=0.28):
    """CISPO (MiniMax-M1, arXiv 2506.13585), per token (r, T): -sg(min(ratio, 1 + eps_high)) * A * logp.
    Where PPO drops a token whose ratio left the trust region (zero gradient), CISPO keeps every token's
    REINFORCE gradient and clips only its importance weight, detached. The paper sets no lower bound and
    tunes eps_high without publishing it: here --clip_high (0.28), verl's clip_ratio_high."""
    ratio = torch.exp((logp - old_logp).clamp(-20, 20))  # (r, T)
    return -ratio.clamp(max=1 + clip_high).detach() * adv[:, None] * logp, ratio


def policy_token_loss(logp, old_logp, adv, mask, cfg):
    """--loss: the policy loss per token (r, T), the ratio, and where the clip binds (r, T) (PPO, GSPO:
    the gradient is zero there; CISPO: the weight is truncated, the gradient kept). Dual-clip is PPO's
    alone, as in verl: GSPO's and CISPO's bounds already cap a negative-advantage token's loss."""
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
    return loss, ratio, clipped | ((ratio > cfg.clip_ratio_c) & (a < 0) & (cfg.loss == "ppo"))  # dual-clip


def tis_weight(old_logp, sampler_logp, cap):
    """Truncated importance sampling (r, T): min(exp(logp_old - logp_sampler), C). The tokens were drawn
    by the sampler, the loss is computed against the trainer's old policy: this reweights one to the
    other, truncated so that a rare outlier cannot dominate. Exactly 1 when both are the same tensor."""
    if cap == 0:
        return torch.ones_like(old_logp)
    return torch.exp((old_logp - sampler_logp).clamp(max=20)).clamp(max=cap)


def kl_k2(logp, ref_logp):
    """k2 estimator of KL(policy || ref) per token: 0.5 * log-ratio^2, log-ratio clamped to +-10."""
    return 0.5 * (logp - ref_logp).clamp(-10, 10) ** 2


def uses_sampler_logp(cfg, model) -> bool:
    """--old_logp auto: the sampler's log-probs when the forward runs in float32 (fp32 weights, no
    autocast), where they equal a trainer forward's up to rounding (tested; logged as max|ratio-1|);
    a recompute in bf16, where the decode and the training forward round differently."""
    w = next(model.parameters())
    fp32 = w.dtype == torch.float32 and compute_dtype(cfg, w.device) == torch.float32
    return cfg.old_logp == "sampler" or (cfg.old_logp == "auto" and fp32)


def micro_batches(rows: torch.Tensor, size: int) -> list:
    """rows in micro-batches of `size`, as many on every rank as the most any rank needs: a rank with
    fewer rows runs empty ones (response_logprobs), so every rank joins each of FSDP's collectives."""
    n = int(distributed.all_max(math.ceil(len(rows) / size)))
    return [rows[i * size: (i + 1) * size] for i in range(n)]


def update_policy(model, ref_model, opt, batch, adv, cfg, gen_cpu):
    """n_minibatches optimizer steps over the step's rows; returns the update's metrics. With K
    processes, batch holds this rank's rows (batch["row"]: their indices among all n_rows); the
    mini-batches, their loss normalisers and every metric are those of all ranks' rows together."""
    R, dev = batch["n_rows"], adv.device  # rows over all ranks
    local = torch.full((R,), -1, dtype=torch.long)  # (R,) each row's index in this rank's batch, or -1
    local[batch["row"]] = torch.arange(len(batch["row"]))
    # old (and reference) log-probs and the entropy metric, once, before any update
    chunks = micro_batches(torch.arange(len(adv), device=dev), cfg.micro_batch)
    sampler_logp, valid = batch["sampler_logp"], batch["resp_mask"]  # (r, T) each
    with torch.no_grad(), autocast(cfg, dev):
        if uses_sampler_logp(cfg, model):  # same weights, no update yet: the sampler's own
            old_logp, ent = sampler_logp, batch["sampler_entropy"]  # (r, T) each
        else:  # a trainer forward (the paper's setup): sampler and trainer numerics differ
            old_logp, ent = (torch.cat(x) for x in zip(*[response_logprobs(model, batch, rows, cfg.temperature, True)
                                                          for rows in chunks]))  # (r, T) each
        with as_reference(ref_model) as ref:  # with LoRA: the policy with the reference's adapter, or none
            ref_logp = torch.cat([response_logprobs(ref, batch, rows, cfg.temperature)
                                  for rows in chunks]) if cfg.kl_coef > 0 else None  # (r, T)
    # sampler/trainer drift: how far the policy that drew the tokens is from the old policy of the loss.
    # 0 by construction when the old log-probs are the sampler's (a trainer forward to measure it would
    # cost as much as --old_logp recompute; the first mini-batch's max|ratio-1| below then measures it)
    drift = (torch.exp(old_logp - sampler_logp) - 1).abs()[valid]  # (valid tokens,)
    tis = tis_weight(old_logp, sampler_logp, cfg.tis_cap)  # (r, T)
    ent = ent[valid]  # (valid tokens,)
    m = dict(entropy=ent.sum().item(), clip_frac=0.0, kl=0.0, grad_norm=0.0, max_ratio_dev=0.0,
             drift_max=drift.max().item() if len(drift) else 0.0, drift_mean=drift.sum().item())
    perm = torch.randperm(R, generator=gen_cpu)  # the same on every rank
    # even mini-batches (10 rows in 4: 3, 3, 2, 2); fewer rows than n_minibatches: one row each
    minibatches = perm.tensor_split(min(cfg.n_minibatches, R))
    n_tok = 0
    for k, mb in enumerate(minibatches):
        mine = local[mb][local[mb] >= 0].to(dev)  # this rank's rows of the mini-batch, in its order
        mask_mb = batch["resp_mask"][mine]
        w = loss_weights(mask_mb, cfg.loss_agg, distributed.all_sum(mask_mb.sum()), len(mb), cfg.max_new_tokens)  # (r, T)
        opt.zero_grad(set_to_none=True)
        for j, rows in enumerate(micro_batches(mine, cfg.micro_batch)):
            wr = w[j * cfg.micro_batch: j * cfg.micro_batch + len(rows)]
            mask = batch["resp_mask"][rows]
            with autocast(cfg, adv.device):  # a fresh region per forward: it sees the last opt.step()
                logp = response_logprobs(model, batch, rows, cfg.temperature)  # (r, T)
            tok_loss, ratio, clipped = policy_token_loss(logp, old_logp[rows], adv[rows], mask, cfg)
            tok_loss = tok_loss * tis[rows]  # TIS on the policy loss only, not on the KL (verl)
            if ref_logp is not None:
                kl = kl_k2(logp, ref_logp[rows])
                tok_loss = tok_loss + cfg.kl_coef * kl
                m["kl"] += (kl * mask).sum().item()
            (tok_loss * wr).sum().backward()
            m["clip_frac"] += (clipped & mask).sum().item()
            n_tok += mask.sum().item()
            if k == 0 and len(rows):  # no update yet: ratio == 1 up to float rounding (trainer vs sampler or trainer)
                m["max_ratio_dev"] = max(m["max_ratio_dev"], ((ratio - 1).abs() * mask).max().item())
        norm = distributed.full(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)).item()
        if not math.isfinite(norm):  # never step on a NaN/inf gradient
            raise FloatingPointError(f"gradient norm is {norm} in mini-batch {k}; it was not applied")
        m["grad_norm"] += norm / len(minibatches)
        opt.step()
    opt.zero_grad(set_to_none=True)  # the gradients would otherwise sit through the next rollout
    # every metric over all ranks' rows
    n_tok, n_ent = distributed.all_sum(n_tok).item(), distributed.all_sum(len(ent)).item()
    m["entropy"] = distributed.all_sum(m["entropy"]).item() / max(n_ent, 1)
    m["drift_mean"] = distributed.all_sum(m["drift_mean"]).item() / max(n_ent, 1)
    m["drift_max"] = distributed.all_max(m["drift_max"]).item()
    m["clip_frac"] = distributed.all_sum(m["clip_frac"]).item() / max(n_tok, 1)
    m["kl"] = distributed.all_sum(m["kl"]).item() / max(n_tok, 1)
    m["max_ratio_dev"] = distributed.all_max(m["max_ratio_dev"]).item()
    return m


# ----------------------------------------------------------------------------
# One step


def rl_step(model, replica, ref_model, opt, tok, cfg, train_set, rng, step, gen_cpu, keep_est) -> dict:
    """rollout -> reward -> dynamic sampling -> advantages -> policy update; returns the metrics.
    replica: the policy's full weights, for the rollouts (the policy itself when K = 1)."""
    replica.eval()
    t0 = time.perf_counter()
    with autocast(cfg, replica.device):  # no weight changes while sampling: the region's cache is valid
        kept, stats = sample_step_groups(replica, tok, cfg, train_set, rng, step, keep_est)
    t_roll = time.perf_counter() - t0
    upd = {}
    if kept:  # else every group was all-right or all-wrong: nothing to learn from this step
        kept = balance_groups(kept)
        mine = [j for j, (ro, _, _) in enumerate(kept) if ro is not None]  # the kept groups trained here
        all_rewards = torch.stack([r for _, _, r in kept])  # (G, N), every rank has all
        # --train_rollouts m: the update's rows; advantages over the m kept (PODS): they sum to 0 over the rows
        # trained on, and m = N is the run without it exactly
        keep = max_variance_subset(all_rewards, cfg.train_rollouts or cfg.n_rollouts)  # (G, m)
        rewards, n = all_rewards.gather(1, keep), keep.shape[1]  # (G, m)
        batch = pack_groups([kept[j] for j in mine], model.device, keep[mine])
        batch["row"] = (torch.tensor(mine, dtype=torch.long)[:, None] * n + torch.arange(n)).flatten()  # (r,)
        batch["n_rows"] = len(kept) * n  # R, over all ranks
        lengths = torch.zeros(rewards.shape, dtype=torch.float64)  # (G, m) valid tokens per response:
        lengths[mine] = batch["resp_mask"].sum(1).view(len(mine), n).double().cpu()  # this rank's groups,
        lengths = distributed.all_sum(lengths).float()  # then every rank's
        adv = compute_advantages(rewards, cfg.adv_norm, lengths).flatten()  # (R,) all ranks'
        model.train()
        upd = update_policy(model, ref_model, opt, batch, adv[batch["row"]].to(model.device), cfg, gen_cpu)
        distributed.refresh(model, replica)  # the replica follows the update: one gather per step
        upd.update(reward_kept=all_rewards.mean().item(), reward_trained=rewards.mean().item())  # N vs m
    return step_metrics(stats, t_roll, time.perf_counter() - t0 - t_roll, upd)


# ----------------------------------------------------------------------------
# Evaluation and diagnostics: pass@k and the probe set's correct mass


def eval_generator(device, seed: int, step: int) -> torch.Generator:
    """The random stream of the evaluation (and probe) at `step`, a function of (seed, step) alone:
    evaluating never moves the training's stream (--eval_every cannot change a run), and --eval_only
    draws exactly what a run's evaluation at step 0 draws."""
    return torch.Generator(device=device).manual_seed(random.Random(f"eval-{seed}-{step}").getrandbits(63))


def evaluate(model, tok, examples, cfg, gen) -> dict:
    """Held-out pass@1 and pass@k at the paper's eval sampling (T=0.6, top_p=0.95), and greedy.
    pass@k is the unbiased estimator 1 - C(n-c, k) / C(n, k) from n samples (data.pass_at_k), for
    k = 1, 2, 4, ... and n itself; the mean length and truncated share of the sampled responses.
    Each rank samples its share of the prompts."""
    n, max_new = cfg.eval_samples, cfg.eval_max_new_tokens or cfg.max_new_tokens
    seeds = draw_seeds(gen, len(examples))  # the same seeds on every rank
    ro, _, correct = sample_share(model, tok, examples, n, 0.6, 0.95, cfg, seeds, max_new)  # (P, n)
    greedy = sample_share(model, tok, examples, 1, 0.0, 1.0, cfg, seeds, max_new)[2]  # (P, 1)
    ks = sorted({2 ** i for i in range(int(math.log2(n)) + 1)} | {n})
    m = {"eval_pass@1": correct.mean().item(), "eval_greedy_pass@1": greedy.mean().item()}
    for k in ks[1:]:
        m[f"eval_pass@{k}"] = sum(data.pass_at_k(n, int(c), k) for c in correct.sum(1)) / len(examples)
    m["eval_pass@k"] = m[f"eval_pass@{n}"]
    m["eval_correct"] = [int(c) for c in correct.sum(1)]  # per held-out problem, of n samples: for paired tests
    per_sample = lambda field: distributed.all_sum(getattr(ro, field).sum() if ro else 0).item() / correct.numel()
    m["eval_resp_len"] = per_sample("mask")  # tokens per sampled response (all ranks' samples)
    m["eval_truncated"] = per_sample("truncated")  # share that hit the length cap
    return m


def probe_mass(model, tok, probe, cfg, gen, start=None) -> tuple:
    """Correct mass Q(x) of each probe prompt, estimated by the pass rate of --probe_samples rollouts
    at the training temperature (not N: runs with different N are measured alike). Per prompt, an
    analogy to Theorem 1's Q_pos; pass@k(x) = 1 - (1 - Q(x))^k rises with it (docs/paper.md §3)."""
    seeds = draw_seeds(gen, len(probe))
    q = sample_share(model, tok, probe, cfg.probe_samples, cfg.temperature, cfg.top_p, cfg, seeds)[2].mean(1)  # (P,)
    m = {"mass_mean": q.mean().item()}
    if start is not None:
        delta = q - start
        m.update(mass_rose=(delta > 0).float().mean().item(), mass_fell=(delta < 0).float().mean().item(),
                 mass_worst_drop=max(0.0, -delta.min().item()))
    return q, m


def step_metrics(stats, t_roll, t_upd, upd) -> dict:
    """The per-step dict: rollout statistics over ALL generated groups, before filtering."""
    r = torch.cat(stats["rewards"])  # (groups generated, N)
    return {
        "reward_mean": r.mean().item(),
        "keep_rate": stats["groups_survived"] / max(stats["groups_generated"], 1),  # before truncation to B
        "groups_kept": stats["groups_kept"], "sample_rounds": stats["rounds"],
        "samples": r.numel(),  # rollouts generated this step, dropped groups included
        "zero_adv_frac": (r.max(1).values == r.min(1).values).float().mean().item(),
        "pass@1": r.mean().item(), "pass@N": (r.max(1).values > 0).float().mean().item(),
        "resp_len": stats["tokens"] / r.numel(), "tokens_per_s": stats["tokens"] / max(t_roll, 1e-9),
        "time_rollout": t_roll, "time_update": t_upd, **upd,
    }


# ----------------------------------------------------------------------------
# Setup and the loop


def pick_verifier(cfg) -> str:
    """--verifier auto: both (rules or Math-Verify, the paper's) on math when math-verify is installed."""
    try:
        return verify.choose_verifier(cfg.task, cfg.verifier)
    except ImportError as e:
        fail(f"--verifier {cfg.verifier}: {e}")


def load_data(cfg: Config, flag: str, task: str, split: str, seed: int) -> list:
    """Examples of one split of a task; a bad source or an empty split stops with one line."""
    try:
        rows = data.load_task(task, split, seed=seed, digits=cfg.digits)
    except (ValueError, OSError) as e:
        fail(f"{flag} {task}: {e}")
    if not rows:
        fail(f"{flag} {task}: its {split} split is empty" + (" (name a held-out source: --eval_task)" * (split == "test")))
    return rows


def plan_only(cfg: Config) -> list:
    """--plan: the memory plan from the model's config and tokenizer, loading no weights: on one
    device, then per rank of 8 (torchrun)."""
    from transformers import AutoConfig
    name = str(Path(cfg.resume) / "ckpt") if cfg.resume else cfg.model
    device = torch.device(cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    train_set = load_data(cfg, "--task", cfg.task, "train", cfg.seed)
    name, revision = split_revision(name)
    try:
        model_config = AutoConfig.from_pretrained(name, revision=revision)
        tok = AutoTokenizer.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as e:
        fail(f"--model {name}: could not load its config and tokenizer ({str(e).splitlines()[0]})")
    planner.plan_memory(cfg, model_config, tok, train_set, device, report_only=True)
    if distributed.world_size() == 1:  # and as `torchrun --nproc_per_node=8` would run it, per rank
        print()
        planner.plan_memory(cfg, model_config, tok, train_set, device, world_size=8, report_only=True)
    return []


def setup(cfg: Config, policy: str, flag: str, with_train_set=True):
    """What a run and --eval_only share: seeds, device and autocast, the data (first: a bad --task
    fails before anything is written), the fixed eval set, the policy and its tokenizer."""
    hf_logging.disable_progress_bar()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = distributed.setup(cfg.device)  # joins the process group when launched by torchrun
    dtype = compute_dtype(cfg, device)
    amp = lambda: autocast(cfg, device)  # around forwards only (see autocast)
    cfg = dataclasses.replace(cfg, verifier=pick_verifier(cfg))  # the run records the verifier it used
    train_set = load_data(cfg, "--task", cfg.task, "train", cfg.seed) if with_train_set else None
    # the held-out problems are drawn by --eval_seed alone (as --seed drew them before it: a seed-0 run's are
    # unchanged), so that runs of different seeds are scored on the same problems, paired problem by problem
    held_out = (load_data(cfg, "--eval_task", cfg.eval_task, "all", cfg.eval_seed) if cfg.eval_task
                else load_data(cfg, "--task", cfg.task, "test", cfg.eval_seed))
    eval_set = random.Random(cfg.eval_seed + 1).sample(held_out, min(cfg.eval_prompts, len(held_out)))
    model, tok = load_policy(policy, device, flag)
    if cfg.system_prompt and not tok.chat_template:
        fail(f"--system_prompt: the tokenizer of {policy} has no chat template to put it in")
    return cfg, device, dtype, amp, train_set, eval_set, model, tok


def eval_only(cfg: Config) -> dict:
    """--eval_only: the held-out evaluation of --model, drawn exactly as a run's step-0 evaluation
    (same eval set, same random stream). No optimizer, no reference, nothing written but eval.json.
    With K processes each samples its share of the prompts and rank 0 writes."""
    cfg, device, dtype, amp, _, eval_set, model, tok = setup(cfg, cfg.model, "--model", with_train_set=False)
    out = Path(distributed.broadcast(str(make_run_dir(cfg)) if distributed.is_main() else None))
    t0 = time.perf_counter()
    with torch.no_grad(), amp():
        m = evaluate(model.eval(), tok, eval_set, cfg, eval_generator(device, cfg.seed, 0))
    report = harness.eval_report(cfg, {cfg.eval_task or cfg.task: m}, len(eval_set), time.perf_counter() - t0)
    if distributed.is_main():
        harness.write_eval(out / "eval.json", report)
        print(harness.eval_table(report))
    distributed.teardown()
    return report


def checkpoint_dir(path: str) -> Path:
    """--init_from's checkpoint: a run directory's ckpt/, or the checkpoint directory itself."""
    run = Path(path)
    return run / "ckpt" if (run / "ckpt" / "config.json").is_file() else run


def load_optimizer(model, opt, state: dict, cfg: Config, source: str):
    """AdamW's moments and step counts from a checkpoint's state. Its learning rate and weight decay are
    this run's: the saved param groups hold the values of the run that wrote them, which would otherwise
    override --lr and --weight_decay silently."""
    if state.get("world_size", 1) != distributed.world_size():  # AdamW's state is laid out per K
        fail(f"{source}: its checkpoint was written by {state.get('world_size', 1)} process(es), "
             f"this run has {distributed.world_size()}: use the same number")
    distributed.load_optimizer_state(model, opt, state["opt"])
    for group in opt.param_groups:
        group.update(lr=cfg.lr, weight_decay=cfg.weight_decay)


def train(cfg: Config) -> list:
    if cfg.plan:
        return plan_only(cfg)
    ckpt = Path(cfg.resume) / "ckpt" if cfg.resume else None
    init = checkpoint_dir(cfg.init_from) if cfg.init_from else None  # weights (and AdamW's moments) from there
    flag = "--resume" if ckpt else "--init_from" if init else "--model"
    cfg, device, dtype, amp, train_set, eval_set, model, tok = setup(cfg, str(ckpt or init or cfg.model), flag)
    main = distributed.is_main()  # rank 0 alone prints and writes
    say = tqdm.write if main else (lambda line: None)
    if cfg.lora_rank and not is_lora(model):  # (a LoRA checkpoint is loaded with its adapter)
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    if cfg.grad_ckpt:
        enable_grad_ckpt(model)
    cfg = planner.plan_memory(cfg, model.config, tok, train_set, device)
    out = Path(distributed.broadcast(str(make_run_dir(cfg)) if main else None))  # its name holds rank 0's time
    if main:
        (out / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    say(json.dumps(dataclasses.asdict(cfg), indent=1))
    say(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
        f"({sum(p.numel() for p in trainable(model)) / 1e6:.3f}M trained), {device}, {dtype}, "
        f"{distributed.world_size()} process(es); train {len(train_set)} prompts, eval {len(eval_set)}; "
        f"verifier {cfg.verifier}; run dir {out}")
    # K > 1: the model's parameters, gradients and AdamW state are sharded (FSDP2); a full replica
    # samples the rollouts and is what is evaluated and saved. K = 1: the replica is the model.
    model, replica = distributed.shard(model, dtype)

    ref_model = None
    if cfg.kl_coef > 0:  # a frozen copy of the starting policy (on --resume, the checkpoint's, below)
        ref_model = make_reference(replica)  # with LoRA: the shared base weights, the adapter off
    opt = torch.optim.AdamW(trainable(model), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.999))
    rng = random.Random(cfg.seed)
    gen_cpu = torch.Generator().manual_seed(cfg.seed)
    probe = eval_set[: cfg.probe_prompts]

    rows, keep_est, start = [], 0.5, 0
    if ckpt:  # continue where the checkpoint left off: same weights, optimizer, random streams, metrics
        state = torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)  # generator states
        # must be CPU tensors; the optimizer and the reference move their own to the device
        start, keep_est, q_start = state["step"], state["keep_est"], state["q_start"]
        load_optimizer(model, opt, state, cfg, f"--resume {cfg.resume}")
        rng.setstate(state["rng"])
        gen_cpu.set_state(state["gen_cpu"])
        if ref_model is not None and state["ref"] is not None:  # else a KL switched on now starts here
            ref_model.load_state_dict(state["ref"])
        rows = read_metrics(out, upto=start)  # steps logged after the checkpoint are redone
        say(f"resumed {out} at step {start}")
    elif init and cfg.init_optimizer:  # a new run (step 0, its own random streams) on the old run's AdamW moments
        state_file = init / "trainer_state.pt"
        if not state_file.is_file():
            fail(f"--init_optimizer: {init} holds no trainer_state.pt (a policy alone has no AdamW state)")
        load_optimizer(model, opt, torch.load(state_file, map_location="cpu", weights_only=True), cfg,
                       f"--init_from {cfg.init_from}")
    metrics_file = open_metrics(out, rows) if main else open(os.devnull, "w")

    def checkpoint(step):
        opt_state = distributed.optimizer_state(model, opt)  # K > 1: the shards gathered onto rank 0
        state = dict(step=step, keep_est=keep_est, q_start=q_start, opt=opt_state, rng=rng.getstate(),
                     gen_cpu=gen_cpu.get_state(), world_size=distributed.world_size(),
                     ref=ref_model.state_dict() if ref_model is not None else None)
        if main:
            save_atomic(replica, tok, cfg, state, out / "ckpt")

    def log_eval(step, q_start=None):
        """Held-out pass@k, and the probe set's correct mass relative to step 0 (own random stream)."""
        replica.eval()
        gen_eval = eval_generator(device, cfg.seed, step)
        with amp():
            m = evaluate(replica, tok, eval_set, cfg, gen_eval)
            q, mq = probe_mass(replica, tok, probe, cfg, gen_eval, start=q_start)
        return {**m, **mq}, q

    # Training time so far, evaluations and checkpoints excluded (their cost must favour no config):
    # wall seconds, and this process's CPU seconds (all its threads), which other processes cannot inflate
    clock = {k: rows[-1].get(k, 0.0) if rows else 0.0 for k in ("time_train_wall", "time_train_cpu")}
    if not ckpt:
        m0, q_start = log_eval(0)
        rows.append({"step": 0, **m0, **clock})
        metrics_file.write(json.dumps(rows[0]) + "\n")
        say("eval step 0: " + " ".join(f"{k}={v:.3f}" for k, v in rows[0].items() if isinstance(v, float)))
    bar = tqdm(range(start + 1, cfg.steps + 1), desc="brorl", dynamic_ncols=True, file=sys.stderr,
               initial=start, total=cfg.steps, disable=not main)
    for step in bar:
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            m = {"step": step, **rl_step(model, replica, ref_model, opt, tok, cfg, train_set, rng, step, gen_cpu,
                                         keep_est)}
        except FloatingPointError as e:  # the bad mini-batch was not applied: stop before training on it
            fail(f"step {step}: {e}")
        keep_est = 0.8 * keep_est + 0.2 * m["keep_rate"]
        if ref_model is not None and step % cfg.ref_reset_every == 0:
            ref_model.load_state_dict(replica.state_dict())  # ProRL: reset the reference, keep Adam state
        clock["time_train_wall"] += time.perf_counter() - wall
        clock["time_train_cpu"] += time.process_time() - cpu
        m.update(clock)
        # this step is the last when the budget is spent (rank 0 decides: every rank stops after the same step)
        spent = distributed.broadcast(0 < cfg.time_budget <= clock[f"time_train_{cfg.budget_clock}"])
        # --- eval, log, checkpoint
        if step % cfg.eval_every == 0 or step == cfg.steps or spent:
            m.update(log_eval(step, q_start)[0])
        rows.append(m)
        metrics_file.write(json.dumps(m) + "\n")
        metrics_file.flush()
        if "eval_pass@1" in m:
            if main:
                plot_metrics(rows, out / "metrics.png")  # refreshed at every eval, not only at the end
            if cfg.save:
                checkpoint(step)
        say(log_line(m))
        if spent:
            say(f"time budget spent: {clock[f'time_train_{cfg.budget_clock}']:.1f} s ({cfg.budget_clock}) "
                f">= --time_budget {cfg.time_budget:g}; stopped after step {step}")
            break
    metrics_file.close()
    first, last = rows[0], rows[-1]
    if "eval_pass@1" in last:
        say(f"held-out pass@1 {first['eval_pass@1']:.3f} -> {last['eval_pass@1']:.3f}, "
            f"pass@k {first['eval_pass@k']:.3f} -> {last['eval_pass@k']:.3f}; wrote {out}")
    distributed.teardown()
    return rows


if __name__ == "__main__":
    config = parse_config()
    if config.eval_only:
        eval_only(config)
    else:
        train(config)
