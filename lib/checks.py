"""
checks.py: what is wrong with a config, before any work, in one line naming the flag
(lib/config.parse_config says it and stops with exit status 2): every number's range and every
choice (check_config), the device (check_device), and a flag typed that would change nothing in
this run (unused_flag). A new flag's check is one entry of check_config's list. It imports nothing
of ours but the verifiers' names (verify.py), the tasks' table (data.TASKS: which tasks exist,
which allow which flags), the process count (distributed.py) and the losses' table (objectives.py).
"""

import dataclasses
import math

import torch

import data
import verify
from lib import distributed
from lib.objectives import OBJECTIVES


# Flags that change nothing unless another has a value: the flag -> (the other, the values of it
# that make the flag count; None: any but its off value, 0, '' or False). A loss's own flags come
# from its entry of OBJECTIVES, counting with each loss that names them.
COUNTS_ONLY_WITH = {
    **{name: ("alloc", ("adaptive",)) for name in
       ("rollout_budget", "min_rollouts", "max_rollouts", "alloc_decay")},
    **{flag: ("loss", tuple(loss for loss, o in OBJECTIVES.items() if flag in o.flags))
       for objective in OBJECTIVES.values() for flag in objective.flags},
    "lora_alpha": ("lora_rank", None), "lora_targets": ("lora_rank", None),
    "ref_reset_every": ("kl_coef", None),
    "eval_overlap": ("eval_task", None),
    "budget_clock": ("time_budget", None),
}


# The range a float flag that enters a tensor must hold: 0, or a normal number of both dtypes a
# run computes in, float32 (the weights, the update on a CPU) and bfloat16 (autocast). Both have 8
# exponent bits: from float32's smallest normal number, 1.2e-38 (below it a subnormal loses its
# digits, and bf16 hardware may flush it to 0), to bf16's largest, 3.39e38 (float32's is 3.40e38).
NORMAL = (torch.finfo(torch.float32).tiny, torch.finfo(torch.bfloat16).max)
# The range of a scale that the loss both multiplies and divides by (SAPO's tau: tau (ratio - 1)
# and 4 / tau, forward and backward; the temperature T: the logits / T, their gradient / T): the
# square root of NORMAL's, 1.1e-19 to 1.8e19, so that the scale times the factors it meets (a
# token's loss weight, an advantage, a logit, each within 19 decades of 1) stays a normal number.
SCALE = (math.sqrt(NORMAL[0]), math.sqrt(NORMAL[1]))
# The float flags that only Python's float64 reads (the planner's bytes, the clock, the adaptive
# allocation's float64 counts), never a tensor of the run's dtypes: finite is their range.
FLOAT64_ONLY = ("memory_gb", "time_budget", "alloc_decay")


def one_of(names) -> str:
    """The names as a choice: 'a', 'a or b', 'a, b or c'."""
    names = list(names)
    return " or ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)


def outside(x: float, lo: float, hi: float) -> bool:
    """Whether x is neither 0 nor lo <= |x| <= hi."""
    return x != 0 and not lo <= abs(x) <= hi


# Options of a training run that --eval_only, which trains nothing, would ignore.
TRAINING_ONLY = ("train_prompts", "alloc", "rollout_budget", "min_rollouts", "max_rollouts",
                 "alloc_decay", "lora_rank", "lora_alpha", "lora_targets", "init_from",
                 "init_optimizer", "mass_balance", "sample_groups", "time_budget", "budget_clock",
                 "grad_ckpt", "report_to")


