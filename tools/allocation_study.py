"""
allocation_study.py: --alloc adaptive against uniform breadth, at equal CPU seconds. Every run is a
`python brorl.py` in a subprocess, one thread (OMP_NUM_THREADS=1, tools/ablate.py's thread_env),
from the shipped warm start, trained for --budget seconds of process CPU time (--budget_clock cpu:
another job's load cannot shorten it), evaluated at its start and its end only. Three arms with
B x N = 512, on the keys task (one right answer a prompt) and the sets task (16 right values a
prompt, each rare), --seeds a arm. Only adaptive draws exactly 512 rollouts a step: a uniform round
asks for ceil(B / keep rate) prompts, at most 4B, and further rounds follow until B groups survive
(in the committed runs a median of about 1,300-1,600 rollouts a step at N = 16, 1,024 at N = 512):

  adaptive  --alloc adaptive, B = 32 candidates, R = 512 a step, 4 <= n <= 256 (one round a step)
  N=16      uniform N = 16, B = 32 (B x N = R; dynamic sampling draws more rounds to fill B)
  N=512     uniform N = 512, B = 1 (B x N = R)

Measured per run, from its metrics.jsonl: the change of the mean exact Q over the run
(mass_exact_mean, lib/mass.py; train = eval on both tasks: every training prompt is measured), per
1,000 rollouts drawn and per CPU second of training; gate prompts lifted (1/512 <= Q < 1/16 at
the start, >= 1/16 at the end); the prompts no rollout ever got right during the run
(sampled_right) and the mean change of their log10 Q; informative groups (rewards not all equal)
per 1,000 rollouts. Arms share no random
draws, so they are compared unpaired: the exact Mann-Whitney test and Welch's t on the per-seed
values (tools/theorem1_study.py's). Raw results: each run's metrics.jsonl, copied to
assets/allocation/<task>/<arm>/seed<S>.jsonl as it ends; a rerun skips the runs whose raw file
exists.

CPU: about 45 CPU s a run with the defaults (30 s of training, start-up and two evaluations),
30 runs: about 25 CPU minutes; --jobs 2 runs two at once.

  python -m tools.allocation_study --out runs/allocation # both tasks, 5 seeds
  python -m tools.allocation_study --report              # tables and figure from the raw files
"""

import argparse
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lib import mass
from lib.config import fail
from tools import ablate
from tools.theorem1_study import mann_whitney, welch

HERE = Path(__file__).resolve().parent.parent
RAW = HERE / "assets" / "allocation"
ARMS = {  # name: flags; B x N (adaptive: R) = 512 in every arm
    "adaptive": ["--alloc", "adaptive", "--prompts_per_step", "32", "--rollout_budget", "512",
                 "--min_rollouts", "4", "--max_rollouts", "256"],
    "N=16": ["--n_rollouts", "16", "--prompts_per_step", "32"],
    "N=512": ["--n_rollouts", "512", "--prompts_per_step", "1"],
}
# the preset, and what the study leaves out of its evaluations (the sets task's answer table)
TASKS = {
    "keys": ["--preset", "keys"],
    "sets": ["--preset", "sets", "--answer_prompts", "0"],
}
COMMON = ["--lr", "2e-4", "--save", "0", "--steps", "100000", "--eval_every", "100000",
          "--probe_prompts", "4", "--probe_samples", "64", "--budget_clock", "cpu"]


def run(task: str, arm: str, seed: int, budget: float, out: Path, raw: Path) -> str:
    """One run, unless its raw file exists; its metrics.jsonl (the argv on its first row) copied to
    the raw file when it ends. Returns a line saying what happened."""
    target = raw / task / arm / f"seed{seed}.jsonl"
    if target.is_file():
        return f"{task} {arm} seed {seed}: done before"
    run_dir = out / task / arm / f"seed{seed}"
    argv = [*TASKS[task], *COMMON, *ARMS[arm], "--seed", str(seed), "--time_budget", str(budget),
            "--out", str(run_dir)]
    log = run_dir.parent / f"seed{seed}.log"
    code = ablate.run_to_raw(argv, run_dir, target, log)
    if code != 0:
        return f"{task} {arm} seed {seed}: failed (exit {code}), {log}"
    return f"{task} {arm} seed {seed}: python brorl.py {' '.join(argv)}"


