"""
revival_study.py: does breadth revive a run that more steps no longer improve? BroRL's headline
(docs/paper.md §1, §4): ProRL's training (N = 16) saturated, and continuing it at N = 512 improved
it again. Here, on a testbed where that can happen, in two phases, every run a `python brorl.py` in
a subprocess on one thread:

  trunk   ProRL's shape on a small fixed set: the sets task's 64 prompts whose answers are
          enumerated (--train_prompts 64), all of them every step (B = 64, one round), N = 16,
          until the plateau defined below, in chunks of --chunk steps (each chunk a --resume of the
          last: a killed trunk goes on from its last checkpoint), CPU seconds capped (--trunk_cap).
          At the plateau the run's checkpoint is the branch point.
  arms    from that checkpoint (--init_from, its AdamW moments too), every arm one run a seed:
            prorl     N = 16, B = 64: ProRL continued
            n512      N = 512 at equal B, steps, lr and mini-batches
            n512-lr   N = 512 at the paper's lr rule, lr x sqrt(32) (32x the samples a step)
            n16-long  N = 16 for as many rollouts as n512 (32x its steps): the cost comparison
            focal     N = 16 with F-GRPO's focal weight (--focal_gamma 1)
          The arms share the trunk (one branch point); their seeds draw their own rollouts.

The plateau, defined before the trunk ran: at an eval step s >= --window, the ordinary least
squares slope of the exact mean Q over the trunk's 64 prompts (answers_q: every answer's
probability, lib/answers.py) against the step, over the evals in (s - --window, s], has a 95%
interval (Student's t) that contains 0 and lies within +-0.01 per 100 steps. The reach window:
1/2048 <= Q < 1/16, where N = 512 draws a right answer in most steps and N = 16 rarely.

Raw files, committed as they land: assets/revival/trunk/metrics.jsonl (the trunk so far, rewritten
after each chunk), assets/revival/trunk/chunks.jsonl (each chunk's steps and CPU seconds),
assets/revival/plateau.json (the branch point: its step, the slope and its interval, the window
count), assets/revival/arms/<arm>/seed<S>.jsonl (each arm run's metrics.jsonl, argv in its first
row). --report reads them alone: the page's numbers (assets/revival/report.md) and the figure
(assets/revival/revival.png). The reading: docs/results/revival.md.

  python -m tools.revival_study --out runs/revival                  # trunk, then every arm
  python -m tools.revival_study --out runs/revival --only trunk     # the trunk and its plateau
  python -m tools.revival_study --report                            # tables and figure
"""

import argparse
import json
import math
import resource
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from tools import ablate

HERE = Path(__file__).resolve().parent.parent
RAW = HERE / "assets" / "revival"
N_PROMPTS = 64  # the testbed: the sets task's first 64 eval prompts (their answers enumerated)
# The trunk's flags, ProRL's shape on the fixed set: N = 16, all 64 prompts every step.
TRUNK = ["--preset", "sets", "--train_prompts", str(N_PROMPTS), "--eval_prompts", str(N_PROMPTS),
         "--answer_prompts", str(N_PROMPTS), "--prompts_per_step", str(N_PROMPTS), "--max_rounds",
         "1", "--n_rollouts", "16", "--lr", "2e-4", "--eval_samples", "4", "--probe_prompts", "4",
         "--probe_samples", "64", "--seed", "0", "--eval_every", "10"]
WINDOW = (1 / 2048, 1 / 16)  # the reach window of Q
SLOPE_BOUND = 0.01  # the plateau: the slope's 95% interval within +-this per 100 steps


def t_quantile(df: int, p: float = 0.975) -> float:
    """Student's t quantile by bisection on its CDF (ablate.betainc: the regularised incomplete
    beta)."""
    cdf = lambda t: 1 - 0.5 * ablate.betainc(df / 2, 0.5, df / (df + t * t)) if t > 0 else 0.5
    lo, hi = 0.0, 100.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if cdf(mid) < p else (lo, mid)
    return (lo + hi) / 2


def slope(xs: list, ys: list) -> tuple:
    """OLS slope of ys on xs and its 95% interval (Student's t, n - 2 degrees of freedom)."""
    n, mx, my = len(xs), statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = sum((y - my - b * (x - mx)) ** 2 for x, y in zip(xs, ys))
    se = math.sqrt(resid / (n - 2) / sxx)
    half = t_quantile(n - 2) * se
    return b, b - half, b + half


def plateau_test(rows: list, window: int) -> dict:
    """The plateau rule at the trunk's last eval: the slope of answers_q per 100 steps over the
    evals of the last `window` steps, its interval, and whether it holds."""
    evals = [r for r in rows if "answers_q" in r]
    last = evals[-1]["step"]
    if last < window:
        return dict(step=last, plateau=False)
    pts = [(r["step"], r["answers_q"]) for r in evals if r["step"] > last - window]
    b, lo, hi = (100 * v for v in slope(*zip(*pts)))
    return dict(step=last, slope_per_100=b, ci_low=lo, ci_high=hi, evals=len(pts),
                plateau=lo <= 0 <= hi and -SLOPE_BOUND <= lo and hi <= SLOPE_BOUND)


def zones(log10_q: list) -> dict:
    """How many prompts sit above, in and below the reach window."""
    lo, hi = (math.log10(w) for w in WINDOW)
    return dict(high=sum(q >= hi for q in log10_q), window=sum(lo <= q < hi for q in log10_q),
                below=sum(q < lo for q in log10_q))


def read_jsonl(path: Path) -> list:
    """A raw file's rows; one line naming the file if it cannot be read."""
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError) as e:
        sys.exit(f"revival_study: {path}: unreadable ({e}); delete it to rerun what wrote it")


