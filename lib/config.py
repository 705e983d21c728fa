"""
config.py: the command line. brorl.py's Config is the recipe; it extends RunOptions below (the run's
plumbing and the research instruments), and every field of both is a --flag, its source comment the
--help; presets are named bundles of overrides applied before the flags given; --resume starts from
a run's own config.json; check_config names the first thing wrong with a config in one line; fail()
stops with such a line. It imports nothing of ours but the embedded models' paths (data.py), the
verifiers' names (verify.py), the process count (distributed.py) and --loss_agg auto's meaning
(objectives.py).
"""

import argparse
import dataclasses
import inspect
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

import data
import verify
from lib import distributed
from lib.objectives import aggregation


def fail(msg: str):
    """Stop the run with one line naming what was wrong (exit status 2, as argparse)."""
    # tqdm.write puts the message on a line of its own, under a progress bar if one is drawn.
    tqdm.write(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------
# The flags beside the recipe. Each field's comment is its --help, whole on its own: what the flag
# is, then its values.


@dataclass
class RunOptions:
    """The run's plumbing and the research instruments, which brorl.py's Config (the recipe)
    extends: one typed source, every field a --flag, saved whole in config.json. Where the data
    and the run directory come from, memory and time, and what a run measures beyond the step's
    metrics; and two alternatives that replace a part of the step: --alloc adaptive its sampling
    (lib/allocation.py), LoRA the weights it trains (lib/policy.py)."""
    # The data beyond --task.
    eval_task: str = ""  # held-out set from a separate source, --task's syntax, all its rows
                         # (default: --task's held-out split)
    eval_overlap: bool = False  # allow an --eval_task sharing prompts with the training set
                                # (else refused: not held out)
    eval_seed: int = 0  # seed of the held-out draw (eval and probe problems), apart from --seed:
                        # every seed scores the same ones
    eval_max_new_tokens: int = 0  # response length cap in tokens at eval; 0: --max_new_tokens
    train_prompts: int = 0  # training prompts of keys and sets (train = eval): the eval set's
                            # first n alone (with B = n, each of them every step); 0: all
    system_prompt: str = ""  # system message before each prompt, which needs a chat template
                             # (default: none)
    long_prompts: str = "refuse"  # what to do with a prompt whose prompt + new tokens pass the
                                  # model's context: refuse, drop or allow
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
    # LoRA (peft): the optimizer and the checkpoint hold the adapter alone, and the KL's reference
    # shares the base model.
    lora_rank: int = 0  # LoRA's rank r: train a rank-r adapter on the frozen model;
                        # 0: full fine-tuning
    lora_alpha: float = 0.0  # LoRA's alpha: the adapter's scale is alpha / r; 0: alpha = 2r
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # LoRA's
        # adapted modules, comma-separated (these: Qwen/Llama attention and MLP; Phi-3's
        # fused ones: qkv_proj,o_proj,gate_up_proj,down_proj)
    # Where it runs, memory and time.
    device: str = "auto"  # device to run on: auto (cuda if available, else cpu), cpu, cuda or
                          # cuda:<index>
    max_rows: int = 4096  # most rows (rollouts) decoded at once; the planner lowers it to fit
                          # --memory_gb
    micro_batch: int = 512  # micro-batch size: rows per forward/backward of the update (memory,
                            # never the gradient); lowered to fit --memory_gb
    grad_ckpt: bool = False  # gradient checkpointing: recompute each decoder layer in the
                             # backward, activations of one layer, not all (~1/3 more compute)
    memory_gb: float = 0.0  # memory the planner fits into; 0: the CUDA device's less 10%,
                            # on a CPU the machine's RAM
    plan: bool = False  # print the memory plan (lib/planner.py) for these flags and exit,
                        # loading no weights
    time_budget: float = 0.0  # time budget: seconds of training (evaluations excluded);
                              # stop at the first step past it (0: off)
    budget_clock: str = "wall"  # --time_budget's clock: wall, or cpu (this process's CPU time:
                                # others' load cannot inflate it)
    # What each evaluation measures beyond pass@k and the probe (lib/diagnostics.py).
    mass_prompts: int = 0  # prompts whose exact correct mass Q (lib/mass.py; arith, keys, sets)
                           # is computed at every eval: 0 the eval set; n > 0 n train prompts
    gate_small_n: int = 16  # the exact-Q zones' small N: Q >= 1/this is high,
                            # 1/gate_large_n <= Q < 1/this the gate, below it low
    gate_large_n: int = 512  # the exact-Q zones' large N: the gate is where N = 512 samples the
                             # right answer and N = 16 mostly does not
    answer_prompts: int = 0  # answer distributions (sets task): every answer's exact probability
        # for the first n eval prompts at every eval (lib/answers.py), Figure 3's measures for a
        # transformer (about 0.1 CPU s a prompt on one thread); 0: off
    mass_balance: int = 0  # mass balance (sets task, one process): every this many steps, each
        # trained group's answer mass before and after the update and Theorem 1's terms
        # (lib/balance.py; about 5 CPU s a measured step at B = 8); 0: off
    sample_prompts: int = 4  # held-out prompts whose responses each eval writes
                             # to samples.jsonl (lib/samples.py)
    sample_responses: int = 4  # responses kept per prompt in samples.jsonl: the eval's first,
                               # and with --sample_groups the trained ones'
    sample_groups: int = 0  # training groups a step whose responses go to samples.jsonl,
                            # with their advantages
    # The run directory.
    out: str = ""  # output run directory, where the run's files go
                   # (default: runs/<task>-<time>)
    save: bool = True  # save a checkpoint to <out>/ckpt at every eval:
                       # the policy (HF format) + what --resume needs
    report_to: str = "none"  # report each row also to tensorboard, wandb, or
                             # tensorboard,wandb (lib/report.py)
    resume: str = ""  # resume the run in this directory from its checkpoint: its config.json,
                      # then the flags given
    init_from: str = ""  # initial policy from a run directory (or its ckpt/): start from its
                         # policy, at step 0, in a new run directory
    init_optimizer: bool = False  # with --init_from: its AdamW moments too (lr and weight decay
                                  # are this run's); else a fresh AdamW
    preset: str = ""  # preset: a named bundle of overrides, applied before the other flags
    eval_only: bool = False  # evaluate --model on the held-out set,
                             # write <out>/eval.json, train nothing


# ----------------------------------------------------------------------------
# The command line: every field of brorl.py's Config (RunOptions' too) is a --flag, its source
# comment the --help


def field_help(config_cls) -> dict:
    """--help text for each field: the comment that follows it in the source of the class that
    declares it (Config, or RunOptions), continued on the comment lines indented under it (as
    data.py's WarmStart reads its own)."""
    helps = {}
    for cls in reversed(config_cls.__mro__):
        if dataclasses.is_dataclass(cls):
            src = inspect.getsource(cls)
            helps.update({name: " ".join([first, *re.findall(r"#\s*(.+)", more)])
                          for name, first, more in re.findall(
                              r"^\s+(\w+): [^#\n]+#\s*(.+)$((?:\n {8,}#.*)*)", src, flags=re.M)})
    return helps


def flag_fields(config_cls) -> list:
    """The fields of config_cls in --help's order: its own (the recipe) first, then its bases'."""
    own = vars(config_cls).get("__annotations__", {})
    return sorted(dataclasses.fields(config_cls), key=lambda f: f.name not in own)


def parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "0", "false", "no"):
        return s.lower() in ("1", "true", "yes")
    raise argparse.ArgumentTypeError(f"{s!r} is not a boolean (true/false, yes/no, 1/0)")


