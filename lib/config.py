"""
config.py: the command line. brorl.py's Config is the recipe and its alternatives; it extends
RunOptions below (the run around it: its inputs, machinery and files, and the research
instruments), whose bases are the flags that an alternative run by lib/ declares beside its code
(each loss's own, lib/objectives.LossFlags; LoRA's, LoRAFlags below). Every field of them all is
a --flag, its source comment the --help (CONTRIBUTING.md, rule 7, says which class a new flag
joins); a preset (lib/presets.py) is applied before the flags given; --resume starts from the
run's own config.json (lib/resume.resumed_config); the first thing wrong with a config
(lib/checks.py) stops it with one line (lib/errors.fail).
"""

import argparse
import dataclasses
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import data
from lib.checks import check_config, one_of, unused_flag
from lib.errors import fail
from lib.objectives import OBJECTIVES, LossFlags
from lib.presets import PRESETS
from lib.resume import resumed_config
from lib.rundir import held_line, held_run


# ----------------------------------------------------------------------------
# The flags of the run around the recipe, and those of the alternatives that lib/ reads. Each
# field's comment is its --help, whole on its own: what the flag is, then its values.


@dataclass
class LoRAFlags:
    """LoRA's flags (lib/lora.add_lora, through peft)"""
    # The optimizer and the checkpoint hold the adapter alone, and the KL's reference shares the
    # base model. The planner, the checks and the harness read these too, so they are declared
    # here, which imports no model code, rather than in lib/lora.py.
    lora_rank: int = 0  # LoRA's rank r: train a rank-r adapter on the frozen model;
                        # 0: full fine-tuning
    lora_alpha: float = 0.0  # LoRA's alpha: the adapter's scale is alpha / r; 0: alpha = 2r
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"  # LoRA's
        # adapted modules, comma-separated (these: Qwen/Llama attention and MLP; Phi-3's
        # fused ones: qkv_proj,o_proj,gate_up_proj,down_proj)


@dataclass
class RunOptions(LoRAFlags, LossFlags):
    """The run around the recipe, which brorl.py's Config (the recipe and its alternatives)
    extends: one typed source, every field a --flag, saved whole in config.json. The run's inputs
    beyond the model and --task, where it runs, its memory and time, its files, and the research
    instruments: what a run measures beside the step, never changing what it trains
    (CONTRIBUTING.md, rule 7). Its bases are the alternatives' own flags, declared beside the code
    that reads them (LoRA's above; each loss's in its lib/objectives.OBJECTIVES entry), so that
    brorl.Config shows the recipe's fields alone; they are Config's fields as the others are."""
    # The data beyond --task.
    eval_task: str = ""  # held-out set from a separate source, --task's syntax, all its rows
                         # (default: --task's held-out split)
    eval_overlap: bool = False  # allow an --eval_task sharing prompts with the training set
                                # (else refused: not held out)
    eval_seed: int = 0  # seed of the held-out draw (eval and probe problems), apart from --seed:
                        # every seed scores the same ones
    train_prompts: int = 0  # training prompts of keys and sets (train = eval): the training
        # task's first n as its eval draw orders them (without --eval_task: the eval set's first
        # n, each one measured; with B = n, each trained every step); 0: all
    system_prompt: str = ""  # system message before each prompt, which needs a chat template
                             # (default: none)
    long_prompts: str = "refuse"  # what to do with a prompt whose prompt + new tokens pass the
                                  # model's context: refuse, drop or allow
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
    # What each evaluation measures beyond pass@k (lib/diagnostics.py).
    probe_prompts: int = 16  # fixed held-out prompts whose correct mass Q(x) is tracked
    probe_samples: int = 512  # samples per probe prompt whatever N is: Q(x) measured alike
    mass_prompts: int = 0  # prompts whose exact correct mass Q (lib/mass.py; arith, keys, sets)
        # is computed at every eval: 0 the eval set; n > 0 n train prompts (under --train_prompts
        # the trained ones' first n)
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
    eval_only: bool = False  # evaluate --model on the held-out set, write <out>/eval.json,
        # train nothing: the recipe's training flags (--lr, --steps, ...) are ignored, the
        # training options of the run (--train_prompts, --alloc, LoRA, ...) refused