def write_atomic(path: Path, text: str):
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def branch_point(rows: list, test: dict, window: int) -> dict:
    """The plateau's record: the rule's numbers, the reach-window count, and how the prompts below
    1/16 at the branch moved during the trunk (log10 Q at step 0 and at the branch, and the
    slope over the rule's window, decades per 100 steps)."""
    evals = [r for r in rows if "answers_log10_q_per_prompt" in r]
    first, last = evals[0]["answers_log10_q_per_prompt"], evals[-1]["answers_log10_q_per_prompt"]
    hi = math.log10(WINDOW[1])
    stuck = [i for i, q in enumerate(last) if q < hi]
    recent = [r for r in evals if r["step"] > test["step"] - window]
    moved = []
    for i in stuck:
        b = slope([r["step"] for r in recent],
                  [r["answers_log10_q_per_prompt"][i] for r in recent])[0] if len(recent) > 2 else 0
        moved.append(dict(prompt=i, log10_q_start=first[i], log10_q_branch=last[i],
                          decades_per_100=100 * b))
    return {**test, "answers_q": evals[-1]["answers_q"], "answers_q_start": evals[0]["answers_q"],
            "zones_start": zones(first), "zones_branch": zones(last), "stuck": moved,
            "go": zones(last)["window"] >= 8}


# ----------------------------------------------------------------------------
# The trunk


def trunk(out: Path, raw: Path, chunk: int, max_steps: int, cap: float, window: int) -> dict:
    """ProRL's shape until the plateau, in chunks, each a --resume of the last; the raw files
    rewritten after every chunk. Returns the plateau record, or {} if the trunk stopped first."""
    run_dir, log = out / "trunk", out / "trunk.log"
    chunks_file = raw / "trunk" / "chunks.jsonl"
    chunks = read_jsonl(chunks_file) if chunks_file.is_file() else []
    while True:
        rows = ablate.read_rows(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
        done = rows[-1]["step"] if rows else 0
        if rows and (run_dir / "ckpt").is_dir():
            test = plateau_test(rows, window)
            print(f"trunk step {done}: mean exact Q {rows[-1].get('answers_q', float('nan')):.4f}; "
                  f"plateau rule: {test}", flush=True)
            if test["plateau"]:
                record = {**branch_point(rows, test, window), "window": window}
                write_atomic(raw / "plateau.json", json.dumps(record, indent=1) + "\n")
                return record
        spent = sum(c["cpu_s"] for c in chunks)
        if done >= max_steps or spent >= cap:
            print(f"trunk: stopped without a plateau at step {done} ({spent:.0f} CPU s; "
                  f"--max_steps {max_steps}, --trunk_cap {cap})", flush=True)
            return {}
        target = min(done + chunk, max_steps)
        argv = (["--resume", str(run_dir), "--steps", str(target)] if rows else
                [*TRUNK, "--steps", str(target), "--out", str(run_dir)])
        print(f"trunk: python brorl.py {' '.join(argv)}", flush=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        with open(log, "a") as f:
            code = subprocess.run([sys.executable, str(HERE / "brorl.py"), *argv], stdout=f,
                                  stderr=subprocess.STDOUT, env=ablate.thread_env(1)).returncode
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if code != 0:
            sys.exit(f"revival_study: the trunk's chunk to step {target} failed (exit {code}): "
                     f"{log}")
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        chunks.append(dict(steps_to=target, cpu_s=round(cpu, 2)))
        write_atomic(chunks_file, "".join(json.dumps(c) + "\n" for c in chunks))
        rows = ablate.read_rows(run_dir)
        write_atomic(raw / "trunk" / "metrics.jsonl",
                     "".join(json.dumps({**r, "argv": TRUNK} if r["step"] == 0 else r) + "\n"
                             for r in rows))
        if (run_dir / "ckpt").is_dir():  # the branch point is the checkpoint at the plateau
            shutil.rmtree(out / "branch", ignore_errors=True)
            shutil.copytree(run_dir / "ckpt", out / "branch" / "ckpt")
            shutil.copy(run_dir / "config.json", out / "branch" / "config.json")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/revival", help="the runs' directory")
    ap.add_argument("--raw", default=str(RAW), help="the raw results' directory")
    ap.add_argument("--only", choices=("trunk", "arms"), default=None, help="one phase")
    ap.add_argument("--chunk", type=int, default=50, help="trunk steps between plateau tests")
    ap.add_argument("--max_steps", type=int, default=2000, help="the trunk's most steps")
    ap.add_argument("--trunk_cap", type=float, default=3600, help="the trunk's CPU seconds")
    ap.add_argument("--window", type=int, default=100, help="the plateau rule's steps")
    ap.add_argument("--report", action="store_true", help="tables and figure from the raw files")
    a = ap.parse_args(argv)
    for name in ("chunk", "max_steps", "window"):
        if getattr(a, name) < 1:
            ap.error(f"--{name} {getattr(a, name)}: need >= 1")
    if not (math.isfinite(a.trunk_cap) and a.trunk_cap > 0):
        ap.error(f"--trunk_cap {a.trunk_cap}: need a finite number of CPU seconds > 0")
    out, raw = Path(a.out), Path(a.raw)
    out.mkdir(parents=True, exist_ok=True)
    if a.only in (None, "trunk"):
        record = trunk(out, raw, a.chunk, a.max_steps, a.trunk_cap, a.window)
        print(json.dumps({k: v for k, v in record.items() if k != "stuck"}), flush=True)


if __name__ == "__main__":
    main()
