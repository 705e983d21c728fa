"""
smollm2_breadth_study.py: breadth on a real model. SmolLM2-135M-Instruct on two-digit additions
(`--preset smollm2`: T 0.6, lr 1e-5, two mini-batches, dynamic sampling of at most two rounds),
every run from the same pretrained start, `--steps` steps (default 4) and an evaluation at the
first and the last, three arms on the same seeds:

  n16      N = 16, B = 4    the preset (ProRL's shape on this task)
  n64      N = 64, B = 4    breadth: 4x the rollouts a prompt at equal B, steps, lr, mini-batches
  n16b16   N = 16, B = 16   N = 16 for as many rollouts a step as n64 (the equal-compute control)

Why 64 and not 512: on this CPU a step of n16 costs about 80 CPU s and a step's cost grows with
its rollouts; n64 costs about 4x, N = 512 about 32x (some 45 CPU min a step). The plan's estimate
is printed before any run. Each run's metrics.jsonl, the raw result, is copied to
<raw>/arms/<arm>/seed<S>.jsonl when it ends (tools/study.py: a killed study's rerun goes on from
the raw files; a run cut short starts over). Runs go seed by seed, so a study cut short is
balanced. With --census K, each finished run's end is then censused on the first K held-out
prompts (tools/census.py, the base census's flags, 512 samples at T 1), into
<raw>/census-arm-<arm>-s<S>: unbiased pass@k to 512 for each arm's end.

--report reads the raw files alone and writes <raw>/report.md and <raw>/figure.png: per arm the
held-out pass@1, pass@4 and greedy pass@1 (32 prompts x 4 samples at T 0.6, top_p 0.95), entropy,
rollouts sampled, optimizer updates and training CPU seconds; the arms against n16: paired t by seed
(same start, same eval prompts and eval draws), Welch's difference with its 95% interval and the
exact Mann-Whitney p over seeds, and a sign test over the 32 held-out prompts (right answers summed
over seeds); then every reach census found in <raw>/census-* (tools/census.py: each prompt's Q from
512 samples at T 1), the base's against each trained one: zones, unbiased pass@k to 512, zone
moves and the prompts whose Q fell; each arm's end census against n16's of the same seed.

  python -m tools.smollm2_breadth_study --out runs/smollm2-breadth            # 3 arms x 3 seeds
  python -m tools.smollm2_breadth_study --out runs/smollm2-breadth --arms n16 n64 --seeds 0
  python -m tools.smollm2_breadth_study --out runs/smollm2-breadth --census 12  # + end censuses
  python -m tools.smollm2_breadth_study --report                              # from the raw files
"""

import argparse
import re
import statistics
from pathlib import Path

from lib.errors import fail
from tools import census, stats, study

HERE = Path(__file__).resolve().parent.parent
RAW = HERE / "assets" / "smollm2-breadth"
PRESET = HERE / "assets" / "smollm2"  # the preset's 8-step runs
# The 256-row arms' updates go 64 rows a forward and backward (--micro_batch: memory only, the
# same mini-batch's gradient): whole 128-row mini-batches took 10-12 GB each, two of them more than
# this CPU's 24 GB. The n16 arm's 32-row mini-batches are one micro-batch either way.
MICRO = ["--micro_batch", "64"]
ARMS = {"n16": [], "n64": ["--n_rollouts", "64", *MICRO],
        "n16b16": ["--prompts_per_step", "16", *MICRO]}
ROLLOUTS = {"n16": 64, "n64": 256, "n16b16": 256}  # kept rollouts a step (N x B)
# The plan's CPU costs, measured on the preset (2-core x86_64, one thread, fp32): a step's CPU s
# per kept rollout (611-643 CPU s for 8 steps of 64), and one evaluation with start-up.
STEP_CPU_PER_ROLLOUT, EVAL_CPU = 1.2, 80
CENSUS_CPU = 90  # a trained model's census, CPU s a prompt (512 samples; the base's ~150)
HELD_OUT = 64  # the censuses' held-out prompts
CENSUS_FLAGS = ["--preset", "smollm2", "--temperature", "1", "--eval_prompts", str(HELD_OUT)]


# The study's runs are fp32, as its raw files were made (before --dtype auto chose bf16 on a CPU
# that computes it natively): a new arm or seed is comparable with them on any CPU.
DTYPE = ["--dtype", "float32"]


