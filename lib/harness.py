"""
harness.py: the run machinery around the algorithm in brorl.py. Setting a run up (seeds, processes,
data, the policy with LoRA, --grad_ckpt and FSDP, the memory plan), its run directory (config.json,
metrics.jsonl, metrics.png), the one log line per step, the training clock and --time_budget,
checkpoints written so that a crash never leaves a half-written one, --resume and --init_from,
--plan and --eval_only. The command line itself is config.py.
"""

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoConfig, AutoTokenizer
from transformers.utils import logging as hf_logging

import data
import verify
from lib import distributed, mass, planner, report, samples
from lib.config import fail, held_run, surviving_checkpoint
from lib.objectives import aggregation
from lib.policy import add_lora, autocast, compute_dtype, enable_grad_ckpt, is_lora, load_policy, split_revision, trainable


# ----------------------------------------------------------------------------
# The run directory: config.json, metrics.jsonl (one dict per step), metrics.png, ckpt/


class RunLock:
    """<out>/.lock, flock()ed for a run's life: a second process on the same --out is refused. The kernel
    drops the lock when its process ends, however it ends; the file then left behind (a kill, a crash)
    names a process that is gone, and the next run there reclaims it with a line. A run that finishes,
    or exits on an error, removes the file. `held`: the locks this process holds, by directory (one
    process may start several runs: tests; a run that ended on an exception never released its own)."""
    held = {}

    def __init__(self, out: Path, say):
        self.path = out.resolve() / ".lock"  # (one directory, however spelled)
        if self.path in RunLock.held:  # an earlier run of this process that never finished
            RunLock.held.pop(self.path).release()
        while True:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(self.fd, 64).decode(errors="replace").strip() or "?"
                os.close(self.fd)
                fail(f"--out {out}: another run (pid {holder}) is using it; wait for it to end, or give another --out")
            if self.same_file():
                break
            os.close(self.fd)  # its holder removed the file as we locked it: lock the new one
        self.previous = os.read(self.fd, 64).decode(errors="replace").strip()  # a gone holder's pid
        self.say, self.out = say, out
        RunLock.held[self.path] = self

    def same_file(self) -> bool:
        try:
            return os.fstat(self.fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def take(self):
        """Write this process's pid into the lock (after the checks: a refused run changes nothing)."""
        if self.previous:
            self.say(f"--out {self.out}: reclaimed the lock of pid {self.previous}, which is gone (a run killed or crashed)")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        self.previous = ""

    def release(self):
        """Remove the lock file (unless it held a gone run's pid that we never replaced) and unlock."""
        if self.fd is None:
            return
        if not self.previous and self.same_file():
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None
        RunLock.held.pop(self.path, None)


@atexit.register
def release_locks():
    """A run that exits on an error (fail(), Ctrl-C) leaves no lock file behind."""
    for lock in list(RunLock.held.values()):
        lock.release()


def make_run_dir(cfg, resume_from=None, fresh=True) -> tuple:
    """(--out, its RunLock): made and locked by rank 0 (every rank gets its name; the default one holds
    rank 0's time). Under the lock, checked again: a new run (`fresh`) needs a directory that holds no
    run, a --resume the checkpoint it loaded from (`resume_from`), which is put back in place as ckpt/
    if a crash inside its save left it as ckpt.tmp or ckpt.old."""
    if not distributed.is_main():
        return Path(distributed.broadcast(None)), None
    out = Path(cfg.out or f"runs/{cfg.task.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}")
    say = tqdm.write
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = RunLock(out, say)
    except OSError as e:
        fail(f"--out {out}: cannot write there ({e.strerror})")
    if fresh and not resume_from and (held := held_run(out)):  # a run that ended since parse_config looked
        lock.release()
        fail(f"--out {out} holds a run ({', '.join(held)}): continue it with --resume {out}, or give another --out")
    if resume_from:
        if surviving_checkpoint(out) != resume_from:
            lock.release()
            fail(f"--resume {out}: its checkpoint changed while it was loading (another run?); run the command again")
        put_back_checkpoint(out, resume_from, say)
    lock.take()
    return Path(distributed.broadcast(str(out))), lock


def put_back_checkpoint(out: Path, ckpt: Path, say):
    """ckpt.tmp or ckpt.old (surviving_checkpoint's choice, after a crash between the save's two renames)
    renamed to ckpt/, the other removed: what the save would have done."""
    if ckpt.name == "ckpt":
        return
    os.replace(ckpt, out / "ckpt")
    for other in ("ckpt.tmp", "ckpt.old"):
        shutil.rmtree(out / other, ignore_errors=True)
    say(f"--resume {out}: no ckpt/ (a crash inside its save); took the whole {ckpt.name}/ as ckpt/")


def write_atomic(path: Path, text: str):
    """path holding text, whole or not at all (a crash leaves the old file, never half of the new)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def record_changes(out: Path, step: int, cfg):
    """A resumed run's config against the one it ran with (its config.json, which this segment's
    then replaces): each field changed, or absent before (a field newer than the run), appended as a
    line of <out>/config_history.jsonl, {"step": the checkpoint's step, "was": ..., "now": ...,
    "absent": [...]}: the directory keeps what ran when. Nothing changed: nothing written."""
    try:
        before = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):  # (parse_config read it whole; a file gone since: all is new)
        before = {}
    now = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("resume", "out")}
    changed = [k for k, v in now.items() if k not in before or before[k] != v]
    if not changed:
        return
    entry = dict(step=step, was={k: before[k] for k in changed if k in before},
                 now={k: now[k] for k in changed}, absent=[k for k in changed if k not in before])
    with no_space_is_one_line(out, "config_history.jsonl was not written; nothing else changed"):
        with open(out / "config_history.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")


def open_metrics(out: Path, rows: list):
    """metrics.jsonl holding exactly `rows` (a resumed run's rows, whole or not at all), open to append."""
    write_atomic(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return open(out / "metrics.jsonl", "a")


def read_metrics(out: Path, upto: int, say) -> list:
    """The rows of a run's metrics.jsonl up to step `upto` (rows logged after a checkpoint are redone).
    A last line cut short (the disk filled, the process was killed as it wrote) is dropped with a line;
    any other unreadable line stops with one line naming it."""
    path = out / "metrics.jsonl"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        fail(f"--resume {out}: cannot read {path} ({e.strerror})")
    rows = [metrics_row(line) for line in lines]
    if lines and rows[-1] is None:
        say(f"--resume {out}: dropped the last line of {path}, cut short ({len(lines[-1])} characters)")
        rows.pop()
    if None in rows:
        fail(f"--resume {out}: {path} line {rows.index(None) + 1} is not a metrics row "
             f"({lines[rows.index(None)][:60]!r})")
    return [r for r in rows if r["step"] <= upto]


def metrics_row(line: str):
    """One line of metrics.jsonl as its row, or None if it is not one."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


def is_io_error(e: Exception) -> bool:
    """A failure to write a file, however it surfaces: an OSError (permission, read-only, a full
    disk, a name in the way), or the message of a writer that wraps one (safetensors' "IoError")."""
    return isinstance(e, OSError) or is_disk_full(e) or "IoError" in str(e)


def is_disk_full(e: Exception) -> bool:
    """The ways a full disk surfaces: ENOSPC, torch's zip writer ("unexpected pos", "file write failed"),
    safetensors' ("StorageFull")."""
    text = str(e)
    return (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        s in text for s in ("No space left", "StorageFull", "unexpected pos", "file write failed"))


@contextlib.contextmanager
def no_space_is_one_line(where: Path, what: str):
    """A full disk while writing into `where` stops the run with one line saying what is kept."""
    try:
        yield
    except Exception as e:
        if not is_disk_full(e):
            raise
        fail(f"no space left on {where}: {what}")


def log_line(m: dict) -> str:
    """The one line printed per step (README.md#what-you-will-see shows one; tests/test_docs.py checks it)."""
    line = (f"step {m['step']:4d} | reward {m['reward_mean']:.3f} | keep {m['keep_rate']:.2f} | "
            f"ent {m.get('entropy', 0):.3f} | clip {m.get('clip_frac', 0):.3f} | "
            f"|r-1| {m.get('max_ratio_dev', 0):.1e} drift {m.get('drift_max', 0):.1e} | len {m['resp_len']:.1f} | "
            f"{m['tokens_per_s']:.0f} tok/s | roll {m['time_rollout']:.2f}s upd {m['time_update']:.2f}s")
    if "alloc_n_min" in m:  # --alloc adaptive: rollouts per prompt, informative groups per 1,000 rollouts
        line += (f" | n {m['alloc_n_min']}/{m['alloc_n_median']:g}/{m['alloc_n_max']}"
                 f" inf/1k {m['informative_per_1k']:.1f} dropped {m['rollouts_dropped']}")
    if "eval_pass@1" in m:
        line += (f" | eval pass@1 {m['eval_pass@1']:.3f} pass@k {m['eval_pass@k']:.3f}"
                 f" probe Q {m['mass_mean']:.3f}")  # sampled: the probe's share of right rollouts
        if "mass_exact_mean" in m:  # computed: the right answer's probability (lib/mass.py)
            line += f" exact Q {m['mass_exact_mean']:.3f}"
    return line


PLOTS = [("reward_mean", "train reward"), ("eval_pass@1", "held-out pass@1 (T=0.6)"),
         ("eval_pass@k", "held-out pass@k (k = eval samples)"), ("keep_rate", "dynamic-sampling keep rate"),
         ("entropy", "token entropy"), ("resp_len", "response length"),
         ("mass_mean", "probe Q (sampled correct mass)"), ("kl", "k2 KL to reference (0 if off)"),
         ("mass_exact_zones", "exact Q: prompts per zone (lib/mass.py)")]
ZONES = [("mass_exact_high", "Q >= 1/small N"), ("mass_exact_gate", "gate"), ("mass_exact_low", "Q < 1/large N")]


def plot_metrics(rows, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 3, figsize=(13, 9))
    for ax, (key, title) in zip(axes.flat, PLOTS):
        for k, label in ZONES if key == "mass_exact_zones" else [(key, None)]:  # the zones: three lines
            pts = [(r["step"], r[k]) for r in rows if k in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3, label=label)
        if key == "mass_exact_zones" and ax.lines:
            ax.legend(fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def save_atomic(model, tok, cfg, state: dict, path: Path):
    """Write the checkpoint into a temp dir, then swap it in: never a half-written checkpoint, and
    the previous one stays whole until the new one is. `state` is what --resume needs besides the
    policy: step, AdamW state, every random generator, the reference policy, the step-0 probe mass.
    A crash before or between the two renames leaves a whole ckpt.tmp (its trainer_state.pt is written
    last) and ckpt.old or ckpt/ (config.surviving_checkpoint); a full disk leaves the previous checkpoint
    as it was and no temp dir."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    not_written = f"the checkpoint of step {state['step']} was not written"
    kept = f"{path.name}/ keeps the last one (--resume continues from it)"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with no_space_is_one_line(path.parent, f"{not_written}; {kept}"):
            model.save_pretrained(tmp)
            tok.save_pretrained(tmp)
            (tmp / "brorl_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
            torch.save(state, tmp / "trainer_state.part")  # last, and renamed: its name marks the temp dir whole
            os.replace(tmp / "trainer_state.part", tmp / "trainer_state.pt")
    except BaseException as e:  # a full disk (one line), Ctrl-C, any error: no half-written temp
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, Exception) and is_io_error(e):  # permission, read-only: one line too
            fail(f"cannot write in {path.parent} ({one_line_reason(e)}): {not_written}; {kept}")
        raise
    shutil.rmtree(old, ignore_errors=True)
    try:  # the swap: ckpt -> ckpt.old, ckpt.tmp -> ckpt
        if path.exists():
            os.replace(path, old)
        try:
            os.replace(tmp, path)
        except OSError:
            if old.exists() and not path.exists():
                os.replace(old, path)  # the previous one back in place
            raise
    except OSError as e:  # e.g. ckpt/ immutable, a name in the way: the previous checkpoint stays
        if path.exists():  # (else the rollback failed too: the whole tmp and old are what is left)
            shutil.rmtree(tmp, ignore_errors=True)
        fail(f"cannot swap the new checkpoint in ({one_line_reason(e)}): {not_written}; "
             + (kept if path.exists() else f"--resume {path.parent} continues from what is left"))
    shutil.rmtree(old, ignore_errors=True)


def one_line_reason(e: Exception) -> str:
    """An error's reason, short: its strerror and the file it names, else its first line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    return (str(e).splitlines() or [type(e).__name__])[0][:160]


# ----------------------------------------------------------------------------
# --eval_only: eval.json and the printed table


def eval_report(cfg, metrics: dict, prompts: int, seconds: float) -> dict:
    """The eval.json of --eval_only. metrics: {benchmark: evaluate()'s dict}; the report keeps, per
    benchmark, the prompts and samples it rests on, pass@k by k, greedy pass@1, the sampled responses'
    mean length (tokens) and the share that hit the length cap."""
    benchmarks = {}
    for name, m in metrics.items():
        ks = sorted(int(k[len("eval_pass@"):]) for k in m if re.fullmatch(r"eval_pass@[0-9]+", k))
        benchmarks[name] = {"prompts": prompts, "samples": cfg.eval_samples,
                            "pass@k": {str(k): m[f"eval_pass@{k}"] for k in ks},
                            "greedy_pass@1": m["eval_greedy_pass@1"], "mean_response_tokens": m["eval_resp_len"],
                            "truncation_rate": m["eval_truncated"]}
        if "mass_exact_mean" in m:  # lib/mass.py: per prompt, and its summary
            benchmarks[name]["exact_mass"] = {k[len("mass_exact_"):]: v for k, v in m.items() if k.startswith("mass_exact_")}
    sampling = dict(temperature=0.6, top_p=0.95, samples=cfg.eval_samples,
                    max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, seed=cfg.seed)
    return dict(model=cfg.model, sampling=sampling, seconds=round(seconds, 2), benchmarks=benchmarks,
                config=dataclasses.asdict(cfg))


def write_eval(path: Path, report: dict):
    write_atomic(path, json.dumps(report, indent=1) + "\n")


def eval_table(report: dict) -> str:
    """One row per benchmark: pass@k for every k, greedy, mean response length, truncation rate."""
    ks = sorted({int(k) for b in report["benchmarks"].values() for k in b["pass@k"]})
    s = report["sampling"]
    head = (f"{report['model']}: pass@k of {s['samples']} samples at T={s['temperature']}, top_p={s['top_p']}, "
            f"<= {s['max_new_tokens']} new tokens; greedy; {report['seconds']:.1f}s")
    cols = ["benchmark", "prompts", *[f"pass@{k}" for k in ks], "greedy", "len", "trunc"]
    rows = [[name, str(b["prompts"]), *[f"{b['pass@k'].get(str(k), float('nan')):.3f}" for k in ks],
             f"{b['greedy_pass@1']:.3f}", f"{b['mean_response_tokens']:.1f}", f"{b['truncation_rate']:.3f}"]
            for name, b in report["benchmarks"].items()]
    width = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    line = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, width)))
    return "\n".join([head, line(cols), *map(line, rows)])


# ----------------------------------------------------------------------------
# Setting a run up: seeds, processes, data, the policy


def pick_verifier(cfg) -> str:
    """--verifier auto: both (rules or Math-Verify, the paper's) on math when math-verify is installed."""
    try:
        return verify.choose_verifier("arith" if cfg.task == "keys" else cfg.task, cfg.verifier)  # keys: the integer rule
    except ImportError as e:
        fail(f"--verifier {cfg.verifier}: {e}")


def load_data(cfg, flag: str, task: str, split: str, seed: int) -> list:
    """Examples of one split of a task; a bad source or an empty split stops with one line."""
    try:
        rows = data.load_task(task, split, seed=seed, digits=cfg.digits)
    except (ValueError, OSError) as e:
        fail(f"{flag} {task}: {e}")
    if not rows:
        fail(f"{flag} {task}: its {split} split is empty" + (" (name a held-out source: --eval_task)" * (split == "test")))
    if task != "arith":  # a dataset's repeated rows would weigh twice (arith's problems are distinct by construction)
        unique = list({(r["prompt"], r["answer"]): r for r in rows}.values())
        if len(unique) < len(rows) and distributed.is_main():
            tqdm.write(f"{flag} {task}: dropped {len(rows) - len(unique)} duplicated rows of {len(rows)} ({split} split)")
        rows = unique
    return rows


def check_overlap(cfg, train_set: list, held_out: list):
    """An --eval_task that shares prompts with the training set would score trained prompts as held-out
    ones: said, and refused unless --eval_overlap allows it."""
    trained = {e["prompt"] for e in train_set}
    shared = sum(e["prompt"] in trained for e in held_out)
    if not shared:
        return
    line = f"--eval_task {cfg.eval_task}: {shared} of its {len(held_out)} prompts are in --task's training set"
    if not cfg.eval_overlap:
        fail(line + " (its score would not be held out; --eval_overlap 1 allows it)")
    if distributed.is_main():
        tqdm.write(line + " (allowed by --eval_overlap)")


def setup(cfg, policy: str, flag: str, with_train_set=True):
    """What a run and --eval_only share: seeds, device, the data (first: a bad --task fails before
    anything is written), the fixed eval set, the policy and its tokenizer."""
    hf_logging.disable_progress_bar()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = distributed.setup(cfg.device)  # joins the process group when launched by torchrun
    cfg = dataclasses.replace(cfg, verifier=pick_verifier(cfg))  # the run records the verifier it used
    train_set = load_data(cfg, "--task", cfg.task, "train", cfg.seed) if with_train_set else None
    if train_set is not None:
        check_train_size(cfg, train_set)
    # the held-out problems are drawn by --eval_seed alone (as --seed drew them before it: a seed-0 run's are
    # unchanged), so that runs of different seeds are scored on the same problems, paired problem by problem
    held_out = (load_data(cfg, "--eval_task", cfg.eval_task, "all", cfg.eval_seed) if cfg.eval_task
                else load_data(cfg, "--task", cfg.task, "test", cfg.eval_seed))
    if cfg.eval_task and train_set:
        check_overlap(cfg, train_set, held_out)
    if flag == "--model" and (Path(policy) / "metrics.jsonl").is_file():  # a run: its ckpt/, or one
        checkpoint_dir(policy, flag)
    model, tok = load_policy(policy, device, flag)
    if cfg.system_prompt and not tok.chat_template:
        fail(f"--system_prompt: the tokenizer of {policy} has no chat template to put it in")
    positions = getattr(model.config, "max_position_embeddings", None)
    eval_new = max(cfg.max_new_tokens, cfg.eval_max_new_tokens)  # the eval's and the probe's
    source = f"--eval_task {cfg.eval_task}" if cfg.eval_task else f"--task {cfg.task}"
    held_out, longest = fit_context(cfg, held_out, f"{source}: held-out", eval_new, tok, positions)
    if train_set is not None:
        train_set, longest_train = fit_context(cfg, train_set, f"--task {cfg.task}: training",
                                               cfg.max_new_tokens, tok, positions)
        check_train_size(cfg, train_set)
        longest = max(longest, longest_train)
    eval_set = random.Random(cfg.eval_seed + 1).sample(held_out, min(cfg.eval_prompts,
                                                                   len(held_out)))
    if cfg.probe_prompts > len(eval_set):  # the probe: the eval set's first ones
        if distributed.is_main():
            tqdm.write(f"--probe_prompts {cfg.probe_prompts}: the eval set holds {len(eval_set)} "
                       f"prompt(s); the probe is those {len(eval_set)} (config.json says so)")
        cfg = dataclasses.replace(cfg, probe_prompts=len(eval_set))
    if bad := next((n for n, p in model.named_parameters() if not torch.isfinite(p).all()), None):
        fail(f"{flag} {policy}: its weight {bad} holds NaN or inf; refusing to sample from it")
    return cfg, device, train_set, eval_set, model, tok, longest


def check_train_size(cfg, train_set: list):
    """A step keeps B groups of B distinct prompts: a training set smaller than B stops, one line
    (a larger one is drawn from whole, prompts recurring only across rounds: sample_step_groups)."""
    if len(train_set) < cfg.prompts_per_step:
        fail(f"--task {cfg.task}: its training set holds {len(train_set)} prompt(s), fewer than "
             f"--prompts_per_step {cfg.prompts_per_step} (a step trains on B distinct prompts)")


def fit_context(cfg, rows: list, where: str, max_new: int, tok, positions) -> tuple:
    """(rows, the longest prompt's tokens): every prompt checked, with max_new new tokens, against
    the model's context (`positions`, its max_position_embeddings; None: unknown, nothing checked).
    A prompt past it stops with one line naming its row (`where`: the flag, source and split) and
    its length; --long_prompts drop drops such rows, allow keeps them (rotary positions extend past
    the config's: the embedded model's 64 and a math prompt), each with a count. The tokenizer's own
    warning about length is left unsaid: this is the word."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        lengths = planner.prompt_lengths(tok, rows, cfg.system_prompt)
    finally:
        hf_logging.set_verbosity(verbosity)
    too_long = [i for i, n in enumerate(lengths) if positions and n + max_new > positions]
    if too_long and cfg.long_prompts == "refuse":
        i = too_long[0]
        fail(f"{where} row {i} ({rows[i]['prompt'][:24]!r}...) is {lengths[i]} tokens: + {max_new} "
             f"new > the model's {positions} positions, as are {len(too_long) - 1} more "
             "(--long_prompts drop drops them, allow keeps them)")
    if too_long and distributed.is_main():
        tqdm.write(f"{where} {len(too_long)} of {len(rows)} rows are longer than the model's "
                   f"{positions} positions with {max_new} new tokens: "
                   + ("dropped (--long_prompts drop)" if cfg.long_prompts == "drop" else
                      "kept (--long_prompts allow)"))
    if too_long and cfg.long_prompts == "drop":
        dropped = set(too_long)
        rows = [r for i, r in enumerate(rows) if i not in dropped]
        lengths = [n for i, n in enumerate(lengths) if i not in dropped]
        if not rows:
            fail(f"{where} every row is longer than the model's {positions} positions with "
                 f"{max_new} new tokens")
    return rows, max(lengths, default=0)


def eval_generator(device, seed: int, step: int) -> torch.Generator:
    """The random stream of the evaluation (and probe) at `step`, a function of (seed, step) alone:
    evaluating never moves the training's stream (--eval_every cannot change a run), and --eval_only
    draws exactly what a run's evaluation at step 0 draws."""
    return torch.Generator(device=device).manual_seed(random.Random(f"eval-{seed}-{step}").getrandbits(63))


def checkpoint_dir(path: str, flag: str = "--init_from") -> Path:
    """--init_from's (or --model's) checkpoint: a run directory's ckpt/, or the checkpoint directory
    itself."""
    run = Path(path)
    if (run / "ckpt" / "config.json").is_file() or (run / "ckpt" / "adapter_config.json").is_file():
        return run / "ckpt"
    if (run / "metrics.jsonl").is_file():  # a run directory (its config.json is brorl's, not a model's)
        left = surviving_checkpoint(run)  # what a crash inside a save left, if anything
        fail(f"{flag} {path}: the run holds no ckpt/" + (
            f" (a crash inside its save left {left.name}/: --resume {path} takes it back)" if left
            else " (--save 0, or stopped before its first eval)"))
    if run.is_dir() and not any((run / f).is_file() for f in ("config.json", "adapter_config.json")):
        fail(f"{flag} {path}: holds no checkpoint (no ckpt/, and no model's config.json)")
    return run


class Clock:
    """Training time so far, evaluations and checkpoints excluded (their cost must favour no config):
    wall seconds, and this process's CPU seconds (all its threads), which other processes cannot inflate.
    `with clock:` around a step's training; then `spent`: --time_budget is used up (rank 0 decides, so
    that every rank stops after the same step)."""

    def __init__(self, cfg, last_row: dict):
        self.cfg, self.spent = cfg, False
        self.total = {k: last_row.get(k, 0.0) for k in ("time_train_wall", "time_train_cpu")}

    def __enter__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def __exit__(self, error, *_):
        if error is not None:  # no collective on the way out of a failure: the other ranks may be inside one
            return
        self.total["time_train_wall"] += time.perf_counter() - self.wall
        self.total["time_train_cpu"] += time.process_time() - self.cpu
        used = self.total[f"time_train_{self.cfg.budget_clock}"]
        self.spent = distributed.broadcast(0 < self.cfg.time_budget <= used)


class Run:
    """A training run's machinery (start() makes one): the resolved config, device, data, the policy (the
    model trained, K > 1 sharded by FSDP2) and its full replica (rollouts, evaluation, checkpoints), the
    run directory and its metrics, the clock. Rank 0 alone prints and writes."""

    def __init__(self, cfg, device, train_set, eval_set, model, replica, tok, out, lock, state, rows):
        self.cfg, self.device, self.train_set, self.eval_set = cfg, device, train_set, eval_set
        self.model, self.replica, self.tok, self.out, self.lock = model, replica, tok, out, lock
        self.state = state  # --resume: the checkpoint's trainer_state.pt (read_trainer_state), else None
        self.main = distributed.is_main()
        self.rows, self.metrics_file, self.clock = rows, None, Clock(cfg, {})  # rows: --resume's, up to its checkpoint
        self.opt = self.ref_model = self.rng = self.gen_cpu = None  # restore() sets them: what checkpoints save
        self.estimate = None  # and --alloc adaptive's per-prompt estimate (restore())
        self.samples_path, self.report = out / "samples.jsonl", None  # what the model wrote; the dashboards (restore())

    def say(self, line: str):
        if self.main:
            tqdm.write(line)

    def amp(self):
        """The autocast region of the compute dtype, around forwards only (policy.autocast)."""
        return autocast(self.cfg, self.device)

    def restore(self, opt, ref_model, rng, gen_cpu, estimate=None) -> tuple:
        """(first step, keep_est, q_start). --resume: where the checkpoint left off (weights, AdamW, the
        reference, every random stream, the metrics logged up to it); --init_from with --init_optimizer:
        its AdamW moments on a new run; else a fresh start (0, 0.5, None). estimate: an object with
        state_dict() and load_state_dict() (--alloc adaptive's per-prompt Q, lib/allocation.py), saved
        in every checkpoint and restored from one that holds it."""
        self.opt, self.ref_model, self.rng, self.gen_cpu = opt, ref_model, rng, gen_cpu
        self.estimate = estimate
        start, keep_est, q_start, resumed = 0, 0.5, None, bool(self.state)
        if self.state:
            state, self.state = self.state, None  # (its AdamW state is loaded into opt, not kept twice)
            start, keep_est, q_start = state["step"], state["keep_est"], state["q_start"]
            load_optimizer(self.model, opt, state, self.cfg, f"--resume {self.cfg.resume}")
            rng.setstate(state["rng"])
            gen_cpu.set_state(state["gen_cpu"])
            if ref_model is not None and state["ref"] is not None:  # else a KL switched on now starts here
                ref_model.load_state_dict(state["ref"])
            if estimate is not None and state.get("estimate") is not None:  # else it starts afresh here
                estimate.load_state_dict(state["estimate"])
            self.say(f"resumed {self.out} at step {start}")
        elif self.cfg.init_optimizer:  # a new run (step 0, its own random streams) on the old run's AdamW moments
            init = checkpoint_dir(self.cfg.init_from)
            load_optimizer(self.model, opt, torch.load(init / "trainer_state.pt", map_location="cpu", weights_only=True),
                           self.cfg, f"--init_from {self.cfg.init_from}")
        if self.main and self.cfg.resume:  # what changed, kept beside config.json (the latest)
            record_changes(self.out, start, self.cfg)
        if self.main:  # the run directory is written once everything has loaded
            write_atomic(self.out / "config.json", json.dumps(dataclasses.asdict(self.cfg), indent=1))
        self.metrics_file = open_metrics(self.out, self.rows) if self.main else open(os.devnull, "w")
        if self.main:  # samples.jsonl as its checkpoint left it (a fresh start: empty)
            samples.rewind(self.samples_path, start if resumed else -1)
            samples.thin(self.samples_path)  # in case the run stopped between its checkpoint and the thinning
        self.report = report.Report(self.cfg, self.out, start, self.main)
        self.clock = Clock(self.cfg, self.rows[-1] if self.rows else {})
        return start, keep_est, q_start

    def steps(self, start: int):
        """The steps after `start` up to --steps, with a progress bar; none after the one that spent --time_budget."""
        for step in tqdm(range(start + 1, self.cfg.steps + 1), desc="brorl", dynamic_ncols=True, file=sys.stderr,
                         initial=start, total=self.cfg.steps, disable=not self.main):
            yield step
            if self.clock.spent:
                self.say(f"time budget spent: {self.clock.total[f'time_train_{self.cfg.budget_clock}']:.1f} s "
                         f"({self.cfg.budget_clock}) >= --time_budget {self.cfg.time_budget:g}; stopped after step {step}")
                return

    def eval_due(self, step: int) -> bool:
        """Evaluate (and checkpoint) after this step: every --eval_every, at the last, or the budget is spent."""
        return step % self.cfg.eval_every == 0 or step == self.cfg.steps or self.clock.spent

    def log(self, m: dict, keep_est: float = 0.5, q_start=None):
        """Step m's row, with the training clock, to metrics.jsonl and the log line; at an evaluation
        also metrics.png and (--save) the checkpoint, which holds keep_est and the step-0 probe mass. The
        responses m carries (brorl.evaluate's, rl_step's with --sample_groups) go to samples.jsonl instead."""
        records = [r for key in ("train_responses", "eval_responses") for r in m.pop(key, [])]
        m.update(self.clock.total)
        self.rows.append(m)
        with no_space_is_one_line(self.out, f"step {m['step']}'s metrics were not all written; --resume {self.out} "
                                            f"continues from its last checkpoint"):
            self.metrics_file.write(json.dumps(m) + "\n")
            self.metrics_file.flush()
            if self.main and records:
                samples.append(self.samples_path, m["step"], records)
            if "eval_pass@1" in m and m["step"] > 0 and self.main:
                plot_metrics(self.rows, self.out / "metrics.png")  # refreshed at every eval, not only at the end
        self.report.log(m, records)  # --report_to's dashboards
        if "eval_pass@1" in m and m["step"] > 0:
            if self.cfg.save:
                self.checkpoint(m["step"], keep_est, q_start)
            if self.main:  # after the checkpoint: a resumed run's file is then exactly this one
                samples.thin(self.samples_path)
        self.say(log_line(m) if m["step"] > 0 else
                 "eval step 0: " + " ".join(f"{k}={v:.3f}" for k, v in m.items() if isinstance(v, float)))

    def checkpoint(self, step: int, keep_est: float, q_start):
        opt_state = distributed.optimizer_state(self.model, self.opt)  # K > 1: the shards gathered onto rank 0
        state = dict(step=step, keep_est=keep_est, q_start=q_start, opt=opt_state, rng=self.rng.getstate(),
                     gen_cpu=self.gen_cpu.get_state(), world_size=distributed.world_size(),
                     ref=self.ref_model.state_dict() if self.ref_model is not None else None)
        if self.estimate is not None:  # --alloc adaptive: the per-prompt estimate of Q
            state["estimate"] = self.estimate.state_dict()
        if self.main:
            save_atomic(self.replica, self.tok, self.cfg, state, self.out / "ckpt")

    def finish(self) -> list:
        self.metrics_file.close()
        self.report.close()
        if self.lock:
            self.lock.release()
        stop_on_ctrl_c("")  # Python's own handling again
        first, last = self.rows[0], self.rows[-1]
        if "eval_pass@1" in last:
            self.say(f"held-out pass@1 {first['eval_pass@1']:.3f} -> {last['eval_pass@1']:.3f}, "
                     f"pass@k {first['eval_pass@k']:.3f} -> {last['eval_pass@k']:.3f}; wrote {self.out}")
        distributed.teardown()
        return self.rows


def start(cfg) -> Run:
    """Set a training run up: seeds, processes, data, the policy (--resume: the checkpoint's; --init_from:
    that run's policy), a LoRA adapter, --grad_ckpt, the memory plan (lowers max_rows and micro_batch to
    fit), the run directory, locked, and K > 1: the model sharded with a full replica beside it. Every
    refusal comes before the run directory is touched; config.json is written by Run.restore."""
    report.require(cfg.report_to)  # a missing dashboard package: one line, before any work
    stop_on_ctrl_c("interrupted before the run began: nothing written")
    if cfg.loss == "gspo" and aggregation(cfg.loss, cfg.loss_agg) != "sequence" and distributed.is_main():  # said first
        print(f"note: --loss gspo with --loss_agg {cfg.loss_agg}: not GSPO's per-sequence mean (--loss_agg sequence, "
              "gspo's default)")
    ckpt = surviving_checkpoint(Path(cfg.resume)) if cfg.resume else None  # ckpt/, or what a crash in its save left
    state = read_trainer_state(ckpt, cfg) if ckpt else None
    say = tqdm.write if distributed.is_main() else (lambda line: None)
    rows = read_metrics(Path(cfg.resume), state["step"], say) if ckpt else []  # rows logged after it are redone
    init = checkpoint_dir(cfg.init_from) if cfg.init_from else None  # weights (and AdamW's moments) from there
    if cfg.init_optimizer and not (init / "trainer_state.pt").is_file():
        fail(f"--init_optimizer: {init} holds no trainer_state.pt (a policy alone has no AdamW state)")
    flag = "--resume" if ckpt else "--init_from" if init else "--model"
    policy = str(ckpt or init or cfg.model)
    cfg, device, train_set, eval_set, model, tok, longest = setup(cfg, policy, flag)
    if init:  # config.json names the weights the run began from
        cfg = dataclasses.replace(cfg, model=str(init))
    if cfg.lora_rank and not is_lora(model):  # (a LoRA checkpoint is loaded with its adapter)
        model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets)
    if cfg.grad_ckpt:
        enable_grad_ckpt(model)
    cfg = planner.plan_memory(cfg, model.config, tok, train_set, device, prompt_tokens=longest)
    out, lock = make_run_dir(cfg, resume_from=ckpt, fresh=not cfg.resume)  # (no ckpt: from step 0)
    stop_on_ctrl_c(f"interrupted: {out} keeps its last checkpoint, if it has one (--resume {out} continues from it)")
    dtype = compute_dtype(cfg, device)
    say(json.dumps(dataclasses.asdict(cfg), indent=1))
    say(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M params "
        f"({sum(p.numel() for p in trainable(model)) / 1e6:.3f}M trained), {device}, {dtype}, "
        f"{distributed.world_size()} process(es); train {len(train_set)} prompts, eval {len(eval_set)}; "
        f"verifier {cfg.verifier}; run dir {out}")
    if cfg.task in ("keys", "sets"):  # the tasks whose held-out set is their training set, by design
        say(f"task {cfg.task}: evaluated on {len(eval_set)} of its own training prompts, by design "
            "(Theorem 1 is per prompt; data.py)")
    # K > 1: the model's parameters, gradients and AdamW state are sharded (FSDP2); a full replica
    # samples the rollouts and is what is evaluated and saved. K = 1: the replica is the model.
    model, replica = distributed.shard(model, dtype)
    return Run(cfg, device, train_set, eval_set, model, replica, tok, out, lock, state, rows)


