"""
allocation_study.py: --alloc adaptive against uniform breadth, at equal CPU seconds. Every run is a
`python brorl.py` in a subprocess, one thread (OMP_NUM_THREADS=1, tools/ablate.py's thread_env),
from the shipped warm start, trained for --budget seconds of process CPU time (--budget_clock cpu:
another job's load cannot shorten it), evaluated at its start, every 25 steps and at its end
(adaptive and its control draw 512 rollouts a step, so they meet at equal rollouts at each
evaluation). Four arms with
B x N = 512, on the keys task (one right answer a prompt) and the sets task (16 right values a
prompt, each rare), --seeds a arm:

  adaptive        --alloc adaptive, B = 32 candidates, R = 512 a step, 4 <= n <= 256 (one round)
  N=16-one-round  the control: the same one round of 32 candidates and 512 rollouts a step, each
                  given 16 (--alloc adaptive with 16 <= n <= 16: the allocation is all that differs)
  N=16            uniform N = 16, B = 32 (dynamic sampling draws more rounds to fill B)
  N=512           uniform N = 512, B = 1 (B x N = R)

Only adaptive and its control draw exactly 512 rollouts a step. A uniform round asks for
ceil(B / keep rate) prompts, at most 4B, and further rounds follow until B groups survive (in the
committed runs about 1,700 (keys) and 1,360 (sets) rollouts a step at N = 16, 1,030-1,290 at
N = 512); so
uniform with --max_rounds 1 would still draw up to 4B x N a step, which is why the control is
written as an allocation of 16 to every candidate. Both train on the groups that survive
dynamic sampling, without refilling.

Measured per run, from its metrics.jsonl: the change of the mean exact Q over the run
(mass_exact_mean, lib/mass.py; train = eval on both tasks: every training prompt is measured), per
1,000 rollouts drawn and per CPU second of training; gate prompts lifted (1/512 <= Q < 1/16 at
the start, >= 1/16 at the end); the prompts no rollout ever got right during the run
(sampled_right) and the mean change of their log10 Q; informative groups (rewards not all equal)
per 1,000 rollouts. Adaptive and its control draw the same candidates and seeds at a step of a
seed, the other arms share no random draws; all are compared unpaired: the exact Mann-Whitney
test and Welch's t on the per-seed values (tools/stats.py). Raw results: each run's
metrics.jsonl, copied to <raw>/<task>/<arm>/seed<S>.jsonl as it ends; a rerun skips the runs
whose raw file exists (so a rerun after a change of the code goes to a new --raw).

CPU: about 65 CPU s a run with the defaults (30 s of training, start-up and 3-7 evaluations),
4 arms x 2 tasks x 5 seeds = 40 runs: about 45 CPU minutes (printed before it starts); --jobs 2
runs two at once (the committed study: 22 minutes).

--speed S measures, without the study, rollouts per CPU second (one thread) of S training steps
of the adaptive arm, of the same arm with its rollouts sampled in one call per distinct n (how the
sampler was called before it took each prompt's own n), and of its control N=16-one-round, on
each task (--tasks; the study's other flags are refused with it).

  python -m tools.allocation_study --out runs/allocation-1call --raw assets/allocation-1call \
      --jobs 2                                            # 4 arms x 2 tasks x 5 seeds
  python -m tools.allocation_study --report --raw assets/allocation-1call  # tables, figure
  python -m tools.allocation_study --speed 8             # rollouts per CPU s, the three arms
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from lib import mass
from lib.errors import fail
from tools import study
from tools.stats import mann_whitney, welch

HERE = Path(__file__).resolve().parent.parent
RAW = HERE / "assets" / "allocation-1call"  # the first study: assets/allocation
ARMS = {  # name: flags; B x N (adaptive: R) = 512 in every arm
    "adaptive": ["--alloc", "adaptive", "--prompts_per_step", "32", "--rollout_budget", "512",
                 "--min_rollouts", "4", "--max_rollouts", "256"],
    "N=16-one-round": ["--alloc", "adaptive", "--prompts_per_step", "32", "--rollout_budget", "512",
                  "--min_rollouts", "16", "--max_rollouts", "16"],
    "N=16": ["--n_rollouts", "16", "--prompts_per_step", "32"],
    "N=512": ["--n_rollouts", "512", "--prompts_per_step", "1"],
}
# the preset, and what the study leaves out of its evaluations (the sets task's answer table)
TASKS = {
    "keys": ["--preset", "keys"],
    "sets": ["--preset", "sets", "--answer_prompts", "0"],
}
COMMON = ["--lr", "2e-4", "--save", "0", "--steps", "100000", "--eval_every", "25",
          "--probe_prompts", "4", "--probe_samples", "64", "--budget_clock", "cpu"]


def jobs(tasks: list, arms: list, seeds: list, budget: float, out: Path, raw: Path) -> list:
    """Every run, seed by seed, every arm of a seed before the next seed (a study cut short stays
    balanced); each one's metrics.jsonl (the argv on its first row) copied to its raw file when it
    ends."""
    return [study.Job(f"{task} {arm} seed {seed}",
                      [*TASKS[task], *COMMON, *ARMS[arm], "--seed", str(seed), "--time_budget",
                       str(budget), "--out", str(out / task / arm / f"seed{seed}")],
                      out / task / arm / f"seed{seed}", raw / task / arm / f"seed{seed}.jsonl",
                      out / task / arm / f"seed{seed}.log")
            for seed in seeds for task in tasks for arm in arms]


# ----------------------------------------------------------------------------
# The report: from the raw files alone


def measures(rows: list, arm: str) -> dict:
    """A run's measures (the module docstring's), from its rows."""
    first, last = rows[0], [r for r in rows if "mass_exact_mean" in r][-1]
    steps = [r for r in rows if r["step"] > 0]
    rollouts = sum(r["samples"] for r in steps)
    cpu = last["time_train_cpu"]
    n = dict(zip(ARMS[arm][::2], ARMS[arm][1::2]))
    # informative groups a step: keep_rate x groups drawn (uniform: samples / N; one round of
    # --alloc adaptive: B)
    drawn = lambda r: (int(n["--prompts_per_step"]) if n.get("--alloc") == "adaptive"
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
            for task, arms in study.read_raw(raw, groups=TASKS).items()}
    if not any(runs.values()):
        study.nothing_to_report(raw, "<raw>/<task>/<arm>/seed<S>.jsonl")
    for task, arms in runs.items():
        for arm, seeds in arms.items():
            for seed, rows in seeds.items():
                if not any("mass_exact_mean" in r for r in rows):
                    fail(f"--raw {raw}: {task}/{arm}/seed{seed}.jsonl holds no row with the "
                         "exact Q (mass_exact_mean): not a run of this study")
    return {task: {arm: {seed: study.measured(raw / task / arm / f"seed{seed}.jsonl", measures,
                                              rows, arm)
                         for seed, rows in seeds.items()}
                   for arm, seeds in arms.items()} for task, arms in runs.items()}


def compared(arms) -> list:
    """The pairs of arms a report tests: adaptive against every other arm, and its control against
    uniform N = 16 (is the one-round step what differs from it?); those present."""
    pairs = [("adaptive", x) for x in arms if x != "adaptive"] + [("N=16-one-round", "N=16")]
    return [(a, b) for a, b in pairs if a in arms and b in arms]


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
        lines += ["", "| measure | arm | vs | diff of means | Welch t, p | Mann-Whitney p |",
                  "|---|---|---|---|---|---|"]
        for arm, other in compared(arms):
            for k in ("dQ", "dQ_per_1k", "dQ_per_cpu_s", "gate_lifted", "never_right",
                      "never_right_dlog10", "informative_per_1k"):
                xs = [m[k] for m in arms[arm].values() if k in m]
                ys = [m[k] for m in arms[other].values() if k in m]
                if len(xs) < 2 or len(ys) < 2:
                    continue
                t, p = welch(xs, ys)
                diff = statistics.mean(xs) - statistics.mean(ys)
                lines.append(f"| {k} | {arm} | {other} | {fmt(diff)} | {t:.2f}, {p:.3f} | "
                             f"{mann_whitney(xs, ys):.3f} |")
        lines.append("")
    return "\n".join(lines)


def curve(rows: list) -> list:
    """A run's evaluations: (rollouts drawn, step, training CPU s, mean exact Q) at each."""
    out, drawn = [], 0
    for r in rows:
        drawn += r.get("samples", 0) if r["step"] > 0 else 0
        if "mass_exact_mean" in r:
            out.append((drawn, r["step"], r.get("time_train_cpu", 0.0), r["mass_exact_mean"]))
    return out


