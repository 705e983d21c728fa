"""
smollm2_revival_study.py: the paper's experiment on a real model. Does breadth revive a
SmolLM2-135M-Instruct run that more steps at N = 16 no longer improve (docs/paper.md §1, §4)?
Three phases of runs (trunk, census, arms), each a subprocess on one thread, a plan and a report:

  trunk   ProRL's shape: the preset (`--preset smollm2`: two-digit additions, N = 16, B = 4,
          lr 1e-5, T 0.6, 48 new tokens, two mini-batches, at most two sampling rounds) with a
          larger evaluation, in bf16 autocast (--dtype bfloat16: the same on every CPU a rerun
          meets; on one without native bf16 it is slower, not different), in chunks of
          --chunk steps (tools/study.py's ChunkedRun: whatever killed the study, the same command
          goes on from the last recorded chunk), until the plateau rule below holds.
  census  at the plateau, before any arm: the first --census_prompts held-out prompts x 512
          samples at the training temperature (tools/census.py), and the go/no-go below.
  plan    each arm's CPU hours from measured costs (plan(); --plan), printed before the arms.
  arms    only on a go: from the plateau checkpoint (its weights and AdamW moments), seeds 0-4,
          each arm one run a seed, then each run's end censused (END_PROMPTS x END_SAMPLES):
            n16       N = 16 continued, STEPS steps
            n256      N = 256 at equal steps and lr
            n256-lr   N = 256 at the paper's lr rule, lr x sqrt(256 / 16)
            n16-long  N = 16 for as many rollouts as n256 (16x the steps)
  report  each arm against n16, paired by seed (report(): written before any arm's end was read):
          held-out pass@1 at the end, and the end censuses' pass@1, pass@16, pass@256 and the
          plateau census's reach prompts lifted to >= 1/16; per test the mean difference, its paired
          interval, paired t and sign p, and the power at the seeds run for an effect fixed now.

The plateau, fixed before the trunk ran: at an eval step s >= WINDOW, over the evaluations in
(s - WINDOW, s] (one every EVAL_EVERY steps), the ordinary least squares slope against the step of
  - held-out pass@1 (eval_pass@1: 128 held-out problems x 8 samples at T 0.6, top_p 0.95), and
  - the probe's mean Q (mass_mean: 48 of those problems x 16 samples at the training temperature,
    the census's measure on fewer samples),
each has a 95% interval (Student's t) that holds 0 and lies within +-SLOPE_BOUND per 100 steps.
A plateau whose held-out pass@1 is >= SATURATED is a saturation, one <= WALL a wall: either is
said, and the task's difficulty changed once before any arm (docs/results/smollm2-revival.md); on
the harder task (a testbed with a start) no second change: its census runs all the same (fixed
before add3's trunk reached a verdict) and its go or no-go decides.
If the trunk reaches its cap (--max_steps, --trunk_cap) first, the branch is the cap's checkpoint
and its record says no plateau held (cap_record: fixed at step 200, before any later evaluation
was read); a saturation or a wall there is judged on the window's mean held-out pass@1.

The go/no-go, fixed before the census ran: prompts whose whole 95% Clopper-Pearson interval of Q
lies in [1/512, 1/16) are in N = 512's reach and out of N = 16's (N = 512 draws a right answer in
most steps, N = 16 in few). Go if there are at least GO_PROMPTS of them: with fewer, an arm's
revivals could not exceed what seed noise gives (the toy's N = 16 revived 0-3 prompts).

Raw files, committed as they land: assets/smollm2-revival/trunk/metrics.jsonl (rewritten after
each chunk, the trunk's flags in its first row), trunk/chunks.jsonl (each chunk's steps and CPU
seconds), trunk/plateau.json (the rule's numbers at the branch point), census-plateau/ (the census
and go.json), arms/<arm>/seed<S>.jsonl (each arm run's metrics.jsonl), census-arms/<arm>/seed<S>/.

Testbeds (TESTBEDS, --testbed): add2, the preset's two-digit sums from the pretrained model, its
files at the top of --raw and --out; add3, fixed after add2's no-go, before its trunk ran:
three-digit sums from add2's branch point, a 100-step plateau window, its files under add3/.

  python -m tools.smollm2_revival_study --out runs/smollm2-revival               # trunk, census
  python -m tools.smollm2_revival_study --out runs/smollm2-revival --only trunk
  python -m tools.smollm2_revival_study --testbed add3                            # the second
  python -m tools.smollm2_revival_study --report                                  # the tests
  python -m tools.smollm2_revival_study --testbed add3 --plan                     # arms' CPU
"""

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from lib.errors import fail
from lib.rundir import write_atomic
from tools import census, stats, study

