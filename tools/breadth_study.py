"""
breadth_study.py: the breadth study on the keys task (data.py), from the shipped warm start
assets/tiny-keys, every run a `python brorl.py` through tools/ablate.py, single-threaded, on equal
budgets of process CPU seconds. Three sweeps of three arms, each arm --seeds times:

  arms      ProRL's shape  N = 16,  B = 16, lr 2e-4            (256 rollouts a step before dynamic sampling)
            BroRL's shape  N = 512, B = 4,  lr 2e-4 x sqrt(8)  (the paper's rule: lr ~ sqrt(samples a step))
            BroRL's shape  N = 512, B = 4,  lr 2e-4            (the control's lr)
  warm      from the warm start, --budget_warm CPU s (about 300 steps of the N = 16 arm)
  mid       from the base run's checkpoint at the last --base_every step where the gate still held
            >= 30 prompts, --budget_branch CPU s (the revival question, while there is mass to revive)
  late      from the base run's step --base_steps checkpoint, --budget_branch CPU s (what is left)

The base run is ProRL's shape, seed 0, from the warm start, --base_steps steps, run in chunks of
--base_every steps (resumed bit-exactly between them; tools/study.py's ChunkedRun), its checkpoint
at each chunk's end kept as <out>/base/ckpt-<step>. Every run logs the exact correct mass of
all 512 prompts at its first and last evaluation (lib/mass.py); each sweep's <out>/<sweep>/summary.md and .json
(tools/ablate.py) holds the per-arm measures (mean exact Q; gate prompts lifted above 1/16; prompts
>= 1/16 lost; the median change of log10 Q of the prompts below the gate; keep rate, sampling rounds,
rollouts per step), the per-seed paired t and sign tests, the per-prompt test (secondary), and every
run's per-prompt log10 Q at start and end. Rerunning the command skips what is done (a killed run
restarts). <out>/study.png: log10 Q before and after per arm, the gate shaded.

CPU: about 1.5 CPU hours with the defaults (5 seeds): 4,250 CPU s of training by the budgets (the base run
202, each warm-start run 150, each branch 60), plus ~20 CPU s of start-up and evaluations a run (measured on a
2-core x86_64 with torch 2.13); --jobs 2 halves the wall time on a machine with 2 free cores.

  python -m tools.breadth_study --out runs/breadth
  python -m tools.breadth_study --out runs/breadth --only warm --seeds 0 1   # one sweep, fewer seeds
"""

import argparse
import json
import math
import sys
from pathlib import Path

from lib import mass
from lib.errors import fail
from tools import ablate, study

HERE = Path(__file__).resolve().parent.parent
ARMS = ["n_rollouts=16,512,512", "prompts_per_step=16,4,4", f"lr=2e-4,{2e-4 * math.sqrt(8):.4g},2e-4"]
COMMON = ["--preset", "keys", "--budget_clock", "cpu", "--steps", "100000", "--eval_every", "100000", "--save", "0"]


def base_run(out: Path, steps: int, every: int) -> study.ChunkedRun:
    """ProRL's shape from the warm start, seed 0, a chunked run (tools/study.py) of `every` steps a
    chunk (--resume between them is bit-exact), its checkpoint at each chunk's end kept as
    <out>/base/ckpt-<step>; a rerun goes on from the last recorded chunk."""
    flags = ["--preset", "keys", "--n_rollouts", "16", "--prompts_per_step", "16", "--lr", "2e-4",
             "--eval_every", str(every), "--seed", "0"]
    return study.ChunkedRun("base run", out / "base" / "run", flags, every, steps,
                            out / "base" / "chunks.jsonl",
                            lambda step: out / "base" / f"ckpt-{step:04d}",
                            out / "base" / "run.log", keep_copies=True)


def base_masses(run: study.ChunkedRun, steps: int, every: int) -> dict:
    """The base run brought to `steps`; {step: log10 Q per prompt} at each kept checkpoint."""
    done = run.done()
    while done < steps:
        done = run.advance(done)
    return {r["step"]: r["mass_exact_log10"] for r in run.rows(steps)
            if "mass_exact_log10" in r and r["step"] % every == 0}


def sweep(name: str, out: Path, budget: float, seeds: list, jobs: int, init_from: str = "") -> dict:
    """One sweep of the three arms through tools/ablate.py; its summary (the arms against ProRL's shape)."""
    argv = ["--grid", *ARMS, "--seeds", *map(str, seeds), "--jobs", str(jobs), "--out", str(out / name),
            "--time_budget", str(budget), *COMMON, *(["--init_from", init_from] if init_from else [])]
    print(f"{name}: python -m tools.ablate {' '.join(argv)}", flush=True)
    return ablate.main(argv)