def at_rollouts(points: list, x: float):
    """The mean exact Q of a curve at x rollouts, linear between its evaluations (None past its
    last)."""
    for (x0, _, _, q0), (x1, _, _, q1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return q0 + (q1 - q0) * (x - x0) / max(x1 - x0, 1)
    return None


def equal_rollouts(raw: Path) -> str:
    """Every arm's change of mean exact Q at the rollouts adaptive and its control both reach:
    the last evaluated step S of every run of the two (both draw 512 a step, so 512 S rollouts
    each, measured at the same step); the uniform arms, whose steps draw unequal rollouts,
    interpolated linearly between their evaluations at 512 S. Tests of adaptive against each."""
    lines = []
    for task, arms in study.read_raw(raw, groups=TASKS).items():
        if not {"adaptive", "N=16-one-round"} <= set(arms):
            continue
        curves = {arm: {seed: study.measured(raw / task / arm / f"seed{seed}.jsonl", curve, rows)
                        for seed, rows in seeds.items()}
                  for arm, seeds in arms.items() if arm in ARMS}
        for arm, seeds in curves.items():
            for seed, c in seeds.items():
                if not c or c[0][1] != 0:
                    fail(f"--raw {raw}: {task}/{arm}/seed{seed}.jsonl has no evaluation at step 0 "
                         "(mass_exact_mean): no start to measure a change from")
        paired = [c for arm in ("adaptive", "N=16-one-round") for c in curves[arm].values()]
        S = max(set.intersection(*({s for _, s, _, _ in c if s > 0} for c in paired)), default=0)
        if not S:
            lines += [f"### {task}: no step after 0 evaluated in every run of adaptive and its "
                      "control", ""]
            continue
        x = 512 * S
        lines += [f"### {task}: at {x:,} rollouts (step {S} of adaptive and its control)", "",
                  "| arm | runs | dQ mean (sd) | training CPU s to there | how |",
                  "|---|---|---|---|---|"]
        dq = {}
        for arm, seeds in curves.items():
            dq[arm], cpu, hows = [], [], set()
            for c in seeds.values():
                at = [p for p in c if p[1] == S and p[0] == x]  # evaluated at exactly x
                q = at[0][3] if at else at_rollouts(c, x)
                if q is not None:
                    dq[arm].append(q - c[0][3])
                    cpu += [at[0][2]] if at else []
                    hows.add("measured at step S" if at else "interpolated")
            how = " or ".join(sorted(hows)) or "-"
            cells = (f"{fmt(statistics.mean(dq[arm]))} ({fmt(statistics.stdev(dq[arm]))})"
                     if len(dq[arm]) > 1 else "-")
            cpu_cell = f"{statistics.mean(cpu):.1f}" if cpu else "-"
            lines.append(f"| {arm} | {len(dq[arm])} of {len(seeds)} reach it | {cells} | "
                         f"{cpu_cell} | {how} |")
        lines += ["", "| arm | vs | diff of means | Welch t, p | Mann-Whitney p |",
                  "|---|---|---|---|---|"]
        for arm, other in compared(dq):
            xs, ys = dq[arm], dq[other]
            if len(xs) > 1 and len(ys) > 1:
                t, p = welch(xs, ys)
                lines.append(f"| {arm} | {other} | {fmt(statistics.mean(xs) - statistics.mean(ys))}"
                             f" | {t:.2f}, {p:.3f} | {mann_whitney(xs, ys):.3f} |")
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


def per_n(sample_groups):
    """lib/step.sample_groups as the adaptive arm sampled before the sampler took each prompt's own
    n: sample_groups once per distinct n; the same Groups, in candidate order."""
    def sample(model, tok, cfg, batch, n, seeds):
        groups = [None] * len(batch)
        for size in sorted(set(n)):
            js = [j for j in range(len(batch)) if n[j] == size]
            got = sample_groups(model, tok, cfg, [batch[j] for j in js], size,
                                [seeds[j] for j in js])
            for j, g in zip(js, got):
                groups[j] = g
        return groups
    return sample


def speed(task: str, steps: int, repeats: int = 5, seed: int = 0) -> dict:
    """Rollouts per CPU second (this process, one thread) of the adaptive arm, of the same arm with
    one sampler call per distinct n (per_n), and of its control N=16-one-round, on the warm start:
      rollout  the rollout phase alone (lib/step.sample_groups: sampler and verifier), 32 training
               prompts, the adaptive arms' 512 rollouts allocated for estimates q = u^4, u uniform
               (a skewed spread of 4 to ~40 a prompt, as the study's steps show), the control's 16
               each; median of `repeats` interleaved repeats;
      step     `steps` training steps of each arm from the warm start (brorl.train, the training
               clock time_train_cpu), with each step's mean rollout and update seconds (wall);
      differ   of those steps' metrics rows, clock fields aside, the fields in which the adaptive
               arm and its call per n differ, and how many were compared.
    Returns {measure: {arm: value}}, and differ."""
    import random
    import time
    import torch
    import brorl
    from lib import allocation, setup
    from lib.step import sample_groups as one_call
    torch.set_num_threads(1)
    cfg = brorl.parse_config([*TASKS[task], *ARMS["adaptive"], "--device", "cpu"])
    cfg, _, train_set, _, model, tok, _ = setup.setup(cfg, cfg.model, "--model")
    batch, seeds = random.Random(seed).sample(train_set, 32), list(range(32))
    u = torch.rand(32, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    n = allocation.allocate(u ** 4, 512, 4, 256).tolist()  # (32,) rollouts a prompt, sum 512
    arms = {"adaptive": lambda: one_call(model.eval(), tok, cfg, batch, n, seeds),
            "adaptive, a call per n": lambda: per_n(one_call)(model.eval(), tok, cfg, batch, n,
                                                              seeds),
            "N=16-one-round": lambda: one_call(model.eval(), tok, cfg, batch, [16] * 32, seeds)}
    cpu = {k: [] for k in arms}
    for _ in range(repeats):
        for k, fn in arms.items():
            t = time.process_time()
            fn()
            cpu[k].append(time.process_time() - t)
    out = {"rollout": {k: 512 / statistics.median(v) for k, v in cpu.items()},
           "step": {}, "rollout_s": {}, "update_s": {}}
    flags = {"adaptive": ARMS["adaptive"], "adaptive, a call per n": ARMS["adaptive"],
             "N=16-one-round": ARMS["N=16-one-round"]}
    runs = {}  # arm: its metrics rows, clock fields aside
    with tempfile.TemporaryDirectory() as tmp:
        for name, arm_flags in flags.items():
            allocation.sample_groups = per_n(one_call) if "per n" in name else one_call
            try:
                rows = brorl.train(brorl.parse_config(
                    [*TASKS[task], *arm_flags, "--seed", str(seed), "--steps", str(steps),
                     "--eval_every", "100000", "--save", "0", "--device", "cpu",
                     "--probe_prompts", "4", "--probe_samples", "64",
                     "--out", os.path.join(tmp, name.replace(" ", "_").replace(",", ""))]))
            finally:
                allocation.sample_groups = one_call
            trained = [r for r in rows if r["step"] > 0]
            runs[name] = [study.clock_free(r) for r in rows]
            out["step"][name] = sum(r["samples"] for r in trained) / trained[-1]["time_train_cpu"]
            out["rollout_s"][name] = statistics.mean(r["time_rollout"] for r in trained)
            out["update_s"][name] = statistics.mean(r["time_update"] for r in trained)
    out["n"] = n
    # The one call against a call per n, the same run otherwise: (fields that differ, fields).
    pairs = [(a.get(k), b.get(k)) for a, b in zip(runs["adaptive"],
                                                  runs["adaptive, a call per n"], strict=True)
             for k in a.keys() | b.keys()]
    out["differ"] = (sum(repr(x) != repr(y) for x, y in pairs), len(pairs))  # nan == nan
    return out


def check_flags(args, given: set):
    """One line for a flag the study cannot run with (before any run starts): --speed measures the
    three arms of its own, on --tasks alone, so every other flag of the study is refused with it."""
    if args.speed < 0:
        fail(f"--speed {args.speed}: need >= 1 step (0: no speed measurement)")
    if args.speed and (idle := sorted(given - {"speed", "tasks"})):
        fail(f"--speed {args.speed} with --{idle[0]}: --speed measures its own three arms on "
             "--tasks and writes nothing (no runs, no raw files, no report); drop it")
    study.finite_positive("--budget", args.budget)  # 0 would be no budget: 100,000 steps
    if args.jobs < 1:
        fail(f"--jobs {args.jobs}: need >= 1")
    study.check_seeds(args.seeds)
    study.check_distinct("--tasks", args.tasks)
    study.check_distinct("--arms", args.arms)
    for arm, flags in ARMS.items():  # the arms' own caps: B x min <= R <= B x max, all positive
        f = dict(zip(flags[::2], flags[1::2]))
        if f.get("--alloc") == "adaptive":
            B, R = int(f["--prompts_per_step"]), int(f["--rollout_budget"])
            lo, hi = int(f["--min_rollouts"]), int(f["--max_rollouts"])
            assert 2 <= lo <= hi and 0 < B * lo <= R <= B * hi, arm


# A run's CPU seconds besides its --budget of training: start-up and the two evaluations
# (the committed runs: about 65 s a run at --budget 30, one thread each, two at once).
RUN_OVERHEAD_CPU_S = 35


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    defaults = dict(out="runs/allocation", raw=str(RAW), tasks=list(TASKS), arms=list(ARMS),
                    seeds=[0, 1, 2, 3, 4], budget=30.0, jobs=1, report=False, speed=0)
    # (each default None here, so that a flag given is known: --speed refuses the others)
    p.add_argument("--out", help="run directories (default: runs/allocation)")
    p.add_argument("--raw", help="raw results, each run's metrics.jsonl (default: "
                                 "assets/allocation-1call)")
    p.add_argument("--tasks", nargs="+", choices=list(TASKS), help="default: keys sets")
    p.add_argument("--arms", nargs="+", choices=list(ARMS), help="default: all four")
    p.add_argument("--seeds", nargs="+", type=int, help="default: 0 1 2 3 4")
    p.add_argument("--budget", type=float, help="CPU seconds of training a run (default: 30)")
    p.add_argument("--jobs", type=int, help="runs at once, each one thread (default: 1)")
    p.add_argument("--report", action="store_const", const=True,
                   help="tables and figure from the raw files")
    p.add_argument("--speed", type=int,
                   help="steps: measure rollouts per CPU s of the adaptive arms instead")
    args = p.parse_args(argv)
    given = {k for k, v in vars(args).items() if v is not None}
    args = argparse.Namespace(**{k: defaults[k] if v is None else v for k, v in vars(args).items()})
    raw, out = Path(args.raw), Path(args.out)
    # Every flag, folder and raw file checked before anything is made or run.
    check_flags(args, given)
    if args.speed:
        print(f"rollouts per CPU second, one thread: the rollout phase (median of 5) and "
              f"{args.speed} training steps from the warm start")
        ratio = lambda r, k: r[k] / r["N=16-one-round"]
        for task in args.tasks:
            r = speed(task, args.speed)
            print(f"{task}: adaptive's n: {' '.join(map(str, sorted(r['n'])))}")
            for measure in ("rollout", "step"):
                print(f"  {measure:>7}: " + ", ".join(f"{k} {v:.0f}" for k, v in r[measure].items())
                      + f" | adaptive / control {ratio(r[measure], 'adaptive'):.2f}, a call per n"
                      f" / control {ratio(r[measure], 'adaptive, a call per n'):.2f}")
            print(f"  the {args.speed} steps' metrics.jsonl, adaptive against a call per n, clock "
                  f"fields aside: {r['differ'][0]} of {r['differ'][1]} fields differ")
            print("  a step's rollout / update wall s: " + ", ".join(
                f"{k} {r['rollout_s'][k]:.2f} / {r['update_s'][k]:.2f}" for k in r["rollout_s"]),
                flush=True)
        return
    study.check_folder("--raw", raw, files=("report.md", "figure.png"))
    if args.report:  # over raw files that exist, into --raw
        write_report(raw)
        return
    study.check_folder("--out", out)
    study.read_raw(raw)
    todo = study.pending(jobs(args.tasks, args.arms, args.seeds, args.budget, out, raw))
    study.make_folders(raw, out)
    cpu = len(todo) * (args.budget + RUN_OVERHEAD_CPU_S)
    print(f"{len(todo)} runs to do (the others' raw files exist): about {cpu / 60:.0f} CPU "
          f"minutes, {cpu / 60 / args.jobs:.0f} minutes at --jobs {args.jobs}", flush=True)
    with study.DriverLock(out):  # one driver at a time on --out
        study.exit_if_failed(study.run_jobs(todo, args.jobs))
    write_report(raw)


def write_report(raw: Path):
    """report.md (the tables, as printed) and figure.png, from every raw file read and measured
    first: a refusal leaves the old ones."""
    text = report(raw) + "\n## At equal rollouts\n\n" + equal_rollouts(raw)
    study.write_outputs(raw, {"report.md": study.text_writer(text),
                              "figure.png": lambda path: figure(raw, path)})
    print(text)


if __name__ == "__main__":
    main()