class OneLineParser(argparse.ArgumentParser):
    """argparse whose refusals are fail()'s one line, not the usage block above it."""

    def error(self, message: str):
        fail(message)


def numbers_as_values(argv: list) -> list:
    """argv with each negative number in scientific or special notation joined to its flag (--lr
    -1e-3 -> --lr=-1e-3): argparse takes "-1e-3" or "-inf" for an option ("expected one argument"),
    so that the range checks, not argparse, judge the value."""
    joined = []
    for a in argv:
        if (joined and joined[-1].startswith("--") and "=" not in joined[-1] and a.startswith("-")
            and is_number(a)):
            joined[-1] += "=" + a
        else:
            joined.append(a)
    return joined


def is_number(s: str) -> bool:
    try:
        float(s)
        return True
    except ValueError:
        return False


def read_json(path: Path, flag: str) -> dict:
    """A JSON object from a file, or one line naming the file (a run's config.json cut short or
    edited)."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        fail(f"{flag}: {path} is unreadable ({getattr(e, 'msg', None) or e})")
    if not isinstance(obj, dict):
        fail(f"{flag}: {path} is not a JSON object")
    return obj


# The files by which a directory holds a run: a new run there would truncate its metrics and replace
# its checkpoint (a plain directory, or one holding only a sweep's log.txt, is not a run)
RUN_FILES = ("config.json", "metrics.jsonl", "ckpt", "ckpt.old", "ckpt.tmp")


def held_run(out: Path) -> list:
    """The run files that `out` holds (RUN_FILES), [] for a new or empty directory."""
    return [name for name in RUN_FILES if (out / name).exists()]


def held_line(out: Path, held: list) -> str:
    """Why a new run is refused on `out`, which holds a run: continue it with --resume, or (a run
    evaluated after step 0 whose checkpoint is gone, or never saved: --save 0) start it over."""
    if surviving_checkpoint(out) is None and (step := evaluated_step(out)):
        return (f"--out {out} holds a run ({', '.join(held)}) with no checkpoint to continue "
                f"(--save 0, or deleted; step {step} was evaluated): give another --out, or "
                "delete that directory to start it over")
    return (f"--out {out} holds a run ({', '.join(held)}): continue it with --resume {out}, or "
            "give another --out (delete that directory to start it over)")


def surviving_checkpoint(run: Path):
    """The checkpoint --resume continues from: run/ckpt; else what a crash inside its save left
    (checkpoint.save_atomic writes ckpt.tmp, its trainer_state.pt last, then renames ckpt ->
    ckpt.old and ckpt.tmp -> ckpt): ckpt.tmp if whole (the newer), else ckpt.old. None if there is
    none."""
    whole = lambda d: (d / "trainer_state.pt").is_file()
    if (run / "ckpt").is_dir():
        return run / "ckpt" if whole(run / "ckpt") else None
    return next((d for d in (run / "ckpt.tmp", run / "ckpt.old") if whole(d)), None)


def parse_config(config_cls, description: str, argv=None, presets=None):
    """Config from the command line: the preset's overrides, then the flags given. With --resume,
    the run's own config.json, then the flags given (e.g. --steps to extend it), except the flags in
    FIXED_ON_RESUME, whose value the checkpoint's restored state decides: changing one is refused,
    as it could not take effect; then check_config. The config records what runs: --loss_agg auto
    resolved."""
    presets = PRESETS if presets is None else presets
    parser = OneLineParser(description=description)
    helps = field_help(config_cls)
    # --help lists the recipe (the Config's own fields) first, then the run's options.
    own = vars(config_cls).get("__annotations__", {})
    groups = {True: parser.add_argument_group("the recipe (brorl.py's Config)"),
              False: parser.add_argument_group("the run's plumbing and instruments (RunOptions)")}
    for f in flag_fields(config_cls):
        # default=None marks "not given", so that a preset never overrides an explicit flag; the
        # help shows the real default (Config's), which a preset may change
        text = helps.get(f.name, "")
        # The names come from the presets themselves, so the help never falls behind.
        if f.name == "preset":
            text += f"; one of {', '.join(presets)}"
        text += ("" if "(default:" in text
                 else f" (default: {'none' if f.default == '' else f.default})")
        # A bool flag given alone (--flag) means true.
        kind = dict(type=parse_bool, nargs="?", const=True) if f.type is bool else dict(type=f.type)
        groups[f.name in own].add_argument(f"--{f.name}", **kind, default=None,
                                           help=text.replace("%", "%%"),
                                           metavar=f.type.__name__.upper())
    args = vars(parser.parse_args(numbers_as_values(sys.argv[1:] if argv is None else argv)))
    overrides = {k: v for k, v in args.items() if v is not None}
    preset = overrides.get("preset", "")
    if preset and preset not in presets:
        parser.error(f"--preset {preset!r}: unknown (choose from {sorted(presets)})")
    base = presets.get(preset, {})
    out = Path(overrides.get("out", ""))
    if overrides.get("out") and out.is_symlink() and not out.exists():  # mkdir: "File exists"
        parser.error(f"--out {out}: a symlink to {os.readlink(out)}, which does not exist "
                     "(make its target, or give another --out)")
    if overrides.get("resume"):
        base = resumed_config(parser, config_cls, overrides, preset)
        overrides["out"] = overrides["resume"]
    elif not overrides.get("plan") and not overrides.get("eval_only") and overrides.get("out"):
        if held := held_run(Path(overrides["out"])):  # its metrics and checkpoint would be replaced
            parser.error(held_line(Path(overrides["out"]), held))
    cfg = config_cls(**{**base, **overrides})
    problem = unused_flag(cfg, overrides) or check_config(cfg)
    if problem:
        # A flag named that was not typed: whose value it is (the preset's, the resumed run's).
        untyped = [k for k in re.findall(r"--(\w+)", problem) if k in base and k not in overrides]
        source = "the run's config.json" if overrides.get("resume") else f"--preset {preset}"
        parser.error(problem + (f" (--{untyped[0]} {base[untyped[0]]!r} comes from {source})"
                                if untyped else ""))
    return dataclasses.replace(cfg, loss_agg=aggregation(cfg.loss, cfg.loss_agg))


def resumed_config(parser, config_cls, overrides: dict, preset: str) -> dict:
    """--resume: the run's own config.json, checked: a checkpoint to continue (ckpt/, or the whole
    one a crash inside its save left), the same directory as --out, no --preset, no field this
    Config lacks, no flag changed that the checkpoint fixes."""
    run = Path(overrides["resume"])
    if overrides.get("init_from"):
        parser.error("--init_from starts a new run from a checkpoint; --resume continues one: "
                     "not both")
    if (run / "trainer_state.pt").is_file() or (run.name in ("ckpt", "ckpt.tmp", "ckpt.old")
                                                 and (run.parent / "metrics.jsonl").is_file()):
        parser.error(f"--resume {run}: a run's checkpoint folder; give the run directory: "
                     f"--resume {run.parent}")
    if not (run / "config.json").is_file():
        parser.error(f"--resume {run}: no checkpoint to resume ({run / 'config.json'} is missing)")
    if surviving_checkpoint(run) is None and (step := evaluated_step(run)):  # it was deleted
        parser.error(f"--resume {run}: no checkpoint to resume ({run / 'ckpt' / 'trainer_state.pt'}"
                     f" is missing, though step {step} was evaluated); start over in another --out")
    # One directory may be spelled two ways, so the resolved paths are compared.
    if Path(overrides.get("out", run)).resolve() != run.resolve():
        parser.error(f"--out {overrides['out']} and --resume {run} name different runs")
    if preset:
        parser.error(f"--preset {preset} with --resume: a resumed run keeps its config; "
                     "change single flags")
    base = read_json(run / "config.json", f"--resume {run}")
    notes = []  # said once every check has passed: the run's first lines
    if surviving_checkpoint(run) is None:  # stopped before its first checkpoint: nothing is lost
        notes.append(f"--resume {run}: no checkpoint yet (stopped before its first, or --steps 0); "
                     "starting it over from step 0 with its config.json")
    if unknown := set(base) - {f.name for f in dataclasses.fields(config_cls)}:
        parser.error(f"--resume {run}: its config.json has fields "
                     f"this brorl.py does not know: {sorted(unknown)}")
    kinds = {f.name: (int, float) if f.type is float else f.type
             for f in dataclasses.fields(config_cls)}
    if bad := [k for k, v in base.items() if not isinstance(v, kinds[k])
               or (kinds[k] is int and isinstance(v, bool))]:
        parser.error(f"--resume {run}: its config.json holds {bad[0]} = {base[bad[0]]!r}, not a "
                     f"{'number' if kinds[bad[0]] == (int, float) else kinds[bad[0]].__name__}")
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    base.update(missing_fields(parser, run, base, overrides, defaults, notes))
    changed = [k for k, v in overrides.items() if k not in ("resume", "out") and base[k] != v]
    if changed:  # each flag that changes the run: said first, recorded by rundir.record_changes
        notes.append(f"--resume {run}: " + ", ".join(f"--{k} {base[k]!r} -> {overrides[k]!r}"
                                                    for k in changed)
                     + " from its checkpoint on (config_history.jsonl records it as the run "
                       "starts)")
    for name in FIXED_ON_RESUME:
        if name in overrides and overrides[name] != base[name]:
            parser.error(f"--{name} {overrides[name]} with --resume {run}: the checkpoint fixes it "
                         f"({base[name]!r}); start a new run from it with --init_from")
    for line in notes if distributed.is_main() else ():
        print(line)
    return base


def evaluated_step(run: Path) -> int:
    """The last step after 0 that a run's metrics.jsonl shows evaluated (a checkpoint was due then),
    or 0: a run stopped before its first checkpoint, which --resume starts over from step 0."""
    try:
        lines = (run / "metrics.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short: read_metrics judges it later
            continue
        if isinstance(row, dict) and "eval_pass@1" in row and isinstance(row.get("step"), int):
            steps.append(row["step"])
    return max(steps)


# The fields of every config.json since --resume began (the commit that added it): one of them
# missing is an edit, named in one line (today's default would change the run in silence).
FIELDS_SINCE_RESUME = (
    "model", "task", "digits", "dtype", "device", "seed", "n_rollouts", "prompts_per_step",
    "max_new_tokens", "temperature", "top_p", "max_rows", "dynamic_sampling", "max_rounds",
    "adv_norm", "lr", "weight_decay", "n_minibatches", "micro_batch", "old_logp", "clip_low",
    "clip_high",
    "loss_agg", "kl_coef", "ref_reset_every", "grad_clip", "steps", "eval_every", "eval_prompts",
    "eval_samples", "probe_prompts", "save")
# A later field missing means a run older than it: it resumes with its default (a new flag's default
# is the code before it), said and recorded; except these, whose value reproducing the code before
# them is another (a function: of the run's own config), or None: no value does (dual-clip has no
# "off"), and the missing field is named as an edited one is.
ADDED_FIELDS = {
    "clip_ratio_c": None, "tis_cap": 0.0, "verifier": "rules",  # before dual-clip, TIS, math-verify
    "sample_prompts": 0,  # before samples.jsonl
    "long_prompts": "allow",  # before prompts were measured against the model's context
    "probe_samples": lambda run: run.get("n_rollouts"),  # the probe drew N rollouts a prompt
    "eval_seed": lambda run: run.get("seed"),  # --seed drew the held-out problems
}


def missing_fields(parser, run: Path, base: dict, overrides: dict, defaults: dict, notes) -> dict:
    """Values for the fields a run's config.json lacks: given on the command line, or (a field newer
    than the code that wrote the run) the value that reproduces that code, noted; any other missing
    field stops with one line naming it: today's default would change the run in silence."""
    missing = [k for k in defaults if k not in base]
    needed = lambda k: k in FIELDS_SINCE_RESUME or (k in ADDED_FIELDS and ADDED_FIELDS[k] is None)
    if lost := [k for k in missing if k not in overrides and needed(k)]:
        parser.error(f"--resume {run}: its config.json lacks {', '.join(lost)} (edited, or older "
                     f"than the field): give the run's value, e.g. --{lost[0]} <value>")
    values = {}
    for k in missing:
        old = ADDED_FIELDS.get(k, defaults[k])
        values[k] = overrides[k] if k in overrides else old(base) if callable(old) else old
    if said := [k for k in missing if k not in ("resume", "out", "preset")]:
        notes.append(f"--resume {run}: its config.json lacks " + ", ".join(
            f"--{k} (taken as {values[k]!r})" for k in said)
            + "; config_history.jsonl records it as the run starts")
    return values