# ----------------------------------------------------------------------------
# The report: from the raw files alone


def measures(rows: list, arm: str) -> dict:
    """A run's measures (the module docstring's), from its rows."""
    first, last = rows[0], [r for r in rows if "mass_exact_mean" in r][-1]
    steps = [r for r in rows if r["step"] > 0]
    rollouts = sum(r["samples"] for r in steps)
    cpu = last["time_train_cpu"]
    n = dict(zip(ARMS[arm][::2], ARMS[arm][1::2]))
    # informative groups a step: keep_rate x groups drawn (uniform: samples / N; adaptive: B)
    drawn = lambda r: (int(n["--prompts_per_step"]) if arm == "adaptive"
                       else r["samples"] / int(n["--n_rollouts"]))
    informative = sum(r["keep_rate"] * drawn(r) for r in steps)
    q0, q1 = first["mass_exact_log10"], last["mass_exact_log10"]
    zone = lambda x: mass.zone(x, 16, 512)
    dq = last["mass_exact_mean"] - first["mass_exact_mean"]
    m = {"steps": len(steps), "rollouts": rollouts, "cpu_s": cpu, "dQ": dq,
         "dQ_per_1k": 1000 * dq / max(rollouts, 1), "dQ_per_cpu_s": dq / max(cpu, 1e-9),
         "gate_lifted": sum(zone(a) == "gate" and zone(b) == "high" for a, b in zip(q0, q1)),
         "informative_per_1k": 1000 * informative / max(rollouts, 1)}
    if "mass_exact_prompts" in first and all("sampled_right" in r for r in steps):
        right = {p for r in steps for p in r["sampled_right"]}
        never = [i for i, p in enumerate(first["mass_exact_prompts"]) if p not in right]
        m["never_right"] = len(never)
        m["never_right_dlog10"] = statistics.mean(q1[i] - q0[i] for i in never) if never else 0.0
    return m


def read(raw: Path) -> dict:
    """{task: {arm: {seed: measures}}} from the raw files; none: one line."""
    runs = {task: {arm: seeds for arm, seeds in arms.items() if arm in ARMS}
            for task, arms in ablate.read_raw(raw).items() if task in TASKS}
    if not any(runs.values()):
        fail(f"--raw {raw}: no raw files of this study to report on "
             "(<raw>/<task>/<arm>/seed<S>.jsonl); run it first")
    for task, arms in runs.items():
        for arm, seeds in arms.items():
            for seed, rows in seeds.items():
                if not any("mass_exact_mean" in r for r in rows):
                    fail(f"--raw {raw}: {task}/{arm}/seed{seed}.jsonl holds no row with the "
                         "exact Q (mass_exact_mean): not a run of this study")
    return {task: {arm: {seed: measures(rows, arm) for seed, rows in seeds.items()}
                   for arm, seeds in arms.items()} for task, arms in runs.items()}


KEYS = ["steps", "rollouts", "cpu_s", "dQ", "dQ_per_1k", "dQ_per_cpu_s", "gate_lifted",
        "never_right", "never_right_dlog10", "informative_per_1k"]


def fmt(x: float) -> str:
    return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.0f}"