def jobs(arms: list, seeds: list, steps: int, out: Path, raw: Path) -> list:
    return [study.Job(f"{arm} seed {s}", ["--preset", "smollm2", *DTYPE, *ARMS[arm],
                                          "--steps", str(steps),
                                          "--eval_every", str(steps), "--seed", str(s),
                                          "--out", str(out / arm / f"seed{s}")],
                      out / arm / f"seed{s}", raw / "arms" / arm / f"seed{s}.jsonl",
                      out / arm / f"seed{s}.log")
            for s in seeds for arm in arms]


def end_census_problem(arm: str, seed: int, out: Path, raw: Path) -> str:
    """Why the census of this arm run's end cannot go on, or '': its census folder must hold a
    census of this run's checkpoint (census.py's header: the flags after --, and its records
    whole; one that is not a census at all is census.py's one line), and once the run has ended
    (its raw file there), the checkpoint must be the raw file's last step with no live run in its
    folder."""
    run_dir, rows = out / arm / f"seed{seed}", raw / "arms" / arm / f"seed{seed}.jsonl"
    head = raw / f"census-arm-{arm}-s{seed}" / "census.json"
    want = [*CENSUS_FLAGS, "--model", str(run_dir / "ckpt")]
    if head.is_file():
        header = census.read_header(head)
        if (have := header.get("argv")) != want:
            return (f"{head}: a census of {' '.join(map(str, have or ['nothing']))}, not of "
                    f"{want[-1]}: move it away")
        census.read_records(head.with_name("census.jsonl"), header)
    if not rows.is_file():  # (a run still to do: its end is checked when it has ended)
        return ""
    if holder := study.lock_holder(run_dir):
        return f"{run_dir}: a live run (pid {holder}) holds it"
    end, step = study.raw_rows(rows)[-1]["step"], study.ChunkedRun.checkpoint_step(run_dir)
    if step != end or not (run_dir / "ckpt" / "model.safetensors").is_file():
        return (f"{run_dir}: its checkpoint is at step {step}, {rows} ends at step {end}: not "
                "this run's end (rerun the arm into --out)")
    return ""


def end_censuses(arms: list, seeds: list, first: int, out: Path, raw: Path,
                 parallel: int) -> list:
    """A reach census of each finished run's end checkpoint (tools/census.py, the base census's
    flags, one thread), seed by seed, `parallel` at a time; a census cut short goes on where it
    stopped; a census that cannot go on (end_census_problem) stops the driver first, in one line.
    Returns the lines of those that failed."""
    import sys
    todo = [(arm, s) for arm, s in censuses_to_do(arms, seeds, first, raw)
            if (raw / "arms" / arm / f"seed{s}.jsonl").is_file()]
    check_end_censuses(todo, out, raw)

    def one(arm_seed) -> str:
        arm, s = arm_seed
        ckpt, log = out / arm / f"seed{s}" / "ckpt", out / arm / f"seed{s}-census.log"
        argv = [sys.executable, "-m", "tools.census", "--out",
                str(raw / f"census-arm-{arm}-s{s}"), "--samples", "512", "--first", str(first),
                "--", *CENSUS_FLAGS, "--model", str(ckpt)]
        return study.run_logged(f"census of {arm} seed {s}", argv, log)

    return study.in_parallel(one, todo, parallel)


def censuses_to_do(arms: list, seeds: list, first: int, raw: Path) -> list:
    """The (arm, seed) pairs whose end census has fewer than `first` prompts recorded, seed by
    seed."""
    def recorded(folder: Path) -> int:  # (census.py's reader: a bad file is its one line)
        head = folder / "census.json"
        return len(census.read_records(folder / "census.jsonl", census.read_header(head))) \
            if head.is_file() else 0
    return [(arm, s) for s in seeds for arm in arms
            if recorded(raw / f"census-arm-{arm}-s{s}") < first]


def check_end_censuses(pairs: list, out: Path, raw: Path):
    """The first end census of `pairs` that cannot go on (end_census_problem), as one line: run in
    main before --out or the lock is made (the runs still to do are checked again once ended)."""
    for arm, s in pairs:
        if problem := end_census_problem(arm, s, out, raw):
            fail(f"census of {arm} seed {s}: {problem}")