def read_trainer_state(ckpt: Path, cfg) -> dict:
    """A checkpoint's trainer_state.pt (CPU tensors: generator states must be; the optimizer and the reference
    move theirs to the device), read before anything else: an unreadable one, or a --steps below its step
    (nothing to train; the run would only rewrite its config), stops with one line."""
    path = ckpt / "trainer_state.pt"
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        step = state["step"]
        if missing := {"keep_est", "q_start", "opt", "rng", "gen_cpu"} - set(state):
            raise ValueError(f"it lacks {sorted(missing)}")
    except Exception as e:  # a cut-short zip, a pickle error, another file renamed: the message is what matters
        fail(f"--resume {cfg.resume}: {path} is unreadable ({str(e).splitlines()[0][:120] if str(e) else type(e).__name__})")
    if cfg.steps <= step:
        fail(f"--steps {cfg.steps} with --resume {cfg.resume}: its checkpoint is at step {step} already "
             f"(--steps counts from the run's start: give more than {step} to continue it)")
    return state


def stop_on_ctrl_c(note: str):
    """Ctrl-C ends the run with one line (`note`: what survives) and exit status 130, no traceback; the
    crash-safe checkpoint and metrics make any moment safe. An empty note restores Python's handling."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread may set a handler
        return

    def interrupted(signum, frame):
        if distributed.is_main():
            tqdm.write(note, file=sys.stderr)
        sys.exit(130)
    signal.signal(signal.SIGINT, interrupted if note else signal.default_int_handler)


def load_optimizer(model, opt, state: dict, cfg, source: str):
    """AdamW's moments and step counts from a checkpoint's state. Its learning rate and weight decay are
    this run's: the saved param groups hold the values of the run that wrote them, which would otherwise
    override --lr and --weight_decay silently."""
    if state.get("world_size", 1) != distributed.world_size():  # AdamW's state is laid out per K
        fail(f"{source}: its checkpoint was written by {state.get('world_size', 1)} process(es), "
             f"this run has {distributed.world_size()}: use the same number")
    distributed.load_optimizer_state(model, opt, state["opt"])
    for group in opt.param_groups:
        group.update(lr=cfg.lr, weight_decay=cfg.weight_decay)


# ----------------------------------------------------------------------------
# --plan and --eval_only


def plan(cfg) -> list:
    """--plan: the memory plan from the model's config and tokenizer, loading no weights: on one
    device, then per rank of 8 (torchrun)."""
    name = str(surviving_checkpoint(Path(cfg.resume)) or cfg.model) if cfg.resume else cfg.model
    device = distributed.pick_device(cfg.device)
    train_set = load_data(cfg, "--task", cfg.task, "train", cfg.seed)
    if (Path(name) / "metrics.jsonl").is_file():  # a run directory: its checkpoint, or one line
        name = str(checkpoint_dir(name, "--model"))
    name, revision = split_revision(name)
    try:
        model_config = AutoConfig.from_pretrained(name, revision=revision)
        tok = AutoTokenizer.from_pretrained(name, revision=revision)
    except (OSError, ValueError) as e:
        fail(f"--model {name}: could not load its config and tokenizer ({str(e).splitlines()[0]})")
    positions = getattr(model_config, "max_position_embeddings", None)  # every prompt planned for
    train_set, longest = fit_context(cfg, train_set, f"--task {cfg.task}: training",
                                     cfg.max_new_tokens, tok, positions)
    plan_k = lambda **k: planner.plan_memory(cfg, model_config, tok, train_set, device,
                                             report_only=True, prompt_tokens=longest, **k)
    plan_k()
    if distributed.world_size() == 1:  # and as `torchrun --nproc_per_node=8` would run it, per rank
        print()
        plan_k(world_size=8)
    return []


def eval_only(cfg, evaluate) -> dict:
    """--eval_only: the held-out evaluation of --model by `evaluate` (brorl.evaluate), drawn exactly as a
    run's step-0 evaluation (same eval set, same random stream). No optimizer, no reference, nothing
    written but eval.json. With K processes each samples its share of the prompts and rank 0 writes."""
    stop_on_ctrl_c("interrupted: no eval.json written")
    cfg, device, _, eval_set, model, tok, _ = setup(cfg, cfg.model, "--model", with_train_set=False)
    out, lock = make_run_dir(cfg, fresh=False)  # eval.json may go beside a run's files
    t0 = time.perf_counter()
    with torch.no_grad(), autocast(cfg, device):
        m = evaluate(model.eval(), tok, eval_set, cfg, eval_generator(device, cfg.seed, 0))
        m.update(mass.exact_mass(model, tok, mass.prompt_set(cfg, eval_set), cfg))  # the testbed's zones
    report = eval_report(cfg, {cfg.eval_task or cfg.task: m}, len(eval_set), time.perf_counter() - t0)
    if distributed.is_main():
        write_eval(out / "eval.json", report)
        print(eval_table(report))
        if "mass_exact_mean" in m:
            print(f"exact correct mass at T = {cfg.temperature} (lib/mass.py), {len(m['mass_exact_log10'])} prompts: mean Q "
                  f"{m['mass_exact_mean']:.4g}, median log10 Q {m['mass_exact_log10_median']:.2f}; Q >= 1/{cfg.gate_small_n}: "
                  f"{m['mass_exact_high']}, gate: {m['mass_exact_gate']}, Q < 1/{cfg.gate_large_n}: {m['mass_exact_low']}")
        lock.release()
    stop_on_ctrl_c("")
    distributed.teardown()
    return report