HERE = Path(__file__).resolve().parent.parent
RAW = HERE / "assets" / "smollm2-revival"
EVAL_EVERY = 10  # the trunk's evaluations: every 10 steps (each chunk's end)
WINDOW = 60  # the plateau rule's trailing steps: the evaluations at s - 50, ..., s (six)
SLOPE_BOUND = 0.10  # the slopes' intervals within +-this per 100 steps
SATURATED, WALL = 0.95, 0.05  # held-out pass@1 at a plateau that is no testbed
CENSUS_PROMPTS = 64  # the census's prompts: the first 64 of the trunk's 128 held-out prompts
REACH = (1 / 512, 1 / 16)  # N = 512's reach and not N = 16's: Q in [1/512, 1/16)
GO_PROMPTS = 4  # the go/no-go: at least this many census prompts resolved inside REACH
TRUNK_FLAGS = ["--preset", "smollm2", "--dtype", "bfloat16", "--eval_every", str(EVAL_EVERY),
               "--eval_prompts", "128", "--eval_samples", "8", "--probe_prompts", "48",
               "--probe_samples", "16", "--seed", "0"]
PLATEAU_KEYS = ("step", "pass1", "mass", "plateau", "verdict")


@dataclass(frozen=True)
class Testbed:
    """A trunk, its census and (on a go) its arms, under <raw>/<folder> and <out>/<folder>."""
    folder: str  # "": at the top of --raw and --out
    task: tuple  # flags beyond TRUNK_FLAGS (the trunk's, the census's and the arms')
    window: int  # the plateau rule's trailing steps
    start: str = ""  # the testbed from whose branch point (weights, AdamW moments) the trunk starts
    pilot: str = ""  # the folder under --raw of its measured N = BIG steps and census prompts


TESTBEDS = {
    "add2": Testbed("", (), WINDOW),
    # Fixed after add2's census, before this trunk ran: add2's trunk reached its cap (the rule's
    # verdict, window mean 0.913 < SATURATED) and its census was a no-go, 49 of 64 prompts right in
    # all 512 samples (mean Q 0.953): near saturation, judged after the no-go; the task made harder
    # once. Three-digit sums (assets/smollm2/add3.jsonl, drawn as add2's), continued from add2's
    # branch point (its step 300 scored 0.572 held-out pass@1 on them, pass@8 0.672: room above
    # and a reach below), so that the format is not learnt again.
    # Its window is 100 steps (ten evaluations): at add2's evaluation noise a 60-step window's
    # probe Q slope intervals were +-0.11 to +-0.46 a 100 steps (pass@1's +-0.07 to +-0.27), mostly
    # wider than the bound they had to fit in.
    "add3": Testbed("add3", ("--task", "math:assets/smollm2/add3.jsonl"), 100, start="add2",
                    pilot="add3-pilot"),
}


def trunk_flags(bed: Testbed, out_root: Path) -> list:
    """A testbed's trunk's flags: TRUNK_FLAGS, its task's, and where it starts from."""
    start = (["--init_from", str(out_root / TESTBEDS[bed.start].folder / "trunk-branch"),
              "--init_optimizer"] if bed.start else [])
    return [*TRUNK_FLAGS, *bed.task, *start]