def plan(todo: list, steps: int, censuses: int = 0, first: int = 0) -> str:
    """The CPU estimate of the runs still to do, by arm, and of the end censuses (at most one a
    run, `first` prompts each; those already recorded are not subtracted)."""
    per_run = {a: steps * ROLLOUTS[a] * STEP_CPU_PER_ROLLOUT + 2 * EVAL_CPU for a in ARMS}
    cost = [per_run[j.name.split()[0]] for j in todo]
    return (f"plan: {len(todo)} run(s) to do, about {sum(cost) / 3600:.1f} CPU hours ("
            + ", ".join(f"{a} {per_run[a] / 60:.0f} CPU min a run" for a in ARMS) + ")"
            + (f"; then at most {censuses} end census(es) of {first} prompts, about "
               f"{censuses * first * CENSUS_CPU / 3600:.1f} CPU hours" if censuses else ""))


# ----------------------------------------------------------------------------
# The report, from the raw files alone


def measure(rows: list) -> dict:
    first, last = rows[0], rows[-1]
    steps = [r for r in rows if r["step"] > 0]
    return dict(pass1_start=first["eval_pass@1"], pass1=last["eval_pass@1"],
                pass4=last["eval_pass@4"], greedy=last["eval_greedy_pass@1"],
                entropy=statistics.fmean(r["entropy"] for r in steps),
                len_end=last["eval_resp_len"], sampled=sum(r["samples"] for r in steps),
                keep=statistics.fmean(r["keep_rate"] for r in steps),
                updates=2 * len(steps), cpu_s=last["time_train_cpu"],
                correct=last["eval_correct"])


def read(raw: Path) -> dict:
    """{arm: {seed: measures}} of every raw file, each measured (one line if one is not a run of
    this study)."""
    data = study.read_raw(raw, ["arms"]).get("arms", {})
    if unknown := sorted(set(data) - set(ARMS)):
        fail(f"{raw / 'arms' / unknown[0]}: not an arm of this study ({', '.join(ARMS)})")
    return {arm: {s: study.measured(raw / "arms" / arm / f"seed{s}.jsonl", measure, rows)
                  for s, rows in sorted(runs.items())}
            for arm, runs in sorted(data.items(), key=lambda kv: list(ARMS).index(kv[0]))}


# sampled: rollouts generated (dropped groups too); updates: two mini-batches a step (the preset's).
COLUMNS = ["pass1_start", "pass1", "pass4", "greedy", "entropy", "len_end", "keep", "sampled",
           "updates", "cpu_s"]