def gate_count(log10_q: list, small_n=16, large_n=512) -> int:
    return sum(mass.zone(x, small_n, large_n) == "gate" for x in log10_q)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.breadth_study", description=__doc__.strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/breadth", help="study directory (default: runs/breadth)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds per arm (default 0..4)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each (default 1)")
    ap.add_argument("--budget_warm", type=float, default=150.0, help="CPU s a run from the warm start (default 150)")
    ap.add_argument("--budget_branch", type=float, default=60.0, help="CPU s a branch (default 60)")
    ap.add_argument("--base_steps", type=int, default=300, help="the base run's steps (default 300)")
    ap.add_argument("--base_every", type=int, default=50, help="its checkpoint copied every this many steps (default 50)")
    ap.add_argument("--only", choices=["warm", "base", "mid", "late"], nargs="+", default=["warm", "mid", "late"],
                    help="the sweeps to run (default all three; base: the base run alone)")
    args = ap.parse_args(argv)
    # Every flag and folder checked before anything is made or run.
    if (args.jobs < 1 or args.budget_warm <= 0 or args.budget_branch <= 0
            or not 1 <= args.base_every <= args.base_steps):
        fail("need --jobs >= 1, budgets > 0 and 1 <= --base_every <= --base_steps")
    study.check_seeds(args.seeds)
    study.check_distinct("--only", args.only)
    out = Path(args.out)
    study.check_folder("--out", out, files=("study.json", "study.png"))
    run = base_run(out, args.base_steps, args.base_every)
    if {"base", "mid", "late"} & set(args.only):
        run.check()
    study.make_folders(out)
    with study.DriverLock(out):  # one driver at a time on --out
        results = {}
        if "warm" in args.only:
            results["warm"] = sweep("warm", out, args.budget_warm, args.seeds, args.jobs)
        if {"base", "mid", "late"} & set(args.only):
            base = base_masses(run, args.base_steps, args.base_every)
            held = [s for s, q in sorted(base.items()) if gate_count(q) >= 30]
            mid = max(held, default=None)
            print("base run, prompts in the gate: " + ", ".join(
                f"step {s}: {gate_count(q)}" for s, q in sorted(base.items())))
            if "mid" in args.only:
                if mid is None:
                    sys.exit("error: no base checkpoint holds 30 prompts in the gate: nothing to "
                             "branch the revival from")
                results["mid"] = sweep("mid", out, args.budget_branch, args.seeds, args.jobs,
                                       str(out / "base" / f"ckpt-{mid:04d}"))
            if "late" in args.only:
                results["late"] = sweep("late", out, args.budget_branch, args.seeds, args.jobs,
                                        str(out / "base" / f"ckpt-{args.base_steps:04d}"))
        (out / "study.json").write_text(json.dumps(results, indent=1, default=str))
        plot_study(results, out / "study.png")
    print(f"wrote {out / 'study.png'}")


def plot_study(results: dict, path: Path):
    """Per sweep, per arm: each prompt's log10 Q at the start against the end (all seeds), the gate shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    sweeps = [(name, r) for name, r in results.items() if r]
    if not sweeps:
        return
    arms = max(len(r["configs"]) for _, r in sweeps)
    fig, axes = plt.subplots(len(sweeps), arms, figsize=(4 * arms, 3.6 * len(sweeps)), squeeze=False)
    lo, hi = -math.log10(512), -math.log10(16)
    for row, (name, r) in zip(axes, sweeps):
        for ax, (label, c) in zip(row, r["configs"].items()):
            for run in c["runs"].values():
                if "log10_q_start" in run:
                    ax.scatter(run["log10_q_start"], run["log10_q_end"], s=2, alpha=0.25, color="C0")
            ax.axvspan(lo, hi, color="orange", alpha=0.15, lw=0)
            ax.axhspan(lo, hi, color="orange", alpha=0.15, lw=0)
            ax.plot([-8, 0], [-8, 0], color="gray", lw=0.8)
            ax.set(xlim=(-8, 0.1), ylim=(-8, 0.1), xlabel="log10 Q, start", ylabel="log10 Q, end")
            ax.set_title(f"{name}: {label.replace(',prompts_per_step=', ' B=').replace('n_rollouts=', 'N=')}", fontsize=8)
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


if __name__ == "__main__":
    main()