# The arms, from the plateau's checkpoint with its AdamW moments, one run a seed. N = 256, not 512:
# the largest N whose two arms fit the plan at 5 seeds (docs/results/smollm2-revival.md).
STEPS, BIG = 4, 256
LR = 1e-5  # the preset's; the paper's rule: x sqrt(samples a step's ratio) = x sqrt(BIG / 16)
ARMS = {  # name: (flags, steps)
    "n16": ([], STEPS),
    f"n{BIG}": (["--n_rollouts", str(BIG), "--micro_batch", "64"], STEPS),
    f"n{BIG}-lr": (["--n_rollouts", str(BIG), "--micro_batch", "64", "--lr",
                    f"{LR * (BIG / 16) ** 0.5:g}"], STEPS),
    "n16-long": ([], STEPS * BIG // 16),  # N = 16 for as many rollouts as N = BIG's
}
END_PROMPTS, END_SAMPLES = 48, 256  # each arm's end censused on the plateau census's first 48
# The effects each test's power is computed for, fixed before any arm ran: a held-out pass@1 or a
# census pass@k of +0.05, and one more reach prompt lifted to >= 1/16.
# The lenient measures (the last number of a response read as its answer, whatever its form) beside
# the rules' say how much of a difference is the answer's form and how much its sum.
EFFECT = {"held-out pass@1": 0.05, "held-out lenient pass@1": 0.05, "pass@1": 0.05,
          "lenient pass@1": 0.05, "pass@16": 0.05, "pass@256": 0.05, "reach prompts lifted": 1.0}


def slope_test(points: list) -> dict:
    """The OLS slope per 100 steps of (step, value) points, its 95% interval, and whether it holds
    the plateau: the interval holds 0 and lies within +-SLOPE_BOUND."""
    b, lo, hi = (100 * v for v in stats.slope(*zip(*points)))
    return dict(slope_per_100=b, ci_low=lo, ci_high=hi,
                flat=lo <= 0 <= hi and -SLOPE_BOUND <= lo and hi <= SLOPE_BOUND)


def plateau_test(rows: list, steps: int = WINDOW) -> dict:
    """The plateau rule at the trunk's last evaluation (the module's docstring), over a trailing
    window of `steps` steps."""
    evals = [r for r in rows if "eval_pass@1" in r and "mass_mean" in r]
    last = evals[-1]["step"]
    window = [r for r in evals if r["step"] > last - steps]
    if last < steps or len(window) < 3:
        return dict(step=last, plateau=False)
    pass1 = slope_test([(r["step"], r["eval_pass@1"]) for r in window])
    mass = slope_test([(r["step"], r["mass_mean"]) for r in window])
    level = window[-1]["eval_pass@1"]
    plateau = pass1["flat"] and mass["flat"]
    verdict = ("" if not plateau else "saturated" if level >= SATURATED else
               "wall" if level <= WALL else "plateau")
    return dict(step=last, evals=len(window), pass1_at=level, pass1=pass1, mass=mass,
                plateau=plateau, verdict=verdict)


def cap_record(test: dict, rows: list, steps: int = WINDOW) -> dict:
    """The branch point when the trunk reaches its cap (--max_steps or --trunk_cap) before the rule
    holds, fixed at step 200 before any later evaluation was read: the census runs at the cap's
    checkpoint all the same, and the record says that no plateau held (verdict "cap"); a
    saturation or a wall is judged on the window's mean held-out pass@1 (one evaluation is too
    noisy to tell; the plateau's verdict, fixed first, reads its last). None ({}) if the cap comes
    before the rule could be tested (fewer than its window's steps): no branch point then."""
    if "pass1" not in test:
        return {}
    evals = [r for r in rows if "eval_pass@1" in r]
    window = [r["eval_pass@1"] for r in evals if r["step"] > evals[-1]["step"] - steps]
    level = statistics.fmean(window)
    verdict = "saturated" if level >= SATURATED else "wall" if level <= WALL else "cap"
    return {**test, "plateau": False, "window_pass1_mean": level, "verdict": verdict}


def reach_count(records: list) -> dict:
    """The go/no-go's count over a census's records: prompts whose Clopper-Pearson interval of Q
    lies inside REACH, and those whose point estimate does."""
    inside, point = 0, 0
    for r in records:
        lo, hi = census.clopper_pearson(r["right"], r["samples"])
        q = r["right"] / r["samples"]
        inside += REACH[0] <= lo and hi < REACH[1]
        point += REACH[0] <= q < REACH[1]
    return dict(prompts=len(records), reach_resolved=inside, reach_point=point,
                go=inside >= GO_PROMPTS)


# ----------------------------------------------------------------------------
# The trunk and the census


def trunk_run(out: Path, raw: Path, chunk: int, max_steps: int,
              flags: list = TRUNK_FLAGS) -> study.ChunkedRun:
    """The trunk as a chunked run: <out>/trunk, its chunks recorded in <raw>/trunk/chunks.jsonl,
    its checkpoint at the last recorded chunk copied to <out>/trunk-branch."""
    return study.ChunkedRun("trunk", out / "trunk", flags, chunk, max_steps,
                            raw / "trunk" / "chunks.jsonl", lambda step: out / "trunk-branch",
                            out / "trunk.log")


def trunk(out: Path, raw: Path, chunk: int, max_steps: int, cap: float,
          flags: list = TRUNK_FLAGS, window: int = WINDOW) -> dict:
    """ProRL's shape until the plateau, chunk by chunk: after each recorded chunk the raw metrics
    rewritten and the rule tested. Returns the plateau record, or {} if the trunk stopped first."""
    run = trunk_run(out, raw, chunk, max_steps, flags)
    while True:
        done = run.done()
        if done:
            rows = run.rows(done)
            write_atomic(raw / "trunk" / "metrics.jsonl", study.raw_text(rows, flags))
            test = plateau_test(rows, window)
            print(f"trunk step {done}: held-out pass@1 {rows[-1].get('eval_pass@1')}, probe Q "
                  f"{rows[-1].get('mass_mean')}; plateau rule: {json.dumps(test)}", flush=True)
            if test["plateau"]:
                write_atomic(raw / "trunk" / "plateau.json", json.dumps(test, indent=1) + "\n")
                return test
        spent = sum(c["cpu_s"] for c in run.records())
        if done >= max_steps or spent >= cap:
            print(f"trunk: stopped without a plateau at step {done} ({spent:.0f} CPU s; "
                  f"--max_steps {max_steps}, --trunk_cap {cap})", flush=True)
            record = cap_record(test, rows, window) if done else {}
            if record:
                write_atomic(raw / "trunk" / "plateau.json", json.dumps(record, indent=1) + "\n")
            return record
        run.advance(done)


def census_argv(out: Path, raw: Path, first: int, task: tuple = ()) -> list:
    """The plateau census's command: the trunk's prompts and sampling, its branch checkpoint."""
    return [sys.executable, "-m", "tools.census", "--out", str(raw / "census-plateau"),
            "--samples", "512", "--first", str(first), "--", "--preset", "smollm2", "--dtype",
            "bfloat16", "--eval_prompts", "128", *task, "--model",
            str(out / "trunk-branch" / "ckpt")]


def plateau_census(out: Path, raw: Path, first: int, task: tuple = ()) -> dict:
    """The census at the plateau (resumable: tools/census.py goes on from its recorded prompts),
    then the go/no-go written beside it."""
    argv = census_argv(out, raw, first, task)
    print("census: " + " ".join(argv[1:]), flush=True)
    with open(out / "census-plateau.log", "a") as f:
        code = study.run_child(argv, f, cwd=HERE)
    if code != 0:
        sys.exit(f"error: the plateau census failed (exit {code}): {out / 'census-plateau.log'}")
    records = census.load(raw / "census-plateau")
    verdict = reach_count(records)
    write_atomic(raw / "census-plateau" / "go.json", json.dumps(verdict, indent=1) + "\n")
    print(f"census: {json.dumps(verdict)}", flush=True)
    return verdict


# ----------------------------------------------------------------------------
# The arms and their end censuses


def arm_argv(arm: str, seed: int, out: Path, task: tuple = ()) -> list:
    """One arm run's flags: the trunk's from its branch checkpoint (weights and AdamW moments), the
    arm's, its seed; evaluated at its start and end."""
    flags, steps = ARMS[arm]
    argv = [*TRUNK_FLAGS, *task]
    for flag, value in [("--seed", str(seed)), ("--eval_every", str(steps)),
                        *zip(flags[::2], flags[1::2])]:  # the trunk's value replaced, or added
        if flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag, value]
    return [*argv, "--init_from", str(out / "trunk-branch"), "--init_optimizer",
            "--steps", str(steps), "--out", str(out / "arms" / arm / f"seed{seed}")]