def arm_table(data: dict) -> list:
    lines = ["| arm | seeds | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 2) + "|"]
    for arm, runs in data.items():
        cells = []
        for c in COLUMNS:
            xs = [m[c] for m in runs.values()]
            sd = f" +- {statistics.stdev(xs):.3g}" if len(xs) > 1 else ""
            cells.append(f"{statistics.fmean(xs):.4g}{sd}")
        lines.append(f"| {arm} | {len(runs)} | " + " | ".join(cells) + " |")
    lines += ["", "Per seed, held-out pass@1 at the end: "
              + "; ".join(f"{arm} " + ", ".join(f"{m['pass1']:.3f}" for m in runs.values())
                          for arm, runs in data.items())]
    return lines


def tests(data: dict, base: str = "n16", arms=None) -> list:
    """Each arm's end pass@1 against base's: by prompt (each held-out prompt's right answers summed
    over the shared seeds, 4 samples a seed: a sign test), and from two seeds on, paired by seed
    and unpaired over seeds."""
    lines = ["", f"Held-out pass@1 at the end, each arm against {base}:", ""]
    for arm, runs in data.items():
        seeds = sorted(set(runs) & set(data.get(base, {})))
        if arm == base or not seeds or (arms and arm not in arms):
            continue
        a, b = [runs[s]["pass1"] for s in seeds], [data[base][s]["pass1"] for s in seeds]
        by_prompt = [sum(runs[s]["correct"][i] - data[base][s]["correct"][i] for s in seeds)
                     for i in range(len(runs[seeds[0]]["correct"]))]
        up, down = sum(x > 0 for x in by_prompt), sum(x < 0 for x in by_prompt)
        prompts = (f"by prompt {up} up, {down} down, {len(by_prompt) - up - down} even, sign test "
                   f"p {stats.sign_test(by_prompt):.3g}")
        if len(seeds) < 2:
            lines.append(f"- {arm} - {base}: {a[0] - b[0]:+.4f} on seed {seeds[0]} alone (no "
                         f"test over seeds); {prompts}")
            continue
        c = stats.paired(a, b)
        lines.append(f"- {arm} - {base}, on the {c['n']} shared seeds: {c['d']:+.4f} (Welch 95% "
                     f"interval {c['lo']:+.4f} .. {c['hi']:+.4f}); paired t p {c['p']:.3g}; exact "
                     f"Mann-Whitney p {stats.mann_whitney(a, b):.3g}; {prompts}")
    return lines


def preset_lines() -> list:
    """The preset's own 8-step runs (docs/results/smollm2.md's raw files), for the cost: n16 for
    twice the steps."""
    runs = {s: study.measured(PRESET / f"seed{s}.jsonl", measure, study.raw_rows(PRESET /
                              f"seed{s}.jsonl")) for s in (0, 1, 2)
            if (PRESET / f"seed{s}.jsonl").is_file()}
    if not runs:
        return []
    return ["", "n16 for 8 steps (the preset's runs, assets/smollm2/seed<S>.jsonl): end pass@1 "
            + ", ".join(f"{m['pass1']:.3f}" for m in runs.values()) + "; training CPU s "
            + ", ".join(f"{m['cpu_s']:.0f}" for m in runs.values()) + "; rollouts sampled "
            + ", ".join(str(m["sampled"]) for m in runs.values())
            + f" (seeds {', '.join(map(str, runs))})"]


def censuses(raw: Path) -> tuple:
    """(name, records) of every census folder in raw (census-*) that recorded a prompt, the base's
    first; and the names of those started with none recorded yet (census.json alone)."""
    dirs = sorted((p for p in raw.glob("census-*") if (p / "census.json").is_file()),
                  key=lambda p: (p.name != "census-base", p.name))
    started = [d.name for d in dirs if not (d / "census.jsonl").is_file()]
    return [(d.name, census.load(d)) for d in dirs if d.name not in started], started


def census_section(found: list, started: list = ()) -> list:
    """The censuses' table, then the base's records against each trained one's, over the prompts
    both recorded (a census is recorded prompt by prompt, in the same order), then each arm's end
    against n16's."""
    if not found:
        return []
    lines = ["", "## Reach censuses (tools/census.py; each prompt's Q from its samples at T 1)",
             ""] + census.table(found)
    if started:
        lines += ["", "Started, no prompt recorded yet: " + ", ".join(started)]
    if found[0][0] == "census-base":
        for name, rows in found[1:]:
            n = min(len(rows), len(found[0][1]))
            lines += ["", f"### census-base -> {name}, their first {n} prompts", ""]
            lines += census.moves_lines(("census-base", found[0][1][:n]), (name, rows[:n]))
    return lines + arm_census_table(found) + arm_census_lines(found)


def arm_censuses(found: list) -> tuple:
    """The arms' end censuses ({arm: {seed: records}}, census-arm-<arm>-s<S>) cut to the first n
    prompts every one of them and the base census recorded, and n."""
    ends = {}
    for name, rows in found:
        m = re.fullmatch(r"census-arm-(\w+)-s(\d+)", name)
        if m:
            ends.setdefault(m[1], {})[int(m[2])] = rows
    base = dict(found).get("census-base")
    if not ends or base is None:
        return {}, 0
    n = min(len(base), *(len(r) for seeds in ends.values() for r in seeds.values()))
    return {a: {s: r[:n] for s, r in sorted(seeds.items())} for a, seeds in ends.items()}, n


def arm_census_table(found: list) -> list:
    """Each arm's end censuses over the prompts all censuses share, per seed: unbiased pass@k, the
    prompts in the base's reach window that reached 1/16, and those whose Q fell below the base's;
    then each arm against n16, and n64 against n16b16, on the shared seeds (paired t, Welch)."""
    ends, n = arm_censuses(found)
    if not ends:
        return []
    base = [r["right"] / r["samples"] for r in dict(found)["census-base"][:n]]
    window = [i for i, q in enumerate(base) if census.zone(q) == "window"]

    def measures(rows):
        q = [r["right"] / r["samples"] for r in rows]
        at = census.summary(rows)["pass_at_k"]
        return dict(**{f"pass@{k}": at[k] for k in (1, 16, 256, 512)},
                    crossed=sum(q[i] >= census.HIGH for i in window),
                    fell=sum(a < b for a, b in zip(q, base)))

    m = {a: {s: measures(r) for s, r in seeds.items()} for a, seeds in ends.items()}
    keys = ["pass@1", "pass@16", "pass@256", "pass@512", "crossed", "fell"]
    lines = ["", f"### The arms' ends, censused (the first {n} prompts; {len(window)} in the "
             "base's window; per seed, in seed order)", "",
             "| arm | seeds | pass@1 (mean Q) | pass@16 | pass@256 | pass@512 | base-window "
             "prompts at >= 1/16 | prompts below the base's Q |", "|---" * 8 + "|"]
    for arm in [a for a in ARMS if a in m]:
        cell = lambda k: ", ".join(f"{x[k]:.3g}" if isinstance(x[k], float) else str(x[k])
                                   for x in m[arm].values())
        lines.append(f"| {arm} | {' '.join(map(str, m[arm]))} | "
                     + " | ".join(cell(k) for k in keys) + " |")
    tested = []
    # Each arm against n16 (the preset), and n64 against n16b16 (as many kept rollouts).
    for arm, other in [(a, "n16") for a in ARMS if a != "n16"] + [("n64", "n16b16")]:
        seeds = sorted(set(m.get(arm, {})) & set(m.get(other, {})))
        for k in ("pass@1", "pass@256"):
            if len(seeds) < 2:
                continue
            c = stats.paired([m[arm][s][k] for s in seeds], [m[other][s][k] for s in seeds])
            tested.append(f"- {arm} - {other}, {k} of the ends, on the {c['n']} shared seeds: "
                          f"{c['d']:+.4f} (Welch 95% interval {c['lo']:+.4f} .. {c['hi']:+.4f}); "
                          f"paired t p {c['p']:.3g}")
    return lines + ([""] + tested if tested else [])


def arm_census_lines(found: list) -> list:
    """Each arm's end census against n16's of the same seed, over the prompts all censuses share:
    each prompt's Q higher or lower (a sign test over prompts), the zone moves, the falls."""
    ends, n = arm_censuses(found)
    lines = []
    for arm, seeds in ends.items():
        for s, rows in seeds.items():
            if arm == "n16" or s not in ends.get("n16", {}):
                continue
            before, name = ends["n16"][s], f"census-arm-{arm}-s{s}"
            diffs = [r["right"] / r["samples"] - b["right"] / b["samples"]
                     for b, r in zip(before, rows)]
            up, down = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
            lines += ["", f"### census-arm-n16-s{s} -> {name}, their first {n} prompts", "",
                      f"Q higher on {up} prompts, lower on {down}, equal on {n - up - down} "
                      f"(sign test p {stats.sign_test(diffs):.3g}).", ""]
            lines += census.moves_lines((f"census-arm-n16-s{s}", before), (name, rows))
    return lines


def report(raw: Path) -> str:
    data, found = read(raw), censuses(raw)
    if not data and not any(found):  # (a missing or empty --raw: no report of nothing)
        study.nothing_to_report(raw, "<raw>/arms/<arm>/seed<S>.jsonl, <raw>/census-*/census.json")
    lines = ["# Breadth on SmolLM2-135M-Instruct: the raw files' numbers", ""]
    if data:
        lines += ["## The arms (held-out: 32 prompts x 4 samples at T 0.6, top_p 0.95)", ""]
        # n64 against n16 (breadth at equal B) and against n16b16 (at equal kept rollouts)
        lines += arm_table(data) + tests(data) + tests(data, "n16b16", ["n64"]) + preset_lines()
    return "\n".join(lines + census_section(*found)).rstrip() + "\n"


def figure(raw: Path, path: Path):
    """Left: held-out pass@1 at the start and the end, each seed a line, by arm. Middle: each
    census's unbiased pass@k against k (an arm's ends: the mean over its seeds). Right: each
    prompt's Q in the base census against a trained one's (log scale), the reach window shaded."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, cx, bx) = plt.subplots(1, 3, figsize=(16, 4.2))
    for k, (arm, runs) in enumerate(read(raw).items()):
        for s, m in runs.items():
            ax.plot([0, 1], [m["pass1_start"], m["pass1"]], color=f"C{k}", alpha=0.7,
                    label=arm if s == min(runs) else None)
    ax.set(xticks=[0, 1], xticklabels=["start", "end"], ylabel="held-out pass@1 (T 0.6)",
           title="arms, each seed a line")
    ax.legend()
    # The censuses in groups: each arm's end censuses (its seeds, on the prompts all share) in
    # the arm's colour on the left, every other census alone.
    found = censuses(raw)[0]
    ends, n = arm_censuses(found)
    groups = [(name, "k" if name == "census-base" else "C3", [rows]) for name, rows in found
              if not name.startswith("census-arm-")]
    groups += [(f"{arm} end ({len(ends[arm])} seeds)", f"C{k}", list(ends[arm].values()))
               for k, arm in enumerate(a for a in ARMS if a in ends)]
    for name, color, members in groups:
        at = [census.summary(rows)["pass_at_k"] for rows in members]
        ks = sorted(at[0])
        cx.plot(ks, [statistics.fmean(x[j] for x in at) for j in ks], marker="o", ms=3,
                color=color, label=f"{name}, {len(members[0])} prompts")
    cx.set(xscale="log", xlabel="k", ylabel="unbiased pass@k (T 1), mean over seeds",
           title="censuses: pass@k")
    if groups:
        cx.legend(fontsize=7)
    floor = 1 / 4096  # where a prompt with no right answer is drawn: below the window
    q = lambda r: max(r["right"] / r["samples"], floor)
    base = dict(found).get("census-base")
    for name, color, members in (groups[1:] if base else []):
        pairs = [(q(b), q(r)) for rows in members for b, r in zip(base, rows)]
        bx.scatter(*zip(*pairs), s=14, color=color, alpha=0.6, label=name, zorder=3)
    bx.axvspan(census.LOW, census.HIGH, color="0.85", alpha=0.5, zorder=0)
    bx.axhspan(census.LOW, census.HIGH, color="0.85", alpha=0.5, zorder=0)
    bx.plot([floor, 1], [floor, 1], color="0.5", lw=0.8)
    bx.set(xscale="log", yscale="log", xlabel="Q, base (T 1; none right drawn at 1/4096)",
           ylabel="Q, trained", title="reach census (each seed a point), window shaded")
    if len(groups) > 1:
        bx.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.smollm2_breadth_study",
                                 description=__doc__.strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/smollm2-breadth", help="run directories")
    ap.add_argument("--raw", default=str(RAW), help="raw results (default: assets/smollm2-breadth)")
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="default 0 1 2")
    ap.add_argument("--steps", type=int, default=4, help="steps a run (default 4)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once, one thread each")
    ap.add_argument("--census", type=int, metavar="K", help="then census each run's end on the "
                    "first K held-out prompts (512 samples at T 1; <raw>/census-arm-<arm>-s<S>)")
    ap.add_argument("--report", action="store_true", help="tables and figure from --raw")
    args = ap.parse_args(argv)
    raw, out = Path(args.raw), Path(args.out)
    study.check_seeds(args.seeds)
    study.check_distinct("--arms", args.arms)
    for flag, value in (("--steps", args.steps), ("--jobs", args.jobs), ("--census", args.census)):
        if value is not None and value < 1:
            fail(f"{flag} {value}: need >= 1")
    if args.census is not None and args.census > HELD_OUT:
        fail(f"--census {args.census}: the held-out set has {HELD_OUT} prompts")
    study.check_folder("--raw", raw, files=("report.md", "figure.png"))
    if args.report:
        text = report(raw)  # every raw file read and measured before anything is written
        study.write_outputs(raw, {"report.md": study.text_writer(text),
                                  "figure.png": lambda path: figure(raw, path)})
        print(text, end="")
        return
    study.check_folder("--out", out)
    read(raw)
    todo = study.pending(jobs(args.arms, args.seeds, args.steps, out, raw))
    if args.census:  # each census folder, and each ended run's, before --out and the lock
        check_end_censuses(censuses_to_do(args.arms, args.seeds, args.census, raw), out, raw)
    print(plan(todo, args.steps, args.census and len(args.arms) * len(args.seeds),
               args.census or 0), flush=True)
    study.make_folders(raw, out)
    with study.DriverLock(out):
        study.exit_if_failed(study.run_jobs(todo, args.jobs))
        if args.census:
            study.exit_if_failed(end_censuses(args.arms, args.seeds, args.census, out, raw,
                                              args.jobs))


if __name__ == "__main__":
    main()