def report(raw: Path) -> str:
    """The tables: per task, each arm's mean (sd) over seeds of every measure, the seeds, and the
    tests of adaptive against each uniform arm."""
    lines = []
    for task, arms in read(raw).items():
        lines += [f"### {task}", "", "| arm | seeds | " + " | ".join(KEYS) + " |",
                  "|---|---|" + "---|" * len(KEYS)]
        for arm, seeds in arms.items():
            cells = []
            for k in KEYS:
                xs = [m[k] for m in seeds.values() if k in m]
                sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
                cells.append(f"{fmt(statistics.mean(xs))} ({fmt(sd)})" if xs else "-")
            seed_list = ",".join(map(str, sorted(seeds)))
            lines.append(f"| {arm} | {seed_list} | " + " | ".join(cells) + " |")
        lines += ["", "| measure | adaptive vs | diff of means | Welch t, p | Mann-Whitney p |",
                  "|---|---|---|---|---|"]
        a = arms.get("adaptive", {})
        for other in [x for x in arms if x != "adaptive"]:
            for k in ("dQ", "dQ_per_1k", "dQ_per_cpu_s", "gate_lifted", "never_right",
                      "never_right_dlog10", "informative_per_1k"):
                xs = [m[k] for m in a.values() if k in m]
                ys = [m[k] for m in arms[other].values() if k in m]
                if len(xs) < 2 or len(ys) < 2:
                    continue
                t, p = welch(xs, ys)
                diff = statistics.mean(xs) - statistics.mean(ys)
                lines.append(f"| {k} | {other} | {fmt(diff)} | {t:.2f}, {p:.3f} | "
                             f"{mann_whitney(xs, ys):.3f} |")
        lines.append("")
    return "\n".join(lines)


def figure(raw: Path, path: Path):
    """Per task: each seed's mean exact Q gained per CPU second and informative groups per 1,000
    rollouts, by arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    data = read(raw)
    fig, axes = plt.subplots(len(data), 2, figsize=(9, 3.2 * len(data)), squeeze=False)
    for row, (task, arms) in zip(axes, data.items()):
        titles = ("mean exact Q gained per CPU s", "informative groups / 1k rollouts")
        for ax, key, title in zip(row, ("dQ_per_cpu_s", "informative_per_1k"), titles):
            for i, (arm, seeds) in enumerate(arms.items()):
                ys = [m[key] for m in seeds.values()]
                ax.scatter([i] * len(ys), ys, alpha=0.7)
                ax.hlines(statistics.mean(ys), i - 0.25, i + 0.25, color="k")
            ax.set_xticks(range(len(arms)), list(arms))
            ax.set_title(f"{task}: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/allocation", help="run directories")
    p.add_argument("--raw", default=str(RAW), help="raw results (each run's metrics.jsonl)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=list(TASKS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4])
    p.add_argument("--budget", type=float, default=30.0, help="CPU seconds of training a run")
    p.add_argument("--jobs", type=int, default=1, help="runs at once (each one thread)")
    p.add_argument("--report", action="store_true", help="tables and figure from the raw files")
    args = p.parse_args(argv)
    raw = Path(args.raw)
    # Every flag and every raw file already there checked before any run.
    ablate.finite_positive("--budget", args.budget)  # 0 would be no budget: 100,000 steps
    if args.jobs < 1:
        fail(f"--jobs {args.jobs}: need >= 1")
    if bad := [s for s in args.seeds if s < 0]:
        fail(f"--seeds: {bad[0]}: need seeds >= 0")
    if args.report:  # over raw files that exist, into --raw
        read(raw)
    ablate.writable_dir("--raw", raw, files=("report.md", "figure.png"))
    if not args.report:
        ablate.writable_dir("--out", Path(args.out))
        ablate.read_raw(raw)
        # seed by seed, every arm of a seed before the next seed: a study cut short stays balanced
        todo = [(t, a, s) for s in args.seeds for t in args.tasks for a in ARMS]
        with ThreadPoolExecutor(args.jobs) as pool:
            for line in pool.map(lambda x: run(*x, args.budget, Path(args.out), raw), todo):
                print(line, flush=True)
    text = report(raw)
    print(text)
    (raw / "report").with_suffix(".md").write_text(text)  # the tables, as printed
    figure(raw, raw / "figure.png")


if __name__ == "__main__":
    main()