def arm_jobs(out: Path, raw: Path, seeds: list, task: tuple = ()) -> list:
    """Every arm's runs, seed by seed (a study cut short is balanced)."""
    return [study.Job(f"{arm} seed {s}", arm_argv(arm, s, out, task),
                      out / "arms" / arm / f"seed{s}",
                      raw / "arms" / arm / f"seed{s}.jsonl", out / "arms" / f"{arm}-seed{s}.log")
            for s in seeds for arm in ARMS]


def end_census_argv(arm: str, seed: int, out: Path, raw: Path, task: tuple = ()) -> list:
    """The census of an arm run's end: the plateau census's prompts, seed and flags."""
    argv = census_argv(out, raw, END_PROMPTS, task)
    argv[argv.index("--out") + 1] = str(raw / "census-arms" / arm / f"seed{seed}")
    argv[argv.index("--samples") + 1] = str(END_SAMPLES)
    argv[-1] = str(out / "arms" / arm / f"seed{seed}" / "ckpt")
    return argv


def end_census(arm: str, seed: int, out: Path, raw: Path, task: tuple = ()) -> str:
    """One arm run's end census (it goes on from its recorded prompts); "" or its failure's line."""
    return study.run_logged(f"the census of {arm} seed {seed}",
                            end_census_argv(arm, seed, out, raw, task),
                            out / "arms" / f"{arm}-seed{seed}-census.log", cwd=HERE)


def arms(out: Path, raw: Path, seeds: list, jobs: int, task: tuple = ()):
    """Every arm's runs, `jobs` at a time (a rerun skips those whose raw file exists), then each
    run's end census, `jobs` at a time (each goes on from its recorded prompts)."""
    if not (out / "trunk-branch" / "ckpt").is_dir() or not (raw / "census-plateau" /
                                                              "go.json").is_file():
        fail(f"no plateau census yet ({raw / 'census-plateau' / 'go.json'}, "
             f"{out / 'trunk-branch' / 'ckpt'}): run the trunk and the census first")
    if not json.loads((raw / "census-plateau" / "go.json").read_text())["go"]:
        fail(f"{raw / 'census-plateau' / 'go.json'}: a no-go; the arms do not run")
    study.exit_if_failed(study.run_jobs(arm_jobs(out, raw, seeds, task), jobs))
    study.exit_if_failed(study.in_parallel(lambda job: end_census(*job, out, raw, task),
                                           [(a, s) for s in seeds for a in ARMS], jobs))


# ----------------------------------------------------------------------------
# The plan: the arms' CPU hours from measured costs, before any arm runs

BUDGET_H = 30  # the study's CPU hours in all, trunks and censuses included
TRAILING = 30  # an N = 16 step is priced at the trunk's last 30 steps' mean: the arms' start


@dataclass(frozen=True)
class Costs:
    """The measured CPU seconds the plan prices from."""
    step: float  # an N = 16 step: the mean of the trunk's last TRAILING
    big: list  # each N = BIG step of the pilot (n{BIG}-steps.jsonl): priced at their mean
    run: float  # a run's load and its two evaluations: the trunk's first chunk beyond its steps
    trunk_step: float  # a trunk step with its share of its chunk's evaluation and load: the mean
    trunk_at: int  # the trunk's last recorded step
    prompt256: float  # a census prompt at 256 samples: the pilot's (census-cpu.json, one load in)
    pilot: float  # the pilot's own, as its files record it (evaluations' seconds at one thread,
    # the N = BIG steps' training CPU, the census timing)