# Presets are named bundles of overrides, never a second source of defaults.
PRESETS = {
    # the correct procedure is rare in the warm start (~3% of samples): where breadth should matter
    "hard": dict(model=str(data.EMBEDDED_MODEL_HARD)),
    # the keys task (data.py): 512 prompts, each its own right value whose mass the warm start
    # spread over decades; train = eval, every prompt scored and its exact Q logged
    # (tools/breadth_study.py)
    "keys": dict(model=str(data.EMBEDDED_MODEL_KEYS), task="keys", eval_prompts=512,
                 eval_samples=16),
    # the sets task (data.py): 256 prompts, each with 16 right values among the 900 of 100..999,
    # each rare; train = eval; the whole answer distribution of 64 of them exact at every eval
    "sets": dict(model=str(data.EMBEDDED_MODEL_SETS), task="sets", eval_prompts=256,
                 eval_samples=16, answer_prompts=64, max_new_tokens=4),
    # A real pretrained model on this CPU (docs/results/smollm2.md): SmolLM2-135M-Instruct (an
    # alias, lib/pretrained.py) on two-digit additions in its chat template, a boxed answer for the
    # math verifier's rules (integers: Math-Verify's worker processes would only cost CPU time).
    # Its base model is right about 1 time in 20 at the eval's temperature 0.6, and at 1 a step's
    # groups are mostly all wrong: rollouts at 0.6 too. 48 new tokens: the answer is short; about
    # 90 CPU seconds a step (fp32, one thread), so 8 steps and three evaluations
    "smollm2": dict(model="smollm2-135m-instruct", task="math:assets/smollm2/add2.jsonl",
                    verifier="rules", n_rollouts=16, prompts_per_step=4, max_new_tokens=48,
                    temperature=0.6, max_rounds=2, lr=1e-5, steps=8, eval_every=4,
                    eval_prompts=32, eval_samples=4, probe_prompts=4, probe_samples=16,
                    sample_groups=1),
    # One-GPU jobs (bf16 autocast on CUDA, --grad_ckpt); the planner lowers max_rows and micro_batch
    # to fit the device (`python brorl.py --preset X --plan`). Learning rates are untuned starting
    # points. A 0.5B instruct model on grade-school math
    "gsm8k-0.5b": dict(model="Qwen/Qwen2.5-0.5B-Instruct", task="gsm8k:openai/gsm8k:main",
                       n_rollouts=256, prompts_per_step=16, max_new_tokens=512, lr=1e-6,
                       n_minibatches=4, grad_ckpt=True, steps=200, eval_every=25, eval_prompts=256,
                       eval_samples=16),
    # A 1.5B reasoning model on DeepScaleR's competition math, 4k-token responses
    "math-1.5b": dict(model="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
                      task="math:agentica-org/DeepScaleR-Preview-Dataset", n_rollouts=128,
                      prompts_per_step=8, max_new_tokens=4096, lr=2e-6, n_minibatches=4,
                      grad_ckpt=True, steps=200, eval_every=25, eval_prompts=128, eval_samples=16),
    # The paper's run (docs/paper.md §5): BroRL continues the ProRL v2 checkpoint, the hub
    # repository below at its v2 revision (pin the revision with --model id@revision; BroRL's own
    # result is the revision `brorl`), on DeepScaleR's math, 128 prompts x 512 rollouts a step, up
    # to 16k tokens a response, on 64 GPUs. lr: ProRL v2's 1e-6 (its public verl configs; the paper
    # gives only the rule) x sqrt(65,536 / 8,192 samples a step); 4 mini-batches (ProRL's 256 / 64);
    # k2 KL 1e-4 (ProRL v2's public configs); the reference reset interval is not published: 100 is
    # ours. Evaluation as the paper's: 16 samples at T 0.6, top_p 0.95 (brorl.evaluate), 32k tokens.
    # A multi-GPU job: on one 80 GB GPU even one row's update does not fit (the step's (rows, T)
    # tensors alone are 29 GB); on 8 it fits with --grad_ckpt (--plan)
    "paper": dict(model="nvidia/Nemotron-Research-Reasoning-Qwen-1.5B",
                  task="math:agentica-org/DeepScaleR-Preview-Dataset", n_rollouts=512,
                  prompts_per_step=128, max_new_tokens=16384, lr=1e-6 * math.sqrt(8),
                  n_minibatches=4, kl_coef=1e-4, ref_reset_every=100, grad_ckpt=True, steps=200,
                  eval_every=25, eval_prompts=256, eval_samples=16, eval_max_new_tokens=32768),
}


