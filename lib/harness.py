"""
harness.py: the run machinery around the algorithm in brorl.py. The command line (every Config
field is a --flag, presets, --resume), the run directory (config.json, metrics.jsonl, metrics.png),
the one log line per step, and checkpoints written so that a crash never leaves a half-written one.
It imports nothing of ours: brorl.py hands it its Config class and presets.
"""

import argparse
import dataclasses
import inspect
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import torch


def fail(msg: str):
    """Stop the run with one line naming what was wrong (exit status 2, as argparse)."""
    print(f"error: {msg}", file=sys.stderr)
    sys.exit(2)


# ----------------------------------------------------------------------------
# The command line: every field of the Config dataclass is a --flag, its source comment the --help


def field_help(config_cls) -> dict:
    """--help text for each field: the comment that follows it in the Config source."""
    src = inspect.getsource(config_cls)
    return dict(re.findall(r"^\s+(\w+): [^#\n]+#\s*(.+)$", src, flags=re.M))


def parse_bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "0", "false", "no"):
        return s.lower() in ("1", "true", "yes")
    raise argparse.ArgumentTypeError(f"{s!r} is not a boolean (true/false, yes/no, 1/0)")


def parse_config(config_cls, presets: dict, check, description: str, argv=None, fixed_on_resume=()):
    """Config from the command line: the preset's overrides, then the flags given. With --resume, the
    run's own config.json, then the flags given (e.g. --steps to extend it), except the flags in
    `fixed_on_resume`, whose value the checkpoint's restored state decides: changing one is refused, as
    it could not take effect. `check(cfg)` returns the first thing wrong as one line naming the flag, or ''."""
    parser = argparse.ArgumentParser(description=description)
    helps = field_help(config_cls)
    for f in dataclasses.fields(config_cls):
        # default=None marks "not given", so that a preset never overrides an explicit flag; the
        # help shows the real default (Config's), which a preset may change
        text = helps.get(f.name, "")
        if f.name == "preset":  # the names from the presets themselves, so the help never falls behind
            text += f"; one of {', '.join(presets)}"
        text += "" if "(default:" in text else f" (default: {'none' if f.default == '' else f.default})"
        kind = dict(type=parse_bool, nargs="?", const=True) if f.type is bool else dict(type=f.type)  # --flag alone: true
        parser.add_argument(f"--{f.name}", **kind, default=None, help=text.replace("%", "%%"),
                            metavar=f.type.__name__.upper())
    args = vars(parser.parse_args(argv))
    overrides = {k: v for k, v in args.items() if v is not None}
    preset = overrides.get("preset", "")
    if preset and preset not in presets:
        parser.error(f"--preset {preset!r}: unknown (choose from {sorted(presets)})")
    base = presets.get(preset, {})
    if overrides.get("resume"):
        run = Path(overrides["resume"])
        for need in (run / "config.json", run / "ckpt" / "trainer_state.pt"):
            if not need.is_file():
                parser.error(f"--resume {run}: no checkpoint to resume ({need} is missing)")
        if Path(overrides.get("out", run)) != run:
            parser.error(f"--out {overrides['out']} and --resume {run} name different runs")
        if preset:
            parser.error(f"--preset {preset} with --resume: a resumed run keeps its config; change single flags")
        base = json.loads((run / "config.json").read_text())
        if unknown := set(base) - {f.name for f in dataclasses.fields(config_cls)}:
            parser.error(f"--resume {run}: its config.json has fields this brorl.py does not know: {sorted(unknown)}")
        defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}  # a field newer than the run's
        for name in fixed_on_resume:
            if name in overrides and overrides[name] != base.get(name, defaults[name]):
                parser.error(f"--{name} {overrides[name]} with --resume {run}: the checkpoint fixes it "
                             f"({base.get(name, defaults[name])!r}); start a new run from it with --init_from")
        overrides["out"] = str(run)
    cfg = config_cls(**{**base, **overrides})
    problem = check(cfg)
    if problem:
        parser.error(problem)
    return cfg


# ----------------------------------------------------------------------------
# The run directory: config.json, metrics.jsonl (one dict per step), metrics.png, ckpt/


def make_run_dir(cfg) -> Path:
    out = Path(cfg.out or f"runs/{cfg.task.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}")
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        fail(f"--out {out}: cannot write there ({e.strerror})")
    return out


def open_metrics(out: Path, rows: list):
    """metrics.jsonl holding exactly `rows` (a resumed run's rows, whole or not at all), open to append."""
    (out / "metrics.jsonl.tmp").write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(out / "metrics.jsonl.tmp", out / "metrics.jsonl")
    return open(out / "metrics.jsonl", "a")


def read_metrics(out: Path, upto: int) -> list:
    """The rows of a run's metrics.jsonl up to step `upto` (rows logged after a checkpoint are redone)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r["step"] <= upto]


def log_line(m: dict) -> str:
    """The one line printed per step (README.md#what-you-will-see shows one; tests/test_docs.py checks it)."""
    line = (f"step {m['step']:4d} | reward {m['reward_mean']:.3f} | keep {m['keep_rate']:.2f} | "
            f"ent {m.get('entropy', 0):.3f} | clip {m.get('clip_frac', 0):.3f} | "
            f"|r-1| {m.get('max_ratio_dev', 0):.1e} drift {m.get('drift_max', 0):.1e} | len {m['resp_len']:.1f} | "
            f"{m['tokens_per_s']:.0f} tok/s | roll {m['time_rollout']:.2f}s upd {m['time_update']:.2f}s")
    if "eval_pass@1" in m:
        line += f" | eval pass@1 {m['eval_pass@1']:.3f} pass@k {m['eval_pass@k']:.3f} Q {m['mass_mean']:.3f}"
    return line


PLOTS = [("reward_mean", "train reward"), ("eval_pass@1", "held-out pass@1 (T=0.6)"),
         ("eval_pass@k", "held-out pass@k (k = eval samples)"), ("keep_rate", "dynamic-sampling keep rate"),
         ("entropy", "token entropy"), ("resp_len", "response length"),
         ("mass_mean", "probe correct mass Q"), ("kl", "k2 KL to reference (0 if off)")]


def plot_metrics(rows, path: Path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, 4, figsize=(16, 6.5))
    for ax, (key, title) in zip(axes.flat, PLOTS):
        pts = [(r["step"], r[key]) for r in rows if key in r]
        if pts:
            ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, ms=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def save_atomic(model, tok, cfg, state: dict, path: Path):
    """Write the checkpoint into a temp dir, then swap it in: never a half-written checkpoint, and
    the previous one stays whole until the new one is. `state` is what --resume needs besides the
    policy: step, AdamW state, every random generator, the reference policy, the step-0 probe mass."""
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    (tmp / "brorl_config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=1))
    torch.save(state, tmp / "trainer_state.pt")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


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
    sampling = dict(temperature=0.6, top_p=0.95, samples=cfg.eval_samples,
                    max_new_tokens=cfg.eval_max_new_tokens or cfg.max_new_tokens, seed=cfg.seed)
    return dict(model=cfg.model, sampling=sampling, seconds=round(seconds, 2), benchmarks=benchmarks,
                config=dataclasses.asdict(cfg))


def write_eval(path: Path, report: dict):
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1) + "\n")
    os.replace(tmp, path)


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