def unused_flag(cfg, given: dict) -> str:
    """A flag typed on the command line (`given`; a preset's values are not) that would change
    nothing in this run, as one line naming the flag that makes it count, or ''."""
    if cfg.eval_only and (idle := [k for k in TRAINING_ONLY if k in given]):
        return (f"--{idle[0]} {given[idle[0]]}: counts only in training, and --eval_only trains "
                "nothing; drop it")
    for name, (other, values) in COUNTS_ONLY_WITH.items():
        now = getattr(cfg, other)
        if name not in given or (now if values is None else now in values):
            continue
        if values is None:
            return (f"--{name} {given[name]}: counts only with --{other} (this run has none); "
                    f"drop it, or set --{other}")
        wanted = f"--{other} {one_of(values)}"
        return (f"--{name} {given[name]}: counts only with {wanted} (this run's --{other} is "
                f"{now}); drop it, or add {wanted}")
    return ""


def check_device(device: str) -> str:
    """What is wrong with --device here, or '': auto, cpu, cuda (this process's GPU) or
    cuda:<index>."""
    if device in ("auto", "cpu"):
        return ""
    try:
        d = torch.device(device)
    except RuntimeError:
        return f"--device {device!r}: not a device (choose auto, cpu, cuda or cuda:<index>)"
    if d.type != "cuda":
        return f"--device {device}: brorl runs on cpu or cuda"
    if not torch.cuda.is_available():
        return f"--device {device}: no CUDA device is available here (use cpu, or auto)"
    if d.index is not None and d.index >= torch.cuda.device_count():
        return (f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s), "
                f"0 to {torch.cuda.device_count() - 1}")
    return ""


def tasks_with(what: str) -> list:
    """The names of the tasks (data.TASKS) whose entry has `what` (e.g. train_is_eval)."""
    return [name for name, t in data.TASKS.items() if getattr(t, what)]


def task_problem(flag: str, name: str) -> str:
    """What is wrong with a task's name, as one line naming the flag (data.task_of's), or ''."""
    try:
        data.task_of(name)
    except ValueError as e:
        return f"--{flag} {name}: {e}"
    return ""