# Flags that --resume cannot change: the checkpoint's restored state decides them (the random
# streams drawn from --seed, the weights rather than --model, the probe's step-0 mass per held-out
# problem, the first eval's answer distributions in answers/). The rest take effect on resume; the
# learning rate and weight decay too (load_optimizer sets them).
FIXED_ON_RESUME = ("seed", "model", "task", "digits", "eval_task", "eval_seed", "eval_prompts",
                   "probe_prompts", "mass_prompts", "answer_prompts", "gate_small_n",
                   "gate_large_n", "init_from", "init_optimizer", "long_prompts")


# Flags that change nothing unless another has a value: (the flag, the value that makes them count).
COUNTS_ONLY_WITH = {name: ("alloc", "adaptive") for name in
                    ("rollout_budget", "min_rollouts", "max_rollouts", "alloc_decay")}


def unused_flag(cfg, given: dict) -> str:
    """A flag typed on the command line (`given`; a preset's values are not) that would change
    nothing in this run, as one line naming the flag that makes it count, or ''."""
    for name, (other, value) in COUNTS_ONLY_WITH.items():
        if name in given and getattr(cfg, other) != value:
            return (f"--{name} {given[name]}: counts only with --{other} {value} "
                    f"(this run's --{other} is {getattr(cfg, other)}); drop it, or add "
                    f"--{other} {value}")
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