def step_cpu(rows: list, path: Path, first: int = 0) -> list:
    """The training CPU seconds of each step after `first` of a run's raw rows (path's, their
    cumulative time_train_cpu); one line if fewer than two rows are timed."""
    points = [(r["step"], r["time_train_cpu"]) for r in rows
              if "time_train_cpu" in r and r["step"] >= first]
    if len(points) < 2:
        fail(f"{path}: fewer than two rows with time_train_cpu after step {first}: no step priced")
    return [(c - c0) / (s - s0) for (s0, c0), (s, c) in zip(points, points[1:]) if s > s0]


def costs(raw_root: Path, bed: Testbed) -> Costs:
    """A testbed's measured costs, from its trunk's raw files and its pilot's."""
    pilot, trunk_dir = raw_root / bed.pilot, raw_root / bed.folder / "trunk"
    metrics, chunks = trunk_dir / "metrics.jsonl", study.chunk_records(trunk_dir / "chunks.jsonl")
    if not chunks:
        fail(f"{trunk_dir / 'chunks.jsonl'}: no chunk recorded: nothing to price from")
    rows = study.raw_rows(metrics)
    done = {r["step"]: r.get("time_train_cpu") for r in rows}
    first = chunks[0]["steps_to"]
    if not isinstance(done.get(first), (int, float)):
        fail(f"{metrics}: no time_train_cpu at step {first}, the first chunk's end")
    head = study.read_json(pilot / "census-cpu.json", ("cpu_s", "prompts", "samples"))
    if not all(isinstance(head[k], (int, float)) and head[k] > 0
               for k in ("cpu_s", "prompts", "samples")):
        fail(f"{pilot / 'census-cpu.json'}: cpu_s, prompts and samples must be numbers > 0")
    at, big_path = chunks[-1]["steps_to"], pilot / f"n{BIG}-steps.jsonl"
    big_rows = study.raw_rows(big_path)
    evals = [study.read_json(f, ("seconds",))["seconds"] for f in sorted(pilot.glob("*-eval.json"))]
    return Costs(step=statistics.fmean(step_cpu(rows, metrics, at - TRAILING)),
                 big=step_cpu(big_rows, big_path),
                 run=chunks[0]["cpu_s"] - done[first],  # loaded, evaluated at 0 and at its end
                 trunk_step=sum(c["cpu_s"] for c in chunks) / at, trunk_at=at,
                 prompt256=head["cpu_s"] / head["prompts"] * 256 / head["samples"],
                 pilot=sum(evals) + big_rows[-1].get("time_train_cpu", 0) + head["cpu_s"])


def plan(raw_root: Path, bed: Testbed, seeds: int, max_steps: int) -> str:
    """The arms' CPU hours at `seeds` seeds from the testbed's costs; beside them what the trunks
    and the plateau censuses spent (a census at the pilot's cost a prompt) and, until they are
    recorded, the testbed's trunk to max_steps and its plateau census: all against BUDGET_H."""
    if not bed.pilot:
        fail(f"--plan: the testbed {bed.folder or 'add2'} has no measured N = {BIG} step (a pilot)")
    c = costs(raw_root, bed)
    big = statistics.fmean(c.big)
    prompt = lambda samples: c.prompt256 * samples / 256
    lines = [f"| arm | runs | steps a run | CPU s a step | CPU h (a run's load and evaluations: "
             f"{c.run:.0f} s) |", "|---|---|---|---|---|"]
    total = 0.0
    for arm, (flags, steps) in ARMS.items():
        n = int(flags[flags.index("--n_rollouts") + 1]) if "--n_rollouts" in flags else 16
        step, shown = ((big, f"{big:.0f} ({min(c.big):.0f}-{max(c.big):.0f})") if n == BIG
                       else (c.step, f"{c.step:.0f}"))
        total += (hours := seeds * (steps * step + c.run) / 3600)
        lines.append(f"| {arm} | {seeds} | {steps} | {shown} | {hours:.2f} |")
    total += (censuses := len(ARMS) * seeds * END_PROMPTS * prompt(END_SAMPLES) / 3600)
    lines += [f"| end censuses ({END_PROMPTS} x {END_SAMPLES}) | {len(ARMS) * seeds} | | "
              f"{prompt(END_SAMPLES):.1f} a prompt | {censuses:.2f} |",
              f"| **the arms** | | | | **{total:.2f}** |"]
    spent = {f"spent: {bed.pilot} (as its files record)": c.pilot / 3600}
    for name, t in TESTBEDS.items():
        if (chunks := raw_root / t.folder / "trunk" / "chunks.jsonl").is_file():
            spent[f"spent: {name} trunk"] = sum(
                r["cpu_s"] for r in study.chunk_records(chunks)) / 3600
        if (raw_root / t.folder / "census-plateau" / "census.jsonl").is_file():
            spent[f"spent: {name} plateau census (at the pilot's cost a prompt)"] = sum(
                prompt(r["samples"]) for r in census.load(raw_root / t.folder / "census-plateau")
            ) / 3600
    if not (raw_root / bed.folder / "trunk" / "plateau.json").is_file():
        spent[f"to come: the trunk to step {max_steps} (its mean step)"] = (
            max(0, max_steps - c.trunk_at) * c.trunk_step / 3600)
    if not (raw_root / bed.folder / "census-plateau" / "census.jsonl").is_file():
        spent[f"to come: its plateau census ({CENSUS_PROMPTS} x 512)"] = (
            CENSUS_PROMPTS * prompt(512) / 3600)
    lines += [f"| {what} | | | | {hours:.2f} |" for what, hours in spent.items()]
    left = BUDGET_H - sum(spent.values())
    fits = "the arms fit" if total <= left else "the arms do not fit"
    return "\n".join([*lines, f"| left of {BUDGET_H} CPU h | | | | {left:.2f} ({fits}) |"]) + "\n"