def check_config(cfg) -> str:
    """The first thing wrong with cfg, as one line naming the flag, or ''. Every number's range is
    checked here, before any work: a value out of range would train silently wrong (a negative
    --grad_clip flips the gradient, --lr 0 trains nothing) or crash after training, before its
    checkpoint."""
    # The tasks first: the checks below read the task's entry.
    if problem := (task_problem("task", cfg.task)
                   or cfg.eval_task and task_problem("eval_task", cfg.eval_task)):
        return problem
    task = data.task_of(cfg.task)
    not_finite = [f"--{f.name} {getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                  # An inf would pass a range check below, so it is caught here.
                  if f.type is float and not math.isfinite(getattr(cfg, f.name))]
    floats = [f.name for f in dataclasses.fields(cfg)
              if f.type is float and f.name not in FLOAT64_ONLY]
    # The first value a float32 or a bfloat16 tensor would not hold (a flag a run computes with).
    abnormal = next((f"--{name} {getattr(cfg, name):g}" for name in floats
                     if outside(getattr(cfg, name), *NORMAL)), "")
    checks = [
        (not not_finite, f"flags must be finite numbers: {', '.join(not_finite)}"),
        (not abnormal,
         f"{abnormal}: not a number float32 and bfloat16 hold (need 0, or |x| from "
         f"{NORMAL[0]:.2g} to {NORMAL[1]:.3g})"),
        # torch.manual_seed takes 64 bits; a larger seed would overflow inside it, after the checks
        (max(abs(cfg.seed), abs(cfg.eval_seed)) < 2**63,
         f"--seed {cfg.seed}, --eval_seed {cfg.eval_seed}: need |seed| < 2**63"),
        (cfg.long_prompts in ("refuse", "drop", "allow"),
         f"--long_prompts {cfg.long_prompts!r}: choose refuse, drop or allow"),
        (cfg.lr > 0, f"--lr {cfg.lr}: need lr > 0 (0 trains nothing)"),
        (cfg.weight_decay >= 0, f"--weight_decay {cfg.weight_decay}: need >= 0"),
        # AdamW multiplies each weight by 1 - lr x weight_decay a step: at or past 1, it zeroes or
        # flips every weight.
        (cfg.lr * cfg.weight_decay < 1,
         f"--weight_decay {cfg.weight_decay:g}: need lr x weight_decay < 1 (--lr {cfg.lr:g}; "
         "AdamW multiplies each weight by 1 - lr x weight_decay a step)"),
        (cfg.grad_clip > 0,
         f"--grad_clip {cfg.grad_clip}: need a max gradient norm > 0 "
         "(below 0 it flips the gradient, 0 zeroes it)"),
        (cfg.kl_coef >= 0, f"--kl_coef {cfg.kl_coef}: need >= 0 (0: no KL)"),
        (cfg.kl_coef == 0 or cfg.ref_reset_every >= 1,
         f"--ref_reset_every {cfg.ref_reset_every}: need >= 1 steps with --kl_coef > 0"),
        (0 <= cfg.clip_low < 1,
         f"--clip_low {cfg.clip_low}: need 0 <= eps_low < 1 "
         "(the ratio's floor 1 - eps_low must stay above 0)"),
        (cfg.clip_high >= 0, f"--clip_high {cfg.clip_high}: need >= 0"),
        (cfg.probe_prompts >= 1,
         f"--probe_prompts {cfg.probe_prompts}: need >= 1 (the probe's Q is logged at every eval)"),
        (not check_device(cfg.device), check_device(cfg.device)),
        (cfg.n_rollouts >= 2,
         f"--n_rollouts {cfg.n_rollouts}: need N >= 2 (advantages compare rollouts)"),
        (cfg.prompts_per_step >= 1, f"--prompts_per_step {cfg.prompts_per_step}: need B >= 1"),
        (cfg.train_rollouts == 0 or 2 <= cfg.train_rollouts <= cfg.n_rollouts
         or cfg.alloc == "adaptive",
         f"--train_rollouts {cfg.train_rollouts}: need 2 <= m <= N = {cfg.n_rollouts} (0: all N)"),
        (cfg.alloc in ("uniform", "adaptive"),
         f"--alloc {cfg.alloc!r}: choose uniform or adaptive"),
        # adaptive: a group of n_j rollouts trains on min(m, n_j) of them
        (cfg.alloc == "uniform" or cfg.train_rollouts == 0 or cfg.train_rollouts >= 2,
         f"--train_rollouts {cfg.train_rollouts}: need m >= 2 (0: all of each group)"),
        (cfg.alloc == "uniform" or 2 <= cfg.min_rollouts <= cfg.max_rollouts,
         f"--min_rollouts {cfg.min_rollouts}, --max_rollouts {cfg.max_rollouts}: "
         "need 2 <= min <= max"),
        (cfg.alloc == "uniform" or cfg.min_rollouts * cfg.prompts_per_step
         <= (cfg.rollout_budget or cfg.prompts_per_step * cfg.n_rollouts)
         <= cfg.max_rollouts * cfg.prompts_per_step,
         f"--rollout_budget {cfg.rollout_budget or cfg.prompts_per_step * cfg.n_rollouts}: "
         "need B x --min_rollouts <= R <= B x --max_rollouts "
         f"(B = --prompts_per_step {cfg.prompts_per_step})"),
        (cfg.rollout_budget >= 0, f"--rollout_budget {cfg.rollout_budget}: need >= 0 (0: B x N)"),
        (0 < cfg.alloc_decay <= 1,
         f"--alloc_decay {cfg.alloc_decay}: need 0 < decay <= 1 (1: no decay)"),
        (cfg.max_new_tokens >= 1, f"--max_new_tokens {cfg.max_new_tokens}: need >= 1"),
        (cfg.temperature > 0, f"--temperature {cfg.temperature}: need > 0 for rollouts"),
        (not outside(cfg.temperature, *SCALE),
         f"--temperature {cfg.temperature:g}: need {SCALE[0]:.2g} to {SCALE[1]:.2g} (the logits "
         "are divided by it, their gradient too: past that, float32 and bfloat16 overflow or "
         "underflow)"),
        # a nucleus draw would need the nucleus-renormalised log-prob on both sides of the ratio
        # (and a policy gradient through the nucleus's cut); the loss uses the full softmax's:
        # refuse, do not bias
        (cfg.top_p == 1,
         f"--top_p {cfg.top_p}: training needs top_p = 1 (the loss's log-probs are the full "
         "tempered softmax's, not the nucleus's); eval samples at top_p 0.95 anyway"),
        (cfg.adv_norm in ("batch", "response", "group", "none"),
         f"--adv_norm {cfg.adv_norm!r}: choose batch, response, group or none"),
        (cfg.loss in OBJECTIVES, f"--loss {cfg.loss!r}: choose {one_of(OBJECTIVES)}"),
        (cfg.sapo_tau_pos > 0 and cfg.sapo_tau_neg > 0,
         f"--sapo_tau_pos {cfg.sapo_tau_pos}, --sapo_tau_neg {cfg.sapo_tau_neg}: need both > 0"),
        # The loss is sigmoid(tau (ratio - 1)) 4 / tau, its gradient tau's and 4 / tau's product.
        (not any(outside(t, *SCALE) for t in (cfg.sapo_tau_pos, cfg.sapo_tau_neg)),
         f"--sapo_tau_pos {cfg.sapo_tau_pos:g}, --sapo_tau_neg {cfg.sapo_tau_neg:g}: need both "
         f"from {SCALE[0]:.2g} to {SCALE[1]:.2g} (the loss computes tau and 4 / tau: past that, "
         "float32 and bfloat16 overflow or underflow)"),
        (0 <= cfg.gspo_clip_low < 1 and cfg.gspo_clip_high >= 0,
         "--gspo_clip_low must be in [0, 1), --gspo_clip_high >= 0"),
        (cfg.clip_ratio_c > 1,
         f"--clip_ratio_c {cfg.clip_ratio_c}: need c > 1 (dual-clip caps the loss at -c*A)"),
        (cfg.tis_cap >= 0, f"--tis_cap {cfg.tis_cap}: need C >= 0 (0 disables)"),
        (cfg.verifier in ("auto",) + verify.VERIFIERS,
         f"--verifier {cfg.verifier!r}: choose auto, rules, math_verify or both"),
        (cfg.loss_agg in ("auto", "token", "sequence", "constant"),
         f"--loss_agg {cfg.loss_agg!r}: choose auto, token, sequence or constant"),
        (cfg.old_logp in ("auto", "sampler", "recompute"),
         f"--old_logp {cfg.old_logp!r}: choose auto, sampler, recompute"),
        (cfg.n_minibatches >= 1 and cfg.micro_batch >= 1,
         "--n_minibatches and --micro_batch must be >= 1"),
        (cfg.max_rows >= 1, f"--max_rows {cfg.max_rows}: need >= 1"),
        (cfg.dtype in ("auto", "float32", "bfloat16"),
         f"--dtype {cfg.dtype!r}: choose auto, float32 or bfloat16"),
        (cfg.steps >= 0 and cfg.eval_every >= 1, "--steps must be >= 0 and --eval_every >= 1"),
        (cfg.max_rounds >= 1, f"--max_rounds {cfg.max_rounds}: need >= 1"),
        (cfg.train_prompts >= 0, f"--train_prompts {cfg.train_prompts}: need >= 0 (0: all)"),
        (cfg.train_prompts == 0 or task.train_is_eval,
         f"--train_prompts {cfg.train_prompts}: needs a task whose training set is its eval set "
         f"({', '.join(tasks_with('train_is_eval'))}), not --task {cfg.task}"),
        (cfg.train_prompts <= cfg.eval_prompts or cfg.eval_task,
         f"--train_prompts {cfg.train_prompts}: the eval set's first n, so at most --eval_prompts "
         f"{cfg.eval_prompts}"),
        (not cfg.train_prompts or cfg.mass_prompts <= cfg.train_prompts,
         f"--mass_prompts {cfg.mass_prompts}: under --train_prompts the trained prompts' first n, "
         f"so at most --train_prompts {cfg.train_prompts}"),
        (math.isfinite(cfg.focal_gamma) and cfg.focal_gamma >= 0,
         f"--focal_gamma {cfg.focal_gamma}: need a finite gamma >= 0 (0: off)"),
        (cfg.eval_prompts >= 1 and cfg.eval_samples >= 1,
         "--eval_prompts and --eval_samples must be >= 1"),
        (cfg.eval_max_new_tokens >= 0,
         f"--eval_max_new_tokens {cfg.eval_max_new_tokens}: need >= 0"),
        (min(cfg.sample_prompts, cfg.sample_responses, cfg.sample_groups) >= 0,
         "--sample_* must be >= 0 (0: none)"),
        (set(cfg.report_to.split(",")) <= {"none", "tensorboard", "wandb"},
         f"--report_to {cfg.report_to!r}: choose none, tensorboard, wandb, or tensorboard,wandb"),
        (not (cfg.eval_only and cfg.resume),
         "--eval_only evaluates --model: give the run directory (or its ckpt/) there, "
         "not --resume"),
        # (--init_from with --resume on one command line is refused in resumed_config; a run started
        # with --init_from keeps it in config.json, and is resumed from its own checkpoint)
        (cfg.init_from or not cfg.init_optimizer,
         "--init_optimizer loads the AdamW state of --init_from: name one"),
        (cfg.memory_gb >= 0, f"--memory_gb {cfg.memory_gb}: need >= 0 (0 = the device's)"),
        (cfg.probe_samples >= 1, f"--probe_samples {cfg.probe_samples}: need >= 1"),
        (cfg.mass_prompts >= 0, f"--mass_prompts {cfg.mass_prompts}: need >= 0 (0: the eval set)"),
        (cfg.answer_prompts >= 0, f"--answer_prompts {cfg.answer_prompts}: need >= 0 (0: off)"),
        (cfg.answer_prompts == 0 or task.answer_space,
         f"--answer_prompts {cfg.answer_prompts}: the whole answer distribution needs --task "
         f"{one_of(tasks_with('answer_space'))} (an answer space small enough to enumerate)"),
        (cfg.mass_balance >= 0, f"--mass_balance {cfg.mass_balance}: need >= 0 steps (0: off)"),
        (not cfg.mass_balance or (task.answer_space and distributed.world_size() == 1),
         f"--mass_balance: needs --task {one_of(tasks_with('answer_space'))} and one process "
         "(not torchrun)"),
        (1 <= cfg.gate_small_n < cfg.gate_large_n,
         f"--gate_small_n {cfg.gate_small_n}, --gate_large_n {cfg.gate_large_n}: "
         "need 1 <= small < large (the gate is 1/large <= Q < 1/small)"),
        (cfg.lora_rank >= 0 and cfg.lora_alpha >= 0,
         f"--lora_rank {cfg.lora_rank}, --lora_alpha {cfg.lora_alpha}: need >= 0"),
        (cfg.lora_rank == 0 or distributed.world_size() == 1,
         "--lora_rank: LoRA runs on one process (not under torchrun)"),
        (cfg.time_budget >= 0,
         f"--time_budget {cfg.time_budget}: need >= 0 seconds (0: no budget)"),
        (cfg.budget_clock in ("wall", "cpu"),
         f"--budget_clock {cfg.budget_clock!r}: choose wall or cpu"),
        # Each step's first round asks for at least B prompts, so at least B / K on every rank.
        (cfg.prompts_per_step % distributed.world_size() == 0,
         f"--prompts_per_step {cfg.prompts_per_step}: "
         f"must be a multiple of the {distributed.world_size()} processes "
         "(each samples its share of the prompts)"),
    ]
    return next((msg for ok, msg in checks if not ok), "")