def check_config(cfg) -> str:
    """The first thing wrong with cfg, as one line naming the flag, or ''. Every number's range is
    checked here, before any work: a value out of range would train silently wrong (a negative
    --grad_clip flips the gradient, --lr 0 trains nothing) or crash after training, before its
    checkpoint."""
    not_finite = [f"--{f.name} {getattr(cfg, f.name)}" for f in dataclasses.fields(cfg)
                  # An inf would pass a range check below, so it is caught here.
                  if f.type is float and not math.isfinite(getattr(cfg, f.name))]
    checks = [
        (not not_finite, f"flags must be finite numbers: {', '.join(not_finite)}"),
        # torch.manual_seed takes 64 bits; a larger seed would overflow inside it, after the checks
        (max(abs(cfg.seed), abs(cfg.eval_seed)) < 2**63,
         f"--seed {cfg.seed}, --eval_seed {cfg.eval_seed}: need |seed| < 2**63"),
        (cfg.long_prompts in ("refuse", "drop", "allow"),
         f"--long_prompts {cfg.long_prompts!r}: choose refuse, drop or allow"),
        (cfg.lr > 0, f"--lr {cfg.lr}: need lr > 0 (0 trains nothing)"),
        (cfg.weight_decay >= 0, f"--weight_decay {cfg.weight_decay}: need >= 0"),
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
        # a nucleus draw would need the nucleus-renormalised log-prob on both sides of the ratio
        # (and a policy gradient through the nucleus's cut); the loss uses the full softmax's:
        # refuse, do not bias
        (cfg.top_p == 1,
         f"--top_p {cfg.top_p}: training needs top_p = 1 (the loss's log-probs are the full "
         "tempered softmax's, not the nucleus's); eval samples at top_p 0.95 anyway"),
        (cfg.adv_norm in ("batch", "response", "group", "none"),
         f"--adv_norm {cfg.adv_norm!r}: choose batch, response, group or none"),
        (cfg.loss in ("ppo", "gspo", "cispo"), f"--loss {cfg.loss!r}: choose ppo, gspo or cispo"),
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
        (cfg.train_prompts == 0 or cfg.task in data.TRAIN_IS_EVAL,
         f"--train_prompts {cfg.train_prompts}: needs a task whose training set is its eval set "
         f"({', '.join(data.TRAIN_IS_EVAL)}), not --task {cfg.task}"),
        (cfg.train_prompts <= cfg.eval_prompts,
         f"--train_prompts {cfg.train_prompts}: the eval set's first n, so at most --eval_prompts "
         f"{cfg.eval_prompts}"),
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
        (cfg.answer_prompts == 0 or cfg.task == "sets",
         f"--answer_prompts {cfg.answer_prompts}: the whole answer distribution needs --task sets "
         "(an answer space small enough to enumerate)"),
        (cfg.mass_balance >= 0, f"--mass_balance {cfg.mass_balance}: need >= 0 steps (0: off)"),
        (not cfg.mass_balance or (cfg.task == "sets" and distributed.world_size() == 1),
         "--mass_balance: needs --task sets and one process (not torchrun)"),
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