# ----------------------------------------------------------------------------
# The command line: every field of brorl.py's Config (RunOptions' too) is a --flag, its source
# comment the --help


def field_help(config_cls) -> dict:
    """--help text for each field: the comment that follows it in the source of the class that
    declares it (Config, RunOptions, or an alternative's flags), continued on the comment lines
    indented under it (as data.py's WarmStart reads its own)."""
    helps = {}
    for cls in reversed(config_cls.__mro__):
        if dataclasses.is_dataclass(cls) and own_fields(cls):  # (LossFlags declares none)
            src = inspect.getsource(cls)
            helps.update({name: " ".join([first, *re.findall(r"#\s*(.+)", more)])
                          for name, first, more in re.findall(
                              r"^\s+(\w+): [^#\n]+#\s*(.+)$((?:\n {8,}#.*)*)", src, flags=re.M)})
    return helps


def table_help(config_cls, presets) -> dict:
    """field_help with the names its tables hold said: --task's (data.TASKS), --preset's
    (lib/presets.py), --loss's and what --loss_agg auto runs with each (lib/objectives.OBJECTIVES),
    so the help never falls behind a table."""
    helps = field_help(config_cls)
    by_sequence = [loss for loss, o in OBJECTIVES.items() if o.aggregation == "sequence"]
    said = {"task": f"; one of {data.task_names()}",
            "preset": f"; one of {', '.join(presets)}",
            "loss": f"; one of {', '.join(OBJECTIVES)}",
            "loss_agg": f": sequence with --loss {one_of(by_sequence)}, else token"}
    return {name: text + said.get(name, "") for name, text in helps.items()}


def own_fields(cls) -> list:
    """The names of the fields that cls itself declares (not its bases)."""
    return list(vars(cls).get("__annotations__", {}))


def flag_groups(config_cls) -> list:
    """--help's groups of fields, in its order, each (title, fields): config_cls's own (the
    recipe), each alternative's own flags (a base of RunOptions, titled by its docstring), then
    RunOptions' own (the run)."""
    declarer = {name: cls for cls in reversed(config_cls.__mro__) for name in own_fields(cls)}
    order = [config_cls] + [c for c in dict.fromkeys(declarer.values())
                            if c not in (config_cls, RunOptions)] + [RunOptions]
    titles = {config_cls: "the recipe, its alternatives (brorl.py's Config)",
              RunOptions: "the run: its inputs, machinery, files and instruments (RunOptions)"}
    return [(titles.get(c) or c.__doc__.strip().splitlines()[0],
             [f for f in dataclasses.fields(config_cls) if declarer[f.name] is c]) for c in order]


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


def parse_config(config_cls, description: str, argv=None, presets=None):
    """Config from the command line: the preset's overrides, then the flags given. With --resume,
    the run's own config.json, then the flags given (e.g. --steps to extend it), except the flags in
    resume.FIXED_ON_RESUME, whose value the checkpoint's restored state decides: changing one is
    refused, as it could not take effect; then check_config. The config records what runs
    (brorl.Config resolves --loss_agg auto). presets: PRESETS (lib/presets.py) unless given."""
    presets = PRESETS if presets is None else presets
    parser = OneLineParser(description=description)
    helps = table_help(config_cls, presets)
    # --help lists the recipe (the Config's own fields) first, then the alternatives' own flags,
    # then the run's options.
    for title, fields in flag_groups(config_cls):
        group = parser.add_argument_group(title)
        for f in fields:
            # default=None marks "not given", so that a preset never overrides an explicit flag;
            # the help shows the real default (Config's), which a preset may change
            text = helps.get(f.name, "")
            text += ("" if "(default:" in text
                     else f" (default: {'none' if f.default == '' else f.default})")
            # A bool flag given alone (--flag) means true.
            kind = (dict(type=parse_bool, nargs="?", const=True) if f.type is bool
                    else dict(type=f.type))
            group.add_argument(f"--{f.name}", **kind, default=None, help=text.replace("%", "%%"),
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
        base = resumed_config(config_cls, overrides, preset)
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
    return cfg