# ----------------------------------------------------------------------------
# The report: the tests, written before any arm's end was read


def last_eval(rows: list) -> dict:
    """A run's last evaluated row (its end, for an arm run)."""
    return [r for r in rows if "eval_pass@1" in r][-1]


def lenient_q(rows: list):
    """A census's mean lenient Q (right_lenient over samples), or None where a record has none."""
    if all("right_lenient" in r for r in rows):
        return statistics.fmean(r["right_lenient"] / r["samples"] for r in rows)
    return None


def end_measures(rows: list, plateau: list) -> dict:
    """An end census's measures on its prompts: pass@1 (mean Q) by the rules and leniently,
    pass@16, pass@256, and how many of the plateau census's reach prompts (by point estimate) it
    lifted to Q >= 1/16."""
    at = census.summary(rows)["pass_at_k"]
    reach = [i for i, r in enumerate(plateau[:len(rows)])
             if REACH[0] <= r["right"] / r["samples"] < REACH[1]]
    lifted = sum(rows[i]["right"] / rows[i]["samples"] >= REACH[1] for i in reach)
    return {"pass@1": at[1], "lenient pass@1": lenient_q(rows), "pass@16": at[16],
            "pass@256": at[256], "reach prompts lifted": lifted}


def paired_line(name: str, arm: list, base: list) -> str:
    """One test: an arm against n16 by seed, the mean difference with its paired interval, the
    paired t and sign p, and the power at these seeds for the effect fixed beforehand."""
    diffs = [a - b for a, b in zip(arm, base)]
    mean, lo, hi = stats.paired_interval(diffs)
    t = stats.t_test(diffs)
    sd = statistics.stdev(diffs) if len(diffs) > 1 else 0.0
    power = stats.paired_power(len(diffs), EFFECT[name], sd)
    return (f"| {name} | {len(diffs)} | {mean:+.4f} | {lo:+.4f} .. {hi:+.4f} | {t['p']:.3g} | "
            f"{stats.sign_test(diffs):.3g} | {EFFECT[name]:g} | {power:.2f} |")


def start_lines(raw: Path, plateau: list) -> list:
    """What the arms start from: the trunk at its branch point (its rule's record, its last
    evaluation by the rules and leniently) and the plateau census with its go/no-go."""
    lines = ["# SmolLM2 revival", ""]
    if (raw / "trunk" / "plateau.json").is_file():
        record = study.read_json(raw / "trunk" / "plateau.json", (*PLATEAU_KEYS, *(
            f"{m}.{k}" for m in ("pass1", "mass") for k in ("slope_per_100", "ci_low", "ci_high"))))
        evals = [r for r in study.raw_rows(raw / "trunk" / "metrics.jsonl")
                 if "eval_pass@1" in r and r["step"] <= record["step"]]
        if not evals:
            fail(f"{raw / 'trunk' / 'metrics.jsonl'}: no evaluation at or before the branch point "
                 f"(step {record['step']}, {raw / 'trunk' / 'plateau.json'})")
        last = evals[-1]
        slope = lambda m: (f"{record[m]['slope_per_100']:+.3f} ({record[m]['ci_low']:+.3f} .. "
                           f"{record[m]['ci_high']:+.3f})")
        lines += ["## The trunk's branch point", "",
                  "| step | verdict | held-out pass@1 | lenient | probe Q | pass@1 slope a 100 "
                  "steps (95%) | probe Q slope |", "|---|---|---|---|---|---|---|",
                  f"| {record['step']} | {record['verdict']} | {last['eval_pass@1']:.4f} | "
                  f"{last.get('eval_lenient_pass@1', float('nan')):.4f} | "
                  f"{last['mass_mean']:.4f} | {slope('pass1')} | {slope('mass')} |", ""]
    s, go = census.summary(plateau), reach_count(plateau)
    lenient = lenient_q(plateau)
    lines += ["## The plateau census", "",
              "| prompts x samples | mean Q | lenient | pass@16 | pass@256 | pass@512 | none right "
              "| in the reach, resolved | by point | go |",
              "|---|---|---|---|---|---|---|---|---|---|",
              f"| {s['prompts']} x {s['samples']} | {s['mean_q']:.4f} | "
              + (f"{lenient:.4f}" if lenient is not None else "-")
              + f" | {s['pass_at_k'][16]:.4f} | {s['pass_at_k'][256]:.4f} | "
              f"{s['pass_at_k'].get(512, float('nan')):.4f} | {s['none_right']} | "
              f"{go['reach_resolved']} | {go['reach_point']} | {'yes' if go['go'] else 'no'} |", ""]
    return lines


