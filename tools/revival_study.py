"""
revival_study.py: does breadth revive a run that more steps no longer improve? BroRL's headline
(docs/paper.md §1, §4): ProRL's training (N = 16) saturated, and continuing it at N = 512 improved
it again. Here, on a testbed where that can happen, in two phases, every run a `python brorl.py` in
a subprocess on one thread:

  trunk   ProRL's shape on a small fixed set: the sets task's 64 prompts whose answers are
          enumerated (--train_prompts 64), all of them every step (B = 64, one round), N = 16,
          until the plateau defined below, in chunks of --chunk steps (each chunk a --resume of the
          last, recorded as it ends; tools/study.py's ChunkedRun: whatever killed the study, the
          same command goes on from the last recorded chunk and ends as an uninterrupted trunk),
          CPU seconds capped (--trunk_cap). At the plateau the run's checkpoint is the branch
          point.
  arms    from that checkpoint (--init_from, its AdamW moments too), every arm one run a seed:
            prorl     N = 16, B = 64: ProRL continued
            n512      N = 512 at equal B, steps, lr and mini-batches
            n512-lr   N = 512 at the paper's lr rule, lr x sqrt(32) (32x the samples a step)
            n16-long  N = 16 for as many rollouts as n512 (32x its steps): the cost comparison
            focal     N = 16 with F-GRPO's focal weight (--focal_gamma 1)
          The arms share the trunk (one branch point); their seeds draw their own rollouts.

And a third phase, run only when named (--only early): branches from the trunk before its plateau,
where the reach window (below) was still full. The trunk's first max(--branch_steps) steps again
(default 20 and 100), in chunks of 20, each chunk's checkpoint kept; from each branch point, seed by
seed, prorl and n512 (the pairs), then n16-long, one run at a time. Its measures, per branch point
and arm: the prompts in the window at the branch, each one's first eval at which its Q reached 1/16
(a catch), the catches by the run's end and the median steps and rollouts to one, the prompts that
fell below 1/2048 (losses, and how many of them were in the window) and those below it at the branch
at or above it at the end (lifts; of them, those at or above 1/16: revivals); each arm against prorl
paired by seed (paired t, sign test) and unpaired (Welch).

The plateau, defined before the trunk ran: at an eval step s >= --window, the ordinary least
squares slope of the exact mean Q over the trunk's 64 prompts (answers_q: every answer's
probability, lib/answers.py) against the step, over the evals in (s - --window, s], has a 95%
interval (Student's t) that contains 0 and lies within +-0.01 per 100 steps. The reach window:
1/2048 <= Q < 1/16, where a group's chance of a right answer a step, 1 - (1 - Q)^N, runs from
0.22 to 1.0 at N = 512 and from 0.008 to 0.64 at N = 16.

Raw files, committed as they land: assets/revival/trunk/metrics.jsonl (the trunk so far, rewritten
after each chunk), assets/revival/trunk/chunks.jsonl (each chunk's steps and CPU seconds),
assets/revival/trunk/plateau.json (the branch point: its step, the slope and its interval, the
window count), assets/revival/arms/<arm>/seed<S>.jsonl (each arm run's metrics.jsonl, argv in its
first row); the early branches': assets/revival/early/trunk/ (the rerun trunk's metrics.jsonl and
chunks.jsonl), assets/revival/early/step<S>/<arm>/seed<N>.jsonl. --report reads them alone, each
checked: the page's numbers (assets/revival/report.md), the figure (assets/revival/revival.png) and
the early branches' numbers (assets/revival/early/report.md). The reading: docs/results/revival.md.

  python -m tools.revival_study --out runs/revival                  # trunk, then every arm
  python -m tools.revival_study --out runs/revival --only trunk     # the trunk and its plateau
  python -m tools.revival_study --out runs/revival --only early --seeds 0 1 2  # early branches
  python -m tools.revival_study --report                            # tables and figure
"""

import argparse
import json
import math
import statistics
from pathlib import Path

import data
from lib.errors import fail
from lib.rundir import write_atomic
from tools import stats, study

HERE = Path(__file__).resolve().parent.parent
RAW = HERE / "assets" / "revival"
N_PROMPTS = 64  # the testbed: the sets task's first 64 eval prompts (their answers enumerated)
EVAL_EVERY = 10  # the trunk's evaluations: every 10 steps (and at each chunk's end)


def trunk_flags(n: int) -> list:
    """The trunk's flags, ProRL's shape on a fixed set of n prompts: N = 16, all n every step."""
    return ["--preset", "sets", "--train_prompts", str(n), "--eval_prompts", str(n),
            "--answer_prompts", str(n), "--prompts_per_step", str(n), "--max_rounds", "1",
            "--n_rollouts", "16", "--lr", "2e-4", "--eval_samples", "4", "--probe_prompts", "4",
            "--probe_samples", "64", "--seed", "0", "--eval_every", str(EVAL_EVERY)]


def trunk_name(n: int) -> str:
    """The trunk's run and raw directory: trunk for the 64-prompt testbed, trunk-<n> otherwise."""
    return "trunk" if n == N_PROMPTS else f"trunk-{n}"
WINDOW = (1 / 2048, 1 / 16)  # the reach window of Q
SLOPE_BOUND = 0.01  # the plateau: the slope's 95% interval within +-this per 100 steps


