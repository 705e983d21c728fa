"""
plan.py: a run's memory plan. plan_memory prints lib/planner.py's estimate before the first step
and fits --max_rows and --micro_batch to --memory_gb; --plan (plan) prints the plan of a run's
setup from the model's config and tokenizer alone, loading no weights.
"""

import dataclasses
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from lib import distributed, planner, pretrained
from lib.checkpoint import checkpoint_dir, is_run_dir
from lib.errors import fail
from lib.policy import compute_dtype, config_refusal, pick_dtype, split_revision
from lib.rundir import surviving_checkpoint
from lib.setup import fit_context, load_data, prompt_lengths


def plan(cfg) -> list:
    """--plan: the memory plan from the model's config and tokenizer, loading no weights: on one
    device, then per rank of 8 (torchrun)."""
    name = str(surviving_checkpoint(Path(cfg.resume)) or cfg.model) if cfg.resume else cfg.model
    device = distributed.pick_device(cfg.device)
    train_set = load_data(cfg, "--task", cfg.task, "train", cfg.seed)
    if is_run_dir(Path(name)):  # a run directory: its checkpoint, or one line
        name = str(checkpoint_dir(name, "--model"))
    name, revision = split_revision(pretrained.resolve(name))  # an alias: its folder
    from huggingface_hub.errors import StrictDataclassError  # (transformers' config validation)
    try:
        model_config = AutoConfig.from_pretrained(name, revision=revision)
        tok = AutoTokenizer.from_pretrained(name, revision=revision)
    except StrictDataclassError as e:  # a field of config.json that transformers' checks refuse
        fail(config_refusal("--model", name, e))
    except (OSError, ValueError) as e:
        fail(f"--model {name}: could not load its config and tokenizer ({str(e).splitlines()[0]})")
    # The dtype is made concrete as setup() makes it: the policy's run's own, else the device's.
    cfg = dataclasses.replace(cfg, dtype=pick_dtype(cfg, device, model_config,
                                                    cfg.init_from or name)[0])
    positions = getattr(model_config, "max_position_embeddings", None)  # every prompt planned for
    train_set, longest = fit_context(cfg, train_set, f"--task {cfg.task}: training",
                                     cfg.max_new_tokens, tok, positions)
    # The held-out prompts too, as setup() measures them: the run plans for the longest of both.
    held_out = (load_data(cfg, "--eval_task", cfg.eval_task, "all", cfg.eval_seed) if cfg.eval_task
                else load_data(cfg, "--task", cfg.task, "test", cfg.eval_seed))
    source = f"--eval_task {cfg.eval_task}" if cfg.eval_task else f"--task {cfg.task}"
    longest = max(longest, fit_context(cfg, held_out, f"{source}: held-out",
                                       max(cfg.max_new_tokens, cfg.eval_max_new_tokens), tok,
                                       positions)[1])
    plan_k = lambda **k: plan_memory(cfg, model_config, tok, train_set, device,
                                             report_only=True, prompt_tokens=longest, **k)
    plan_k()
    if distributed.world_size() == 1:  # and as `torchrun --nproc_per_node=8` would run it, per rank
        print()
        plan_k(world_size=8)
    return []


def plan_memory(cfg, model_config, tok, train_set, device, world_size=None, report_only=False,
                prompt_tokens=None):
    """Print the planner's table and return cfg with max_rows and micro_batch lowered to fit
    --memory_gb; stop with one line naming what to lower when even one row does not fit
    (report_only, for --plan: say so and print the plan of one row). world_size: the K to plan for
    (default: this run's). prompt_tokens: the longest prompt (default: the training set's, every row
    measured)."""
    prompt_tokens = prompt_tokens or max(prompt_lengths(tok, train_set, cfg.system_prompt))
    cfg = dataclasses.replace(cfg, dtype=pick_dtype(cfg, device, model_config)[0])
    memory = cfg.memory_gb * planner.GB or planner.default_memory_bytes(device)
    K = world_size or distributed.world_size()  # the figures are one rank's
    say = print if distributed.is_main() else (lambda line: None)
    fitted = planner.fit(model_config, cfg, prompt_tokens, memory, K)
    if isinstance(fitted, str) and not report_only:
        fail(fitted)
    if isinstance(fitted, str):  # the plan of one row a micro-batch, as many rows decoded as fit
        say(f"does not fit on {K} device(s): {fitted}")
        fitted = (planner.fit_rows(model_config, cfg, prompt_tokens, memory, K) or 1, 1)
    if fitted != (cfg.max_rows, cfg.micro_batch):
        say(f"planner: --max_rows {cfg.max_rows} -> {fitted[0]}, "
            f"--micro_batch {cfg.micro_batch} -> {fitted[1]} to fit {memory / planner.GB:.1f} GB")
        cfg = dataclasses.replace(cfg, max_rows=fitted[0], micro_batch=fitted[1])
    say(f"memory plan per rank ({K} process(es); prompts up to {prompt_tokens} tokens, "
        f"{compute_dtype(cfg, device)}):")
    say(planner.format_plan(planner.plan(model_config, cfg, prompt_tokens, K), memory))
    t = planner.step_seconds(model_config, cfg, prompt_tokens, world_size=K)
    gpus = planner.H100["name"] if K == 1 else f"{K} x {planner.H100['name']}, ideal scaling"
    say(f"time per step on {gpus} (roofline estimate, step_seconds; not measured): "
        f"{t['step']:.3g} s (rollout {t['rollout']:.3g} s, update {t['update']:.3g} s)")
    return cfg