def report(raw: Path) -> str:
    """What the arms start from (start_lines), then each arm against n16 paired by seed, from the
    raw files alone: held-out pass@1 at the end by the rules and leniently, and the end censuses'
    measures."""
    found = study.read_raw(raw, groups=("arms",)).get("arms", {})
    runs = {arm: found.get(arm, {}) for arm in ARMS}
    plateau = census.load(raw / "census-plateau")
    lines = [*start_lines(raw, plateau), "## The arms against N = 16, paired by seed", "",
             "| measure | pairs | mean difference | paired 95% interval | paired t p | sign p | "
             "effect | power |", "|---|---|---|---|---|---|---|---|"]
    base_seeds = sorted(runs["n16"])
    for arm in [a for a in ARMS if a != "n16"]:
        seeds = [s for s in base_seeds if s in runs[arm]]
        if not seeds:
            continue
        lines += [f"| **{arm}** ({len(seeds)} seeds) | | | | | | | |"]
        end = lambda a, s: last_eval(runs[a][s])
        for name, key in (("held-out pass@1", "eval_pass@1"),
                          ("held-out lenient pass@1", "eval_lenient_pass@1")):
            if all(key in end(a, s) for a in (arm, "n16") for s in seeds):
                lines.append(paired_line(name, [end(arm, s)[key] for s in seeds],
                                         [end("n16", s)[key] for s in seeds]))
        folder = lambda a, s: raw / "census-arms" / a / f"seed{s}"
        both = [s for s in seeds if (folder(arm, s) / "census.jsonl").is_file()
                and (folder("n16", s) / "census.jsonl").is_file()]
        if both:
            m = {a: [end_measures(census.load(folder(a, s)), plateau) for s in both]
                 for a in (arm, "n16")}
            for name in ("pass@1", "lenient pass@1", "pass@16", "pass@256",
                         "reach prompts lifted"):
                if all(x[name] is not None for a in (arm, "n16") for x in m[a]):
                    lines.append(paired_line(name, [x[name] for x in m[arm]],
                                             [x[name] for x in m["n16"]]))
    if lines[-1].startswith("|---"):  # No arm has a seed paired with n16's.
        lines[-4:] = ["## The arms", "", "None has run." if not any(runs.values()) else
                      "None has a seed paired with n16's."]
    return "\n".join(lines) + "\n"