def plateau_test(rows: list, window: int) -> dict:
    """The plateau rule at the trunk's last eval: the slope of answers_q per 100 steps over the
    evals of the last `window` steps, its interval, and whether it holds."""
    evals = [r for r in rows if "answers_q" in r]
    last = evals[-1]["step"]
    if last < window:
        return dict(step=last, plateau=False)
    pts = [(r["step"], r["answers_q"]) for r in evals if r["step"] > last - window]
    if len(pts) < 3:  # (main refuses a --window of fewer than 3 evaluations)
        return dict(step=last, plateau=False)
    b, lo, hi = (100 * v for v in stats.slope(*zip(*pts)))
    return dict(step=last, slope_per_100=b, ci_low=lo, ci_high=hi, evals=len(pts),
                plateau=lo <= 0 <= hi and -SLOPE_BOUND <= lo and hi <= SLOPE_BOUND)


def window_prompts(log10_q: list) -> list:
    """The prompts (indices) whose log10 Q lies in the reach window."""
    lo, hi = (math.log10(w) for w in WINDOW)
    return [i for i, q in enumerate(log10_q) if lo <= q < hi]


def zones(log10_q: list) -> dict:
    """How many prompts sit above, in and below the reach window."""
    lo, hi = (math.log10(w) for w in WINDOW)
    return dict(high=sum(q >= hi for q in log10_q), window=sum(lo <= q < hi for q in log10_q),
                below=sum(q < lo for q in log10_q))


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
        b = stats.slope([r["step"] for r in recent],
                  [r["answers_log10_q_per_prompt"][i] for r in recent])[0] if len(recent) > 2 else 0
        moved.append(dict(prompt=i, log10_q_start=first[i], log10_q_branch=last[i],
                          decades_per_100=100 * b))
    return {**test, "answers_q": evals[-1]["answers_q"], "answers_q_start": evals[0]["answers_q"],
            "zones_start": zones(first), "zones_branch": zones(last), "stuck": moved,
            "go": zones(last)["window"] >= len(last) // 8}


# ----------------------------------------------------------------------------
# The trunk


def trunk_run(out: Path, raw: Path, chunk: int, max_steps: int,
              n: int = N_PROMPTS) -> study.ChunkedRun:
    """The trunk as a chunked run (tools/study.py): <out>/<name>, its chunks recorded in
    <raw>/<name>/chunks.jsonl, its checkpoint at the last recorded chunk copied to
    <out>/<name>-branch (the arms' branch point once the plateau is declared)."""
    name = trunk_name(n)
    return study.ChunkedRun(name, out / name, trunk_flags(n), chunk, max_steps,
                            raw / name / "chunks.jsonl", lambda step: out / f"{name}-branch",
                            out / f"{name}.log")


def trunk(out: Path, raw: Path, chunk: int, max_steps: int, cap: float, window: int,
          n: int = N_PROMPTS) -> dict:
    """ProRL's shape until the plateau, in chunks, each a --resume of the last: after each recorded
    chunk the raw metrics rewritten and the plateau rule tested. Returns the plateau record, or {}
    if the trunk stopped first. A rerun goes on from the last recorded chunk (study.ChunkedRun)."""
    run, name = trunk_run(out, raw, chunk, max_steps, n), trunk_name(n)
    while True:
        done = run.done()
        if done:
            rows = run.rows(done)
            write_atomic(raw / name / "metrics.jsonl", study.raw_text(rows, trunk_flags(n)))
            test = plateau_test(rows, window)
            q = rows[-1].get("answers_q", float("nan"))
            print(f"{name} step {done}: mean exact Q {q:.4f}; "
                  f"plateau rule: {test}", flush=True)
            if test["plateau"]:
                record = {**branch_point(rows, test, window), "window": window}
                write_atomic(raw / name / "plateau.json", json.dumps(record, indent=1) + "\n")
                return record
        spent = sum(c["cpu_s"] for c in run.records())
        if done >= max_steps or spent >= cap:
            print(f"trunk: stopped without a plateau at step {done} ({spent:.0f} CPU s; "
                  f"--max_steps {max_steps}, --trunk_cap {cap})", flush=True)
            return {}
        run.advance(done)


# ----------------------------------------------------------------------------
# The arms, from the plateau's checkpoint

STEPS = 25  # the branch's steps at equal steps; n16-long runs 32x as many (equal rollouts)
LR = 2e-4  # the trunk's; the paper's rule scales it by sqrt(samples a step): x sqrt(512 / 16)
ARMS = {  # name: (flags, steps, eval_every, mass_balance every)
    "prorl": (["--n_rollouts", "16"], STEPS, 5, 5),
    "n512": (["--n_rollouts", "512"], STEPS, 5, 5),
    "n512-lr": (["--n_rollouts", "512", "--lr", f"{LR * math.sqrt(512 / 16):.4g}"], STEPS, 5, 5),
    "n16-long": (["--n_rollouts", "16"], 32 * STEPS, 100, 160),
    "focal": (["--n_rollouts", "16", "--focal_gamma", "1"], STEPS, 5, 5),
}


def arm_argv(arm: str, seed: int, branch: Path, run_dir: Path, cap: float,
             n: int = N_PROMPTS) -> list:
    """One arm run's flags: the trunk's, from its checkpoint with its AdamW moments, the arm's."""
    flags, steps, every, balance = ARMS[arm]
    argv = trunk_flags(n)
    for flag, value in [("--seed", str(seed)), ("--eval_every", str(every)),
                        *zip(flags[::2], flags[1::2])]:  # the trunk's value replaced, or added
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return [*argv, "--init_from", str(branch), "--init_optimizer",
            "--mass_balance", str(balance), "--steps", str(steps), "--save", "0",
            "--time_budget", str(cap), "--budget_clock", "cpu", "--out", str(run_dir)]


def arm_jobs(out: Path, raw: Path, seeds: list, cap: float, n: int = N_PROMPTS) -> list:
    """Every arm's runs, seed by seed (every arm's seed 0, then seed 1, ...: a study cut short is
    balanced), each from the trunk's branch point."""
    branch = out / f"{trunk_name(n)}-branch"
    return [study.Job(f"{arm} seed {seed}",
                      arm_argv(arm, seed, branch, out / "arms" / arm / f"seed{seed}", cap, n),
                      out / "arms" / arm / f"seed{seed}", raw / "arms" / arm / f"seed{seed}.jsonl",
                      out / "arms" / f"{arm}-seed{seed}.log")
            for seed in seeds for arm in ARMS]


def arms(out: Path, raw: Path, seeds: list, jobs: int, cap: float, n: int = N_PROMPTS):
    """Every arm's runs, `jobs` at a time, each run's metrics.jsonl copied to its raw file when it
    ends. A rerun skips the runs whose raw file exists."""
    check_plateau(out, raw, n)
    study.exit_if_failed(study.run_jobs(arm_jobs(out, raw, seeds, cap, n), jobs))


def check_plateau(out: Path, raw: Path, n: int = N_PROMPTS):
    """The arms' branch point: the plateau's record and the trunk's checkpoint there; else one
    line (main checks it for --only arms before --out or the lock is made)."""
    name = trunk_name(n)
    branch = out / f"{name}-branch"
    if not (raw / name / "plateau.json").is_file() or not (branch / "ckpt").is_dir():
        fail(f"no plateau yet ({raw / name / 'plateau.json'}, {branch / 'ckpt'}): run the trunk "
             "first (--only trunk)")


# ----------------------------------------------------------------------------
# The report: from the raw files alone

PASS_K = (1, 16, 256, 1024)  # the exact pass@k the tables show (every k is in the raw files)


def arm_measures(rows: list) -> dict:
    """One arm run's numbers from its metrics.jsonl rows (step 0: the branch point, evaluated)."""
    evals = [r for r in rows if "answers_q" in r]
    first, last = evals[0], evals[-1]
    steps = [r for r in rows if r["step"] > 0]
    q0, q1 = first["answers_log10_q_per_prompt"], last["answers_log10_q_per_prompt"]
    lo, hi = (math.log10(w) for w in WINDOW)
    groups = [g for r in steps for g in r.get("balance_groups", [])]
    with_q = [g for g in groups if g["q_before"] > 0]
    return {
        "dq": last["answers_q"] - first["answers_q"], "q": last["answers_q"],
        **{f"pass@{k}": last[f"answers_pass@{k}"] for k in PASS_K},
        "dpass@1024": last["answers_pass@1024"] - first["answers_pass@1024"],
        # prompts below 1/16 at the branch that reached it: in the reach window, and below it
        "revived_window": sum(lo <= a < hi <= b for a, b in zip(q0, q1)),
        "revived_below": sum(a < lo and b >= hi for a, b in zip(q0, q1)),
        "stuck_dlog10q": statistics.fmean([b - a for a, b in zip(q0, q1) if a < hi] or [0.0]),
        # a prompt's worst drop of a right answer, averaged over the prompts; and the largest
        "right_rose": last["answers_right_rose"], "worst_drop": last["answers_right_worst_drop"],
        "worst_drop_max": last["answers_worst_drop_max"],
        "entropy": last["answers_entropy"],
        # per trained group of a measured step (two updates): the unsampled right mass's change, and
        # F-GRPO's quantity, that mass's share of Q before the update
        "du_pos": statistics.fmean([g["U_pos_after"] - g["U_pos_before"] for g in groups] or [0]),
        "u_share": statistics.fmean([g["U_pos_before"] / g["q_before"] for g in with_q] or [0]),
        "rollouts": sum(r["samples"] for r in steps),
        "updates": sum(r.get("groups_kept", 0) > 0 for r in steps) * 2,  # --n_minibatches 2
        "steps": rows[-1]["step"], "cpu_s": rows[-1]["time_train_cpu"],
        "curve": [(r["step"], sum(s["samples"] for s in steps if s["step"] <= r["step"]),
                   r["time_train_cpu"], r["answers_q"]) for r in evals],
    }


def compare(a: list, b: list) -> str:
    """Welch's difference with its interval, Welch's p and the exact Mann-Whitney p."""
    d, lo, hi = stats.welch_interval(a, b)
    return (f"{d:+.4f} [{lo:+.4f}, {hi:+.4f}] | p {stats.welch(a, b)[1]:.3g} | "
            f"p {stats.mann_whitney(a, b):.3g}")


def at_cpu(m: dict, cpu: float) -> float:
    """An arm run's mean exact Q at its last eval within `cpu` training CPU seconds."""
    return [q for _, _, c, q in m["curve"] if c <= cpu][-1]


# What a plateau's record holds (branch_point, with the window), and a chunk's record.
PLATEAU_KEYS = ("step", "slope_per_100", "ci_low", "ci_high", "evals", "window", "answers_q",
                "answers_q_start", "zones_start", "zones_branch", "go", "stuck")


def trunk_files(raw: Path) -> list:
    """Each trunk's raw files, read and checked: (name, its plateau record or None, its chunks'
    records, its metrics rows); a trunk whose plateau was declared needs all three files."""
    out = []
    for folder in sorted({p.parent for p in raw.glob("trunk*/*") if p.name in (
            "plateau.json", "metrics.jsonl", "chunks.jsonl")}):
        plateau = folder / "plateau.json"
        for need in ("metrics.jsonl", "chunks.jsonl"):
            if not (folder / need).is_file():
                fail(f"{folder / need} is missing: the trunk's raw files are incomplete; rerun "
                     f"the trunk (--only trunk --raw {raw}) to write them")
        out.append((folder.name, study.read_json(plateau, PLATEAU_KEYS) if plateau.is_file()
                    else None, study.read_jsonl(folder / "chunks.jsonl", ("steps_to", "cpu_s")),
                    study.raw_rows(folder / "metrics.jsonl")))
    return out


def plateau_lines(name: str, rec: dict, chunks: list) -> list:
    """A trunk's plateau, from its record and its chunks' CPU seconds."""
    return [f"## {name}: the plateau, measured before any arm ran", "",
            f"- plateau declared at step {rec['step']}: slope of the mean exact Q "
            f"{rec['slope_per_100']:+.4f} per 100 steps, 95% interval "
            f"[{rec['ci_low']:+.4f}, {rec['ci_high']:+.4f}] over the last {rec['window']} "
            f"steps ({rec['evals']} evals); trunk CPU {sum(c['cpu_s'] for c in chunks):.0f} s",
            f"- mean exact Q {rec['answers_q_start']:.4f} at step 0 -> {rec['answers_q']:.4f}",
            f"- zones at step 0 (high >= 1/16 / reach window / below 1/2048): "
            f"{rec['zones_start']['high']} / {rec['zones_start']['window']} / "
            f"{rec['zones_start']['below']}; at the plateau: {rec['zones_branch']['high']} / "
            f"{rec['zones_branch']['window']} / {rec['zones_branch']['below']}",
            f"- go (at least 1 in 8 of the set in the reach window): {rec['go']}",
            "- the prompts below 1/16 at the plateau (log10 Q at step 0 -> at the plateau; "
            "decades per 100 steps over the rule's window): " + "; ".join(
                f"{x['log10_q_start']:.2f} -> {x['log10_q_branch']:.2f} "
                f"({x['decades_per_100']:+.2f})" for x in rec["stuck"]), ""]


def trunk_lines(name: str, rows: list, plateau: bool) -> list:
    """A trunk's prompts by zone, and when each first reached 1/16; without a plateau, the rule at
    its last eval."""
    evals = [r for r in rows if "answers_log10_q_per_prompt" in r]
    hi, out = math.log10(WINDOW[1]), []
    if not plateau:
        test = plateau_test(rows, 100)
        out += [f"## {name}: stopped at step {evals[-1]['step']} without a plateau",
                "", f"- plateau rule at its last eval: slope "
                f"{test.get('slope_per_100', float('nan')):+.4f} per 100 steps, interval "
                f"[{test.get('ci_low', float('nan')):+.4f}, "
                f"{test.get('ci_high', float('nan')):+.4f}]; mean exact Q "
                f"{evals[-1]['answers_q']:.4f}"]
    out += [f"- {name}, prompts by zone (high / reach window / below) at each "
            "eval: " + "; ".join(
                f"{r['step']}: " + "/".join(str(v) for v in
                                            zones(r["answers_log10_q_per_prompt"]).values())
                for r in evals if r["step"] % 50 == 0)]
    # When each prompt first reached 1/16: the trunk's own revivals, step by step.
    first = [next((r["step"] for r in evals if r["answers_log10_q_per_prompt"][i] >= hi), None)
             for i in range(len(evals[0]["answers_log10_q_per_prompt"]))]
    late = sorted(f for f in first if f is not None and f > 100)
    return out + [f"- {name}: prompts that first reached 1/16 after step 100: "
                  f"{len(late)} (at steps {', '.join(map(str, late)) or 'none'}); never: "
                  f"{sum(f is None for f in first)}", ""]


def arm_files(raw: Path) -> dict:
    """{arm: [each seed's measures, by seed]} of the raw arm files, each checked and measured."""
    runs = study.read_raw(raw, groups=("arms",)).get("arms", {})
    return {a: [study.measured(raw / "arms" / a / f"seed{s}.jsonl", arm_measures, rows)
                for s, rows in sorted(runs[a].items())] for a in ARMS if runs.get(a)}


def report(raw: Path) -> str:
    """The page's numbers, as markdown, from the raw files (each checked: one line for a file
    that is not this study's)."""
    out = ["# Revival study: the numbers (written by `python -m tools.revival_study --report`)", ""]
    trunks = trunk_files(raw)
    for name, rec, chunks, _ in trunks:
        if rec is not None:
            out += study.measured(raw / name / "plateau.json", plateau_lines, name, rec, chunks)
    for name, rec, _, rows in trunks:
        out += study.measured(raw / name / "metrics.jsonl", trunk_lines, name, rows,
                              rec is not None)
    m = arm_files(raw)
    if not m:
        return "\n".join(out + ["No arm has run yet.", ""])
    keys = ["dq", "q", *[f"pass@{k}" for k in PASS_K], "dpass@1024", "revived_window",
            "revived_below", "stuck_dlog10q", "right_rose", "worst_drop", "worst_drop_max",
            "entropy", "du_pos",
            "u_share", "rollouts", "updates", "steps", "cpu_s"]
    out += ["## The arms (mean over seeds, sd in brackets)", "",
            "| measure | " + " | ".join(f"{a} ({len(v)} seeds)" for a, v in m.items()) + " |",
            "|---" * (len(m) + 1) + "|"]
    for k in keys:
        cell = lambda xs: (f"{statistics.fmean(xs):.4g} ({statistics.pstdev(xs):.2g})"
                           if len(xs) > 1 else f"{xs[0]:.4g}")
        out.append(f"| {k} | " + " | ".join(cell([x[k] for x in v]) for v in m.values()) + " |")
    out += ["", "## Against ProRL continued (prorl): change of the mean exact Q, per seed "
            "(unpaired: the arms share the trunk, not their rollouts)", "",
            "| arm | difference [95% interval] | Welch p | Mann-Whitney p |", "|---|---|---|---|"]
    base = [x["dq"] for x in m.get("prorl", [])]
    for a, v in m.items():
        if a != "prorl" and len(v) > 1 and len(base) > 1:
            out.append(f"| {a} | {compare([x['dq'] for x in v], base)} |")
    if "n512" in m and "n16-long" in m:
        out += ["", "## Equal rollouts and equal CPU seconds: n512 against n16-long", "",
                "| comparison | difference [95% interval] | Welch p | Mann-Whitney p |",
                "|---|---|---|---|",
                f"| change of mean exact Q, each run's end (equal rollouts) | "
                f"{compare([x['dq'] for x in m['n512']], [x['dq'] for x in m['n16-long']])} |"]
        cpu = statistics.fmean(x["cpu_s"] for x in m["n512"])
        q16 = [at_cpu(x, cpu) - x["curve"][0][3] for x in m["n16-long"]]
        out.append(f"| change of mean exact Q, n16-long at its last eval within n512's mean "
                   f"training-clock CPU ({cpu:.0f} s) | "
                   f"{compare([x['dq'] for x in m['n512']], q16)} |")
    return "\n".join(out + [""])


def figure(raw: Path, path: Path):
    """The trunk's mean exact Q to its plateau, then each arm's mean over seeds (its seeds' range
    shaded): against steps (the trunk's, then the branch's), rollouts and CPU seconds; and the
    trunk's prompts by zone."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    _, rec, _, trunk_rows = next(t for t in trunk_files(raw) if t[0] == "trunk")
    runs = study.read_raw(raw, groups=("arms",)).get("arms", {})
    fig, grid = plt.subplots(2, 2, figsize=(12, 8))
    axes, zone_ax = [grid[0, 0], grid[1, 0], grid[1, 1]], grid[0, 1]
    ev = [r for r in trunk_rows if "answers_q" in r and r["step"] <= rec["step"]]
    counts = [zones(r["answers_log10_q_per_prompt"]) for r in ev]
    for zone, color in (("high", "C2"), ("window", "C1"), ("below", "C3")):
        zone_ax.plot([r["step"] for r in ev], [c[zone] for c in counts], color=color,
                     label={"high": "Q >= 1/16", "window": "reach window",
                            "below": "Q < 1/2048"}[zone])
    zone_ax.set_xlabel("trunk step (N = 16)")
    zone_ax.set_ylabel("prompts")
    zone_ax.set_yscale("symlog", linthresh=1)
    zone_ax.axvline(rec["step"], color="grey", ls=":")
    zone_ax.legend(fontsize=8)
    axes[0].plot([r["step"] for r in ev], [r["answers_q"] for r in ev], color="k", label="trunk")
    for i, (arm, seeds) in enumerate(sorted(runs.items())):
        curves = [study.measured(raw / "arms" / arm / f"seed{s}.jsonl", arm_measures, rows)["curve"]
                  for s, rows in seeds.items()]
        n = min(len(c) for c in curves)
        for ax, col, offset in ((axes[0], 0, rec["step"]), (axes[1], 1, 0), (axes[2], 2, 0)):
            x = [offset + statistics.fmean(c[j][col] for c in curves) for j in range(n)]
            ys = [[c[j][3] for c in curves] for j in range(n)]
            ax.plot(x, [statistics.fmean(y) for y in ys], color=f"C{i}",
                    label=f"{arm} ({len(curves)})")
            ax.fill_between(x, [min(y) for y in ys], [max(y) for y in ys], color=f"C{i}",
                            alpha=0.2)
    axes[0].axvline(rec["step"], color="grey", ls=":")
    for ax, xl in zip(axes, ("step (trunk, then branch)", "rollouts since the branch",
                             "training CPU seconds since the branch")):
        ax.set_xlabel(xl)
        ax.set_ylabel("mean exact Q over the 64 prompts")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------
# Early branches: from the trunk before its plateau, where the reach window was still full

BRANCH_STEPS = (20, 100)  # the early branch points (trunk steps)
EARLY_CHUNK = 20  # the early trunk's chunk: every branch point is a chunk's end, its copy kept
EARLY_PAIRS = ("prorl", "n512")  # run seed by seed first: a study cut short stays paired
EARLY_LAST = ("n16-long",)  # the costly cost comparison, after every pair


def early_trunk_run(out: Path, raw: Path, last: int) -> study.ChunkedRun:
    """The trunk's first `last` steps again, chunk by chunk (the same flags: the same run), every
    chunk's checkpoint kept: <out>/early/trunk-step<S>, the branch point of step S."""
    folder = out / "early"
    return study.ChunkedRun("early trunk", folder / "trunk", trunk_flags(N_PROMPTS), EARLY_CHUNK,
                            last, raw / "early" / "trunk" / "chunks.jsonl",
                            lambda step: folder / f"trunk-step{step}", folder / "trunk.log",
                            keep_copies=True)


def early_jobs(out: Path, raw: Path, seeds: list, steps: list, cap: float) -> list:
    """Each early branch's runs: for each seed, every branch point's prorl and n512; then n16-long,
    seed by seed. Run <out>/early/step<S>/<arm>/seed<N>, raw <raw>/early/step<S>/<arm>/seed<N>."""
    def job(step, arm, seed):
        run_dir = out / "early" / f"step{step}" / arm / f"seed{seed}"
        return study.Job(f"step {step} {arm} seed {seed}",
                         arm_argv(arm, seed, out / "early" / f"trunk-step{step}", run_dir, cap),
                         run_dir, raw / "early" / f"step{step}" / arm / f"seed{seed}.jsonl",
                         out / "early" / f"step{step}" / f"{arm}-seed{seed}.log")
    return ([job(s, a, seed) for seed in seeds for s in steps for a in EARLY_PAIRS]
            + [job(s, a, seed) for a in EARLY_LAST for seed in seeds for s in steps])


def early(out: Path, raw: Path, seeds: list, steps: list, cap: float):
    """The early trunk to the last branch point (resumed from its last recorded chunk), its rows
    written to <raw>/early/trunk/metrics.jsonl; then every early branch's run, one at a time, each
    raw file written as its run ends (a rerun skips the runs whose raw file exists)."""
    run = early_trunk_run(out, raw, max(steps))
    while (done := run.done()) < max(steps):
        run.advance(done)
    rows = run.rows(max(steps))
    write_atomic(raw / "early" / "trunk" / "metrics.jsonl",
                 study.raw_text(rows, trunk_flags(N_PROMPTS)))
    print(f"early trunk step {done}: mean exact Q {rows[-1]['answers_q']:.4f}", flush=True)
    study.exit_if_failed(study.run_jobs(early_jobs(out, raw, seeds, steps, cap), 1))


def check_branch_steps(steps: list, raw: Path):
    """--branch_steps: distinct chunk ends before the trunk's plateau; else one line."""
    study.check_distinct("--branch_steps", steps)
    plateau = raw / "trunk" / "plateau.json"
    if not plateau.is_file():
        fail(f"--only early: {plateau} is missing (the early branches come before the trunk's "
             "plateau: run the trunk first)")
    limit = study.read_json(plateau, PLATEAU_KEYS)["step"]
    for s in steps:
        if s < EARLY_CHUNK or s % EARLY_CHUNK or s > limit:
            fail(f"--branch_steps {s}: need a multiple of the early trunk's chunk {EARLY_CHUNK} "
                 f"(a kept checkpoint), from {EARLY_CHUNK} to the plateau's step {limit}")


# The early branches' report: from the raw files alone

def catches(rows: list) -> dict:
    """One early branch run's catches and losses from its rows (step 0: the branch point,
    evaluated): the prompts in the reach window at the branch; for each, the first eval step at
    which its Q reached 1/16 (a catch; None if not by the run's end); the steps and rollouts to
    each catch; the losses (prompts at or above 1/2048 at the branch, below it at the end) and how
    many of them were in the window; the lifts (below 1/2048 at the branch, at or above it at the
    end) and of them the revivals (at or above 1/16 at the end), each counted apart so that a
    prompt below at both ends is neither."""
    evals = [r for r in rows if "answers_log10_q_per_prompt" in r]
    lo, hi = (math.log10(w) for w in WINDOW)
    q0, q1 = evals[0]["answers_log10_q_per_prompt"], evals[-1]["answers_log10_q_per_prompt"]
    window = window_prompts(q0)
    first = {i: next((r["step"] for r in evals if r["answers_log10_q_per_prompt"][i] >= hi), None)
             for i in window}
    caught = sorted(s for s in first.values() if s is not None)
    losses = [i for i, (a, b) in enumerate(zip(q0, q1)) if a >= lo > b]
    lifts = [b for a, b in zip(q0, q1) if a < lo <= b]

    def spent(step):  # rollouts of the training steps up to `step`
        return sum(r["samples"] for r in rows if 0 < r["step"] <= step)

    return dict(window=window, first=first, caught=len(caught), steps_to_catch=caught,
                rollouts_to_catch=[spent(s) for s in caught], losses=len(losses),
                window_losses=sum(i in window for i in losses), lifts=len(lifts),
                revivals=sum(b >= hi for b in lifts),
                q=evals[-1]["answers_q"],
                cpu_s=rows[-1]["time_train_cpu"], rollouts=spent(rows[-1]["step"]),
                steps=rows[-1]["step"])


def trunk_match(early_rows: list, trunk_rows: list) -> str:
    """Whether the early trunk's rows are the committed trunk's to the same step, clock aside: a
    sentence naming the first row and field that differ."""
    last = early_rows[-1]["step"]
    old = [r for r in trunk_rows if r["step"] <= last]
    if len(old) != len(early_rows):
        return f"they differ: {len(early_rows)} rows to step {last}, the committed trunk {len(old)}"
    for a, b in zip(early_rows, old):
        a, b = study.clock_free(a), study.clock_free(b)
        if a != b:
            key = next(k for k in sorted({*a, *b}) if a.get(k) != b.get(k))
            return (f"they differ, first at step {a.get('step')} in {key} (mean exact Q at step "
                    f"{last}: {early_rows[-1].get('answers_q', math.nan):.4f} here, "
                    f"{old[-1].get('answers_q', math.nan):.4f} there): this report uses the "
                    "rerun's own rows")
    return f"identical to step {last}, clock fields aside"


def early_runs(raw: Path) -> dict:
    """{branch step: {arm: {seed: catches}}} of the early branches' raw files, each checked."""
    out = {}
    for group, arms_ in study.read_raw(raw / "early").items():
        if not (group.startswith("step") and group[4:].isdigit()):
            fail(f"{raw / 'early' / group}: not an early branch's folder (step<S>)")
        for arm, seeds in arms_.items():
            if arm not in ARMS:
                fail(f"{raw / 'early' / group / arm}: not an arm of this study")
            out.setdefault(int(group[4:]), {})[arm] = {
                seed: study.measured(raw / "early" / group / arm / f"seed{seed}.jsonl", catches,
                                     rows) for seed, rows in sorted(seeds.items())}
    return out


def paired_lines(runs: dict) -> list:
    """Each arm against prorl, paired by seed (the same branch point and seed): per measure the
    pairs, the mean difference, the paired t test's p, the sign test's p, and Welch's difference
    with its 95% interval (unpaired)."""
    out = ["| arm - prorl | measure | pairs | mean difference | paired t p | sign p | "
           "Welch difference [95% interval] |", "|---|---|---|---|---|---|---|"]
    flat = False
    for arm, seeds in runs.items():
        both = sorted(set(seeds) & set(runs.get("prorl", {})))
        if arm == "prorl" or len(both) < 2:
            continue
        for key in ("caught", "losses", "window_losses", "lifts", "revivals", "q"):
            a, b = [seeds[s][key] for s in both], [runs["prorl"][s][key] for s in both]
            c = stats.paired(a, b)
            out.append(f"| {arm} | {key} | {len(both)} | {c['mean']:+.4g} | {c['p']:.3g} | "
                       f"{c['sign_p']:.3g} | {c['d']:+.4g} [{c['lo']:+.4g}, {c['hi']:+.4g}] |")
            flat = flat or math.isnan(c["p"])
    if flat:
        out += ["", "A paired t p of nan: the difference is the same on every seed (no spread to "
                "test); a sign p of nan: it is 0 on every seed; a Welch interval of zero width: "
                "neither arm varied across seeds."]
    return out


def branch_lines(step: int, trunk_row: dict, runs: dict) -> list:
    """One early branch point: its prompts by zone and its window, each arm's catches and losses
    (per seed, in seed order), the paired tests, and each window prompt's catch step."""
    q = trunk_row["answers_log10_q_per_prompt"]
    window = window_prompts(q)
    z = zones(q)
    off = [f"{a} seed {s}" for a, seeds in runs.items() for s, c in seeds.items()
           if c["window"] != window]
    out = [f"## Branch at trunk step {step}", "",
           f"- the trunk at step {step}: mean exact Q {trunk_row['answers_q']:.4f}; prompts high "
           f">= 1/16 / reach window / below 1/2048: {z['high']} / {z['window']} / {z['below']}",
           f"- in the reach window ({len(window)}): " + (", ".join(
               f"{i} ({q[i]:.2f})" for i in window) or "none") + " (prompt (log10 Q))",
           "- runs whose own branch eval puts other prompts in the window: "
           + (", ".join(off) or "none"), ""]
    per_seed = lambda arm, key: " ".join(str(c[key]) for c in runs[arm].values())
    pooled = lambda arm, key: [x for c in runs[arm].values() for x in c[key]]
    med = lambda xs: f"{statistics.median(xs):.0f}" if xs else "-"
    rows = [("caught by the run's end, per seed", lambda a: per_seed(a, "caught")),
            ("median steps to a catch (the arm's own steps; caught ones, seeds pooled)",
             lambda a: med(pooled(a, "steps_to_catch"))),
            ("median rollouts to a catch (caught ones, seeds pooled)",
             lambda a: med(pooled(a, "rollouts_to_catch"))),
            ("losses: prompts at or above 1/2048 at the branch, below it at the end, per seed",
             lambda a: per_seed(a, "losses")),
            ("losses that were in the window at the branch, per seed",
             lambda a: per_seed(a, "window_losses")),
            ("lifts: prompts below 1/2048 at the branch, at or above it at the end, per seed",
             lambda a: per_seed(a, "lifts")),
            ("revivals: lifts that ended at or above 1/16, per seed",
             lambda a: per_seed(a, "revivals")),
            ("mean exact Q at the end, mean (sd) over seeds",
             lambda a: "{:.4f} ({:.2g})".format(*stats.mean_sd([c["q"] for c in
                                                                 runs[a].values()]))),
            ("training CPU s, mean over seeds",
             lambda a: f"{statistics.fmean(c['cpu_s'] for c in runs[a].values()):.0f}"),
            ("rollouts, steps", lambda a: "{rollouts}, {steps}".format(
                **next(iter(runs[a].values()))))]
    arms_ = [a for a in ARMS if a in runs]
    out += ["| measure | " + " | ".join(f"{a} (seeds {' '.join(map(str, runs[a]))})"
                                        for a in arms_) + " |", "|---" * (len(arms_) + 1) + "|"]
    out += [f"| {name} | " + " | ".join(cell(a) for a in arms_) + " |" for name, cell in rows]
    paired = paired_lines({a: runs[a] for a in arms_})
    out += ["", *(paired if len(paired) > 2 else ["No arm has two seeds paired with prorl's yet."]),
            ""]
    if window:
        out += ["Each window prompt's catch step, per seed (-: not caught):", "",
                "| prompt | log10 Q at the branch | " + " | ".join(arms_) + " |",
                "|---" * (len(arms_) + 2) + "|"]
        out += [f"| {i} | {q[i]:.2f} | " + " | ".join(
            " ".join(str(c["first"].get(i) or "-") for c in runs[a].values()) for a in arms_)
            + " |" for i in window]
        out.append("")
    return out


def early_report(raw: Path) -> str:
    """The early branches' numbers, as markdown, from their raw files (each checked)."""
    folder = raw / "early" / "trunk"
    for need in ("metrics.jsonl", "chunks.jsonl"):
        if not (folder / need).is_file():
            fail(f"{folder / need} is missing: rerun --only early to write it")
    rows = study.raw_rows(folder / "metrics.jsonl")
    chunks = study.read_jsonl(folder / "chunks.jsonl", ("steps_to", "cpu_s"))
    trunk_rows = study.raw_rows(raw / "trunk" / "metrics.jsonl")
    runs = early_runs(raw)
    evals = {r["step"]: r for r in rows if "answers_log10_q_per_prompt" in r}
    out = ["# Revival study, early branches: the numbers (written by "
           "`python -m tools.revival_study --report`)", "",
           f"- the early trunk: the trunk's flags rerun to step {rows[-1]['step']} in chunks of "
           f"{EARLY_CHUNK} ({sum(c['cpu_s'] for c in chunks):.0f} CPU s); its rows against the "
           "trunk's raw rows (trunk/metrics.jsonl, beside early/): "
           + study.measured(folder / "metrics.jsonl", trunk_match, rows, trunk_rows),
           f"- each branch: {STEPS} steps at B = {N_PROMPTS} and the trunk's lr from the early "
           "trunk's checkpoint (its AdamW moments too), evals every 5 steps (n16-long: every "
           f"{ARMS['n16-long'][2]}); a catch: a prompt in the reach window at the branch whose Q "
           "reached 1/16 at an eval", ""]
    for step, arm_runs in sorted(runs.items()):
        if step not in evals:
            fail(f"{raw / 'early' / f'step{step}'}: the early trunk has no eval at step {step}")
        out += study.measured(raw / "early" / f"step{step}", branch_lines, step, evals[step],
                              arm_runs)
    return "\n".join(out + ([] if runs else ["No early branch has run yet.", ""]))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/revival", help="the runs' directory")
    ap.add_argument("--raw", default=str(RAW), help="the raw results' directory")
    ap.add_argument("--only", choices=("trunk", "arms", "early"), default=None,
                    help="one phase (early: branches before the plateau, run only when named)")
    ap.add_argument("--branch_steps", type=int, nargs="+", default=list(BRANCH_STEPS),
                    help="--only early: the trunk steps it branches from")
    ap.add_argument("--prompts", type=int, default=N_PROMPTS,
                    help="the trunk's fixed set: the sets task's first n eval prompts")
    ap.add_argument("--chunk", type=int, default=50, help="trunk steps between plateau tests")
    ap.add_argument("--max_steps", type=int, default=2000, help="the trunk's most steps")
    ap.add_argument("--trunk_cap", type=float, default=3600, help="the trunk's CPU seconds")
    ap.add_argument("--window", type=int, default=100, help="the plateau rule's steps")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                    help="the arms' seeds")
    ap.add_argument("--jobs", type=int, default=2, help="arm runs at once (one thread each)")
    ap.add_argument("--cap", type=float, default=2400, help="an arm run's CPU seconds at most")
    ap.add_argument("--report", action="store_true", help="tables and figure from the raw files")
    a = ap.parse_args(argv)
    # Every flag, folder and raw file checked before anything is made or run.
    for name in ("chunk", "max_steps", "window", "prompts", "jobs"):
        if getattr(a, name) < 1:
            fail(f"--{name} {getattr(a, name)}: need >= 1")
    if a.window < 3 * EVAL_EVERY:
        fail(f"--window {a.window}: the plateau rule fits a line to the evaluations of the last "
             f"--window steps, one every {EVAL_EVERY}: it needs >= {3 * EVAL_EVERY} (3 of them)")
    # The trunk's runs train on the set's first n prompts: past the set, they would refuse, each
    # in its own log.
    if a.prompts > data.SETS_N:
        fail(f"--prompts {a.prompts}: the sets task holds {data.SETS_N} prompts")
    study.finite_positive("--trunk_cap", a.trunk_cap)  # CPU seconds
    study.finite_positive("--cap", a.cap)
    study.check_seeds(a.seeds)
    out, raw = Path(a.out), Path(a.raw)
    study.check_folder("--raw", raw, files=("report.md", "revival.png"))
    if a.report:
        if not (raw / "trunk" / "plateau.json").is_file():
            fail(f"--report: {raw / 'trunk' / 'plateau.json'} is missing: nothing to report (run "
                 "the trunk first)")
        text = report(raw)  # (every raw file read and measured before anything is written)
        early_text = None
        if (raw / "early" / "trunk").is_dir():
            study.check_folder("--raw", raw / "early", files=("report.md",))
            early_text = early_report(raw)
        study.write_outputs(raw, {"report.md": study.text_writer(text),
                                  "revival.png": lambda path: figure(raw, path)})
        if early_text is not None:
            study.write_outputs(raw / "early", {"report.md": study.text_writer(early_text)})
        print(text)
        if early_text is not None:
            print(early_text)
        return
    study.check_folder("--out", out)
    if a.only == "early":
        if a.prompts != N_PROMPTS:
            fail(f"--prompts {a.prompts}: the early branches are the {N_PROMPTS}-prompt trunk's")
        check_branch_steps(a.branch_steps, raw)
        run = early_trunk_run(out, raw, max(a.branch_steps))
        run.check()
        study.read_raw(raw / "early")
        study.pending(early_jobs(out, raw, a.seeds, a.branch_steps, a.cap))
        study.make_folders(raw / "early", out / "early")
        with study.DriverLock(out):
            early(out, raw, a.seeds, a.branch_steps, a.cap)
        return
    study.read_raw(raw, groups=("arms",))
    study.check_trunk_raw(raw / trunk_name(a.prompts), trunk_flags(a.prompts), PLATEAU_KEYS)
    run = trunk_run(out, raw, a.chunk, a.max_steps, a.prompts)
    if a.only in (None, "trunk"):
        run.check()
    if a.only in (None, "arms"):
        study.pending(arm_jobs(out, raw, a.seeds, a.cap, a.prompts))
    if a.only == "arms":  # (with the trunk, its plateau is looked for once it has run)
        check_plateau(out, raw, a.prompts)
    study.make_folders(raw, out)
    with study.DriverLock(out):  # one driver at a time on --out
        if a.only in (None, "trunk"):
            record = trunk(out, raw, a.chunk, a.max_steps, a.trunk_cap, a.window, a.prompts)
            print(json.dumps({k: v for k, v in record.items() if k != "stuck"}), flush=True)
            if not record:
                return
        if a.only in (None, "arms"):
            arms(out, raw, a.seeds, a.jobs, a.cap, a.prompts)

if __name__ == "__main__":
    main()