def figure(raw: Path, path: Path, window: int = WINDOW):
    """Left: the trunk's held-out pass@1 by the rules and leniently and its probe's mean Q against
    the step, the rule's last window shaded, the branch point marked. Middle: each plateau census
    prompt's Q, sorted (log scale; none right drawn at 1/1024), the reach [1/512, 1/16) shaded.
    Right: each arm's end held-out pass@1 minus n16's, seed by seed (a point a seed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, cx, bx) = plt.subplots(1, 3, figsize=(16, 4.2))
    rows = [r for r in study.raw_rows(raw / "trunk" / "metrics.jsonl") if "eval_pass@1" in r]
    steps = [r["step"] for r in rows]
    for key, label in (("eval_pass@1", "held-out pass@1"),
                       ("eval_lenient_pass@1", "held-out, lenient"), ("mass_mean", "probe Q")):
        have = [(r["step"], r[key]) for r in rows if key in r]
        if have:
            ax.plot(*zip(*have), marker="o", ms=2.5, label=label)
    if (raw / "trunk" / "plateau.json").is_file():
        at = study.read_json(raw / "trunk" / "plateau.json", PLATEAU_KEYS)["step"]
        ax.axvspan(at - window + EVAL_EVERY, at, color="0.85", alpha=0.5, zorder=0)
        ax.axvline(at, color="0.4", lw=0.8)
    ax.set(xlim=(0, max(steps) + EVAL_EVERY), ylim=(0, 1), xlabel="trunk step",
           title="trunk (N = 16); the rule's last window shaded")
    ax.legend(fontsize=7)
    plateau = census.load(raw / "census-plateau")
    floor = 1 / 1024
    q = sorted(max(r["right"] / r["samples"], floor) for r in plateau)
    cx.plot(range(len(q)), q, "o", ms=3, color="k")
    cx.axhspan(*REACH, color="C2", alpha=0.2, zorder=0, label="reach: [1/512, 1/16)")
    cx.set(yscale="log", xlabel="census prompt (sorted by Q)",
           ylabel=f"Q ({plateau[0]['samples']} samples; none right at 1/1024)",
           title="plateau census")
    cx.legend(fontsize=7)
    found = study.read_raw(raw, groups=("arms",)).get("arms", {})
    end = lambda a, s: last_eval(found[a][s])["eval_pass@1"]
    others = [a for a in ARMS if a != "n16" and a in found and "n16" in found]
    for k, arm in enumerate(others):
        seeds = sorted(set(found[arm]) & set(found["n16"]))
        if not seeds:
            continue
        diffs = [end(arm, s) - end("n16", s) for s in seeds]
        bx.plot([k] * len(diffs), diffs, "o", ms=4, alpha=0.7, color=f"C{k}")
        bx.plot([k - 0.2, k + 0.2], [statistics.fmean(diffs)] * 2, color=f"C{k}")
    if not others:
        bx.text(0.5, 0.5, "no arm has run", ha="center", transform=bx.transAxes)
    bx.axhline(0, color="0.5", lw=0.8)
    bx.set(xticks=range(len(others)), xticklabels=others, xlim=(-0.5, max(len(others), 1) - 0.5),
           ylabel="end held-out pass@1 minus n16's", title="arms, paired by seed (a point a seed)")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=90)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--testbed", choices=list(TESTBEDS), default="add2",
                    help="the trunk's task (TESTBEDS): its folder under --out and --raw")
    ap.add_argument("--out", default="runs/smollm2-revival", help="the runs' directory")
    ap.add_argument("--raw", default=str(RAW), help="the raw results' directory")
    ap.add_argument("--only", choices=("trunk", "census", "arms"), default=None,
                    help="one phase")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4],
                    help="the arms' seeds")
    ap.add_argument("--jobs", type=int, default=2,
                    help="arm runs, then end censuses, at once (one thread each)")
    ap.add_argument("--report", action="store_true", help="the tests from the raw files")
    ap.add_argument("--plan", action="store_true",
                    help="the arms' CPU hours from the measured costs (printed again before them)")
    ap.add_argument("--chunk", type=int, default=EVAL_EVERY, help="trunk steps between tests")
    ap.add_argument("--max_steps", type=int, default=300, help="the trunk's most steps")
    ap.add_argument("--trunk_cap", type=float, default=8 * 3600, help="the trunk's CPU seconds")
    ap.add_argument("--census_first", type=int, default=CENSUS_PROMPTS,
                    help="census the first K prompts now (the same command goes on with more)")
    a = ap.parse_args(argv)
    for name in ("chunk", "max_steps", "census_first", "jobs"):
        if getattr(a, name) < 1:
            fail(f"--{name} {getattr(a, name)}: need >= 1")
    if a.chunk % EVAL_EVERY:
        fail(f"--chunk {a.chunk}: a multiple of {EVAL_EVERY}, the trunk's evaluations")
    if a.census_first > CENSUS_PROMPTS:
        fail(f"--census_first {a.census_first}: the census holds {CENSUS_PROMPTS} prompts")
    study.finite_positive("--trunk_cap", a.trunk_cap)
    study.check_seeds(a.seeds)
    bed = TESTBEDS[a.testbed]
    out, raw = Path(a.out) / bed.folder, Path(a.raw) / bed.folder
    if a.plan:
        print(plan(Path(a.raw), bed, len(a.seeds), a.max_steps), end="")
        return
    study.check_folder("--raw", raw, files=("report.md", "figure.png"))
    if a.report:
        if not (raw / "census-plateau" / "census.jsonl").is_file():
            fail(f"--report: {raw / 'census-plateau'} holds no census: nothing to report")
        text = report(raw)  # every raw file read and measured before anything is written
        study.write_outputs(raw, {"report.md": study.text_writer(text),
                                  "figure.png": lambda path: figure(raw, path, bed.window)})
        print(text)
        return
    study.check_folder("--out", out)
    flags = trunk_flags(bed, Path(a.out))
    start = Path(a.out) / TESTBEDS[bed.start].folder / "trunk-branch" if bed.start else None
    if start and not (raw / "trunk" / "chunks.jsonl").is_file() and not (start / "ckpt").is_dir():
        fail(f"--testbed {a.testbed}: its trunk starts from {bed.start}'s branch point, {start}, "
             f"which holds no checkpoint: run --testbed {bed.start} first")
    study.check_trunk_raw(raw / "trunk", flags, PLATEAU_KEYS)
    run = trunk_run(out, raw, a.chunk, a.max_steps, flags)
    run.check()
    study.make_folders(raw, out)
    with study.DriverLock(out):
        if a.only in (None, "trunk"):
            record = trunk(out, raw, a.chunk, a.max_steps, a.trunk_cap, flags, bed.window)
            if not record or a.only == "trunk":
                return
        if a.only in (None, "census"):
            if not (raw / "trunk" / "plateau.json").is_file():
                fail(f"no plateau yet ({raw / 'trunk' / 'plateau.json'}): run the trunk first")
            verdict = study.read_json(raw / "trunk" / "plateau.json", PLATEAU_KEYS)["verdict"]
            if verdict in ("saturated", "wall"):
                if not bed.start:
                    fail(f"{raw / 'trunk' / 'plateau.json'}: the trunk's verdict is {verdict}; "
                         "the task is made harder and a new trunk run before any census")
                # The task was made harder once (a testbed with a start): the last change.
                print(f"census: the trunk's verdict is {verdict}, on a task made harder once "
                      "already: its census says the go or no-go all the same", flush=True)
            if not plateau_census(out, raw, a.census_first, bed.task)["go"] or \
                    a.only == "census":
                return
        if bed.pilot and (Path(a.raw) / bed.pilot).is_dir():  # the plan, as --plan prints it
            print(plan(Path(a.raw), bed, len(a.seeds), a.max_steps), end="", flush=True)
        arms(out, raw, a.seeds, a.jobs, bed.task)


if __name__ == "__main__":
    main()
