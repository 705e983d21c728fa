"""
ablate.py: a sweep of brorl.py runs over a grid of flags and seeds, and a summary of them. A tool on
top of brorl.py (which never imports it): each run is `python brorl.py` in a subprocess, in its own
run directory, so a sweep is exactly the runs you could have typed by hand.

The grid. Each --grid is one axis: `flag=v1,v2,...` items whose values move TOGETHER (zipped, so
they need equal counts); several --grid options are crossed. Every brorl.py flag is a possible axis.
  --grid n_rollouts=16,512 prompts_per_step=8,2            2 configs: (16, 8), (512, 2)
  --grid n_rollouts=16,512 --grid lr=1e-4,2e-4             4 configs: every N with every lr
  --grid 'lora_targets=q_proj\\,v_proj,q_proj'             2 configs: a comma in a value is \\,
Each config runs once per --seeds value. Flags ablate.py does not know go to every run unchanged
(`--preset hard --time_budget 90`); --seed and --out are ablate's to set.

Layout: <out>/<config>/seed<S>/ is a brorl run directory (config.json, metrics.jsonl, metrics.png,
ckpt/), plus log.txt (the run's stdout and stderr) and done.json (the command, written only when
the run exits 0). <config> names the axes' values, e.g. `n_rollouts=16,prompts_per_step=8`.
With --report_to wandb (passed through), the sweep's runs share a wandb group, the sweep directory's
name, and each is named <config>/seed<S>; with tensorboard, TensorBoard on <out> shows them all.
Rerunning the same command skips every run whose done.json holds the same command and reruns the
others from scratch (a crashed or killed run); a done.json with another command is an error, not
silently mixed in. A crashed run is reported (and listed in the summary) and the sweep goes on; its
exit status is then 1. Values are compared as brorl.py reads them: lr=1e-4,0.0001 is one config twice.
At the end, over the runs of this grid:
  <out>/summary.md    per config: held-out pass@1 and pass@k at the end (mean, sd and each seed),
                      at the start, samples generated, samples/s, steps, keep rate, rollout
                      tokens/s, training time; zero-advantage share, entropy, the probe's Q and
                      the share of probe problems whose Q fell; paired t tests between configs
                      (--compare), per seed and per held-out problem
  <out>/summary.json  the same numbers, per run and per config
  <out>/summary.png   held-out pass@1 against training time (the runs' --budget_clock) and against
                      samples generated: one line per config (mean over seeds), a band from the
                      lowest to the highest seed

Equal compute on a shared CPU: give every run the same budget in process CPU seconds,
`--time_budget 90 --budget_clock cpu --steps 100000`, and one thread each (--threads 1, the
default): a single-threaded process's CPU time is the compute it got, whatever else runs.

Add a new axis. Any Config field of brorl.py is already one: add it to brorl.py's Config (one line,
with its comment) and sweep it, `--grid my_flag=a,b`. Something that is not a flag (a new loss, a
new sampler) becomes one first: a Config field that selects it, then the grid sweeps that field.
Nothing here needs to change.

  python -m tools.ablate --grid n_rollouts=16,512 prompts_per_step=8,2 --seeds 0 1 2 \\
      --out runs/ablate/shape --preset hard --time_budget 90 --budget_clock cpu --steps 100000
  python -m tools.ablate --grid ... --dry_run   # print the runs' commands, run nothing
  python -m tools.ablate --help
"""

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import os
import re
import shutil
import statistics
import sys
import time
from pathlib import Path

import brorl
from lib import config as config_lib
from lib import mass
from lib.errors import fail
from lib.rundir import metrics_row
from tools import study
from tools.stats import mean_sd, sign_test, t_test

HERE = Path(__file__).resolve().parent.parent  # the repository root
RESERVED = ("seed", "out", "resume")  # flags a sweep sets per run, or must not set


# ----------------------------------------------------------------------------
# The grid: --grid axes -> configs (flag -> value, as strings: brorl.py parses them)


def parse_grid(axes: list[list[str]]) -> list[dict]:
    """[["n_rollouts=16,512", "prompts_per_step=8,2"], ["lr=1e-4,2e-4"]] -> the crossed list of
    configs [{"n_rollouts": "16", "prompts_per_step": "8", "lr": "1e-4"}, ...]: items of one axis
    are zipped, axes are crossed (the first axis varies slowest)."""
    fields = {f.name for f in dataclasses.fields(brorl.Config)}
    seen, zipped_axes = set(), []
    for axis in axes:
        columns = {}
        for item in axis:
            name, eq, values = item.partition("=")
            name = name.removeprefix("--")
            if not eq or not name or not values:
                raise ValueError(f"--grid {item!r}: expected flag=v1,v2,...")
            if name not in fields:
                raise ValueError(f"--grid {item!r}: brorl.py has no flag --{name}")
            if name in RESERVED:
                raise ValueError(f"--grid {item!r}: --{name} is set by the sweep (use --seeds for seeds)")
            if name in seen:
                raise ValueError(f"--grid {item!r}: --{name} is already on an axis")
            vals = split_values(values)
            if "" in vals:
                raise ValueError(f"--grid {item!r}: an empty value")
            seen.add(name)
            columns[name] = vals
        lengths = {name: len(v) for name, v in columns.items()}
        if len(set(lengths.values())) > 1:
            raise ValueError(f"--grid {' '.join(axis)}: values on one axis move together, so they need equal "
                             f"counts (got {lengths}); give separate --grid options to cross them")
        n = next(iter(lengths.values()))
        zipped_axes.append([{name: v[i] for name, v in columns.items()} for i in range(n)])
    configs = [dict(kv for part in combo for kv in part.items()) for combo in itertools.product(*zipped_axes)]
    if len({tuple(sorted(normalised(c).items())) for c in configs}) < len(configs):
        raise ValueError(f"--grid {axes}: the same config twice (values compared as brorl.py reads them: 1e-4 == 0.0001)")
    return configs


def split_values(values: str) -> list:
    """An axis item's values, split at each comma that no backslash escapes: a value that holds a
    comma writes it as \\, (lora_targets=q_proj\\,v_proj,q_proj is two values)."""
    return [v.replace("\\,", ",") for v in re.split(r"(?<!\\),", values)]


def normalised(config: dict) -> dict:
    """A config's values as brorl.py reads them (1e-4 and 0.0001 are one lr, true and 1 one bool), so that a
    config spelled two ways is seen as one; a value brorl.py cannot read is left as written (it refuses it)."""
    kinds = {f.name: f.type for f in dataclasses.fields(brorl.Config)}
    read = lambda k, v: {bool: config_lib.parse_bool, int: int, float: float}.get(kinds[k], str)(v)
    out = {}
    for k, v in config.items():
        try:
            out[k] = read(k, v)
        except (ValueError, argparse.ArgumentTypeError):
            out[k] = v
    return out


def config_label(config: dict) -> str:
    """Directory name of a config: flag=value pairs; a path value is named by its last part."""
    name = lambda v: (Path(v).name if "/" in v else v).replace(",", "+")  # a value's comma: "+"
    return ",".join(f"{k}={name(v)}" for k, v in config.items()) or "base"


def run_argv(config: dict, seed: int, run_dir: Path, passthrough: list[str]) -> list[str]:
    """The brorl.py flags of one run (the same list is stored in done.json)."""
    return [*passthrough, *(x for k, v in config.items() for x in (f"--{k}", v)), "--seed", str(seed),
            "--out", str(run_dir)]


# ----------------------------------------------------------------------------
# Running: one subprocess per run, at most --jobs at a time; done.json marks a complete run


def is_complete(run_dir: Path, argv: list[str]) -> bool:
    """True if run_dir holds a finished run of exactly this command; False if it holds nothing
    finished (never run, crashed, killed). A finished run of another command is an error."""
    done = run_dir / "done.json"
    if not done.is_file():
        return False
    recorded = json.loads(done.read_text())["argv"]
    if recorded != argv:
        raise ValueError(f"{run_dir} holds a finished run of another command:\n  {' '.join(recorded)}\n"
                         f"this sweep would run:\n  {' '.join(argv)}\nuse another --out, or delete that run")
    return True


def launch(argv: list[str], run_dir: Path, threads: int) -> dict:
    """Run brorl.py with argv, its output to run_dir/log.txt; write done.json if it exits 0. A run another
    process is running is left alone (reported, not cleared)."""
    if study.lock_holder(run_dir):
        return dict(code=1, seconds=0.0, error=f"another process is running it ({run_dir / '.lock'} is held): left alone")
    for stale in ("metrics.jsonl", "done.json", "config.json"):  # an unfinished earlier attempt starts over
        (run_dir / stale).unlink(missing_ok=True)
    for stale in ("ckpt", "ckpt.old", "ckpt.tmp"):  # (brorl.py refuses a directory that holds a run)
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    env = study.thread_env(threads)
    # with --report_to wandb: the sweep's runs in one group (the sweep directory's name), each named <config>/seed<S>
    env.setdefault("WANDB_RUN_GROUP", run_dir.parent.parent.name)
    env.setdefault("WANDB_NAME", f"{run_dir.parent.name}/{run_dir.name}")
    cmd = [sys.executable, str(HERE / "brorl.py"), *argv]
    t0 = time.time()
    with open(run_dir / "log.txt", "w") as log:
        code = study.run_child(cmd, log, env=env)  # paths as typed: from our cwd
    seconds = time.time() - t0
    if code == 0:
        (run_dir / "done.json").write_text(json.dumps(dict(argv=argv, seconds=round(seconds, 1), threads=threads)))
    return dict(code=code, seconds=seconds)


def tail(path: Path, n: int = 3) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return " / ".join(line.strip()[-200:] for line in lines[-n:])


def sweep(runs: list[dict], jobs: int, threads: int) -> list[dict]:
    """Run every run not already complete, `jobs` at a time. Each run dict gets `status`:
    skipped (complete before), done, or crashed (with the exit code and the log's last lines)."""
    todo = []
    for r in runs:
        if is_complete(r["dir"], r["argv"]):
            r["status"] = "skipped"
        else:
            todo.append(r)
    print(f"{len(runs)} runs: {len(runs) - len(todo)} complete already, {len(todo)} to run, {jobs} at a time")
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(launch, r["argv"], r["dir"], threads): r for r in todo}
        for fut in concurrent.futures.as_completed(futures):
            r, res = futures[fut], fut.result()
            r["status"] = "done" if res["code"] == 0 else "crashed"
            msg = f"{r['label']} seed {r['seed']}: {r['status']} in {res['seconds']:.0f} s"
            if res["code"] != 0:
                r["error"] = res.get("error") or f"exit {res['code']}: {tail(r['dir'] / 'log.txt')}"
                msg += f" ({r['error']}; log {r['dir'] / 'log.txt'})"
            print(msg, flush=True)
    return runs


# ----------------------------------------------------------------------------
# The summary: per run from its metrics.jsonl, per config over seeds


def run_summary(rows: list[dict], clock: str, gate: tuple = (16, 512)) -> dict:
    """One run's numbers from its metrics.jsonl rows (step 0 is the evaluation before training); gate: the
    run's --gate_small_n and --gate_large_n (the exact-Q zones)."""
    evals = [r for r in rows if "eval_pass@1" in r]
    steps = [r for r in rows if r["step"] > 0]
    samples = sum(r["samples"] for r in steps)
    tokens = sum(r["resp_len"] * r["samples"] for r in steps)  # resp_len is tokens per generated rollout
    return {
        "pass@1_start": evals[0]["eval_pass@1"], "pass@1": evals[-1]["eval_pass@1"],
        "pass@k_start": evals[0]["eval_pass@k"], "pass@k": evals[-1]["eval_pass@k"],
        "greedy_pass@1": evals[-1]["eval_greedy_pass@1"],
        # the probe's correct mass Q at the start and the end, and the share of probe problems whose Q fell
        "mass_start": evals[0]["mass_mean"], "mass": evals[-1]["mass_mean"], "mass_fell": evals[-1].get("mass_fell", 0.0),
        "steps": rows[-1]["step"], "samples": samples,
        # groups that survived dynamic sampling / groups generated, over the whole run
        "keep_rate": sum(r["keep_rate"] * r["samples"] for r in steps) / max(samples, 1),
        # share of generated groups whose rewards were all equal (no signal), and the rollouts' token entropy
        "zero_adv_frac": sum(r["zero_adv_frac"] * r["samples"] for r in steps) / max(samples, 1),
        "entropy": statistics.fmean(r["entropy"] for r in steps if "entropy" in r) if any("entropy" in r for r in steps) else 0.0,
        "rollout_tokens_per_s": tokens / max(sum(r["time_rollout"] for r in steps), 1e-9),
        "time_train_wall": rows[-1].get("time_train_wall", 0.0), "time_train_cpu": rows[-1].get("time_train_cpu", 0.0),
        # throughput on the budget clock: on a shared CPU the cpu clock's figure is the one load cannot distort
        "samples_per_s": samples / max(rows[-1].get(f"time_train_{clock}", 0.0), 1e-9),
        # the curves: (training time on `clock`, samples so far, held-out pass@1) at each evaluation
        "curve": [(r.get(f"time_train_{clock}", 0.0), sum(s["samples"] for s in steps if s["step"] <= r["step"]),
                   r["eval_pass@1"]) for r in evals],
        # the last evaluation's correct samples per held-out problem (pass@1 per problem = count / eval samples)
        "correct": evals[-1].get("eval_correct"),
        "rounds_per_step": statistics.fmean(r["sample_rounds"] for r in steps) if steps else 0.0,
        "samples_per_step": samples / max(len(steps), 1),
        **zone_migration(evals[0], evals[-1], *gate),
    }


def zone_migration(first: dict, last: dict, small_n: int, large_n: int) -> dict:
    """The exact correct mass (lib/mass.py) from a run's first evaluation to its last, per prompt: mean Q,
    the prompts in the gate (1/large_n <= Q < 1/small_n) at the start that ended at Q >= 1/small_n (lifted),
    the prompts in the gate at the end (whence they came), the prompts at Q >= 1/small_n that fell below it
    (lost), and the median change of log10 Q of the prompts below the gate at the start (the unsampled-mass
    damage). {} without exact Q."""
    if "mass_exact_log10" not in first or "mass_exact_log10" not in last:
        return {}
    a, b = first["mass_exact_log10"], last["mass_exact_log10"]  # log10 Q per prompt, start and end
    za, zb = ([mass.zone(x, small_n, large_n) for x in q] for q in (a, b))  # each prompt's zone, start and end
    gate = [i for i, z in enumerate(za) if z == "gate"]
    below = [i for i, z in enumerate(za) if z == "low"]
    return {"exact_q_start": first["mass_exact_mean"], "exact_q": last["mass_exact_mean"],
            "gate_start": len(gate), "gate_lifted": sum(zb[i] == "high" for i in gate),
            "gate_left": zb.count("gate"), "high_lost": sum(x == "high" != y for x, y in zip(za, zb)),
            "below_dlog10_median": statistics.median(b[i] - a[i] for i in below) if below else 0.0,
            "log10_q_start": a, "log10_q_end": b}


# ----------------------------------------------------------------------------
# Paired comparisons: Student's t on paired differences, and the sign test (tools/stats.py)


def paired(result: dict, a: str, b: str) -> dict:
    """Config a against config b (labels) on their common seeds: the per-seed difference of final pass@1
    (the training's noise), and the paper's per-problem difference: each held-out problem's pass@1,
    averaged over the seeds, a minus b. The second needs every run scored on the same problems (--eval_seed)."""
    ra, rb = result["configs"][a]["runs"], result["configs"][b]["runs"]
    seeds = sorted(set(ra) & set(rb))
    out = dict(a=a, b=b, seeds=seeds, per_seed=t_test([ra[s]["pass@1"] - rb[s]["pass@1"] for s in seeds]) if seeds else None)
    runs = [ra[s] for s in seeds] + [rb[s] for s in seeds]
    same_problems = (seeds and all(r["correct"] is not None for r in runs)
                     and len({(r["eval_problems"], len(r["correct"]), r["eval_samples"]) for r in runs}) == 1)
    out["per_problem"] = None
    if same_problems:
        n = runs[0]["eval_samples"]
        rate = lambda rs, j: statistics.fmean(rs[s]["correct"][j] / n for s in seeds)  # problem j's pass@1 over seeds
        out["per_problem"] = t_test([rate(ra, j) - rate(rb, j) for j in range(len(runs[0]["correct"]))])
    return out


MASS_MEASURES = ("exact_q", "gate_lifted", "high_lost", "below_dlog10_median", "gate_left")


def paired_mass(result: dict, a: str, b: str) -> dict:
    """Config a against b on the exact-Q measures (zone_migration), per seed: a t test and a sign test of
    the seed-paired differences (the primary statistics: a run's noise is shared by all its prompts);
    and, secondary, per prompt: each prompt's change of log10 Q averaged over seeds, a minus b, t-tested
    (it treats prompts as independent, which they are not within a run)."""
    ra, rb = result["configs"][a]["runs"], result["configs"][b]["runs"]
    seeds = [s for s in sorted(set(ra) & set(rb)) if "exact_q" in ra[s] and "exact_q" in rb[s]]
    if not seeds:
        return {}
    out = dict(a=a, b=b, seeds=seeds, per_seed={})
    for k in MASS_MEASURES:
        diffs = [ra[s][k] - rb[s][k] for s in seeds]
        out["per_seed"][k] = dict(t_test(diffs), sign_p=sign_test(diffs))
    delta = lambda rs, i: statistics.fmean(rs[s]["log10_q_end"][i] - rs[s]["log10_q_start"][i] for s in seeds)
    n = len(ra[seeds[0]]["log10_q_start"])
    out["per_prompt"] = t_test([delta(ra, i) - delta(rb, i) for i in range(n)])
    return out


def summarize(runs: list[dict], out: Path, command: str, compare: list = ()) -> dict:
    """<out>/summary.{md,json,png} over the finished runs of this grid; `compare`: pairs of config labels
    to test against each other (default: every config against the first)."""
    clocks = {json.loads((r["dir"] / "config.json").read_text()).get("budget_clock", "wall")
              for r in runs if r["status"] != "crashed"}
    clock = clocks.pop() if len(clocks) == 1 else "wall"
    configs = {}
    for r in runs:
        c = configs.setdefault(r["label"], dict(config=r["config"], runs={}, crashed={}))
        if r["status"] == "crashed":
            c["crashed"][r["seed"]] = r.get("error", "")
        else:
            config = json.loads((r["dir"] / "config.json").read_text())
            gate = config.get("gate_small_n", 16), config.get("gate_large_n", 512)
            run = c["runs"][r["seed"]] = run_summary(study.read_rows(r["dir"]), clock, gate)
            # which held-out problems it was scored on: --eval_seed's, or (runs older than that flag) --seed's
            run["eval_samples"] = config["eval_samples"]
            run["eval_problems"] = (" ".join(str(config.get(k)) for k in ("task", "eval_task", "digits", "eval_seed"))
                                    if "eval_seed" in config else f"seed {config['seed']}")
    for c in configs.values():
        per_seed = list(c["runs"].values())
        c["mean"] = {k: mean_sd([s[k] for s in per_seed]) for k, v in per_seed[0].items()
                     if isinstance(v, (int, float))} if per_seed else {}
    result = dict(command=command, clock=clock, configs=configs)
    labels = list(configs)
    pairs = compare or [(label, labels[0]) for label in labels[1:]]
    result["paired"] = [paired(result, a, b) for a, b in pairs if configs[a]["runs"] and configs[b]["runs"]]
    result["paired_mass"] = [x for x in (paired_mass(result, a, b) for a, b in pairs
                                         if configs[a]["runs"] and configs[b]["runs"]) if x]
    stem = out / "summary"  # <out>/summary.{md,json,png}
    keep_other_summary(stem, command)
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(summary_markdown(result))
    plot_summary(result, stem.with_suffix(".png"))
    return result


def keep_other_summary(stem: Path, command: str):
    """The summary of another command (another grid on the same --out) is not replaced in silence:
    it is kept beside, as summary.<its time>.{md,json,png}, and said. The same command's is."""
    old = stem.with_suffix(".json")
    if not old.is_file():
        return
    try:
        previous = json.loads(old.read_text())
        previous, n = previous.get("command"), len(previous.get("configs", {}))
    except (OSError, ValueError, AttributeError):
        previous, n = None, 0
    if previous == command:
        return
    tag = time.strftime("%Y%m%d-%H%M%S", time.localtime(old.stat().st_mtime))
    for ext in (".md", ".json", ".png"):
        if stem.with_suffix(ext).is_file():
            os.replace(stem.with_suffix(ext), stem.with_name(f"summary.{tag}{ext}"))
    print(f"{stem}.md held another command's summary ({n} configs, `{previous}`): kept as "
          f"summary.{tag}.md (.json, .png)")


def summary_markdown(result: dict) -> str:
    clock = result["clock"]
    lines = [f"# Sweep summary\n\n`{result['command']}`\n",
             "Held-out pass@1 (temperature 0.6, top_p 0.95) and pass@k (k = eval samples) at the end of each run: "
             "mean ± sd over seeds [each seed]; the other columns are means over seeds. Samples: rollouts "
             "generated (dropped groups included); keep rate: groups surviving dynamic sampling / groups "
             f"generated; samples/s: per second of training on the budget clock ({clock}); rollout tok/s: "
             "tokens per wall second of rollout (load on the machine lowers it); training time excludes "
             "evaluations.\n",
             "| config | seeds | pass@1 start | pass@1 end | pass@k end | samples | samples/s | steps | keep rate | "
             "rollout tok/s | train wall s | train cpu s |", "|" + "---|" * 12]
    diag = ["", "Why: the share of generated groups with all rewards equal (zero advantage), the rollouts' mean "
                "token entropy, the probe's correct mass Q at the start and the end, and the share of probe "
                "problems whose Q fell (means over seeds).", "",
            "| config | zero-adv frac | entropy | probe Q start | probe Q end | probe Q fell |", "|" + "---|" * 6]
    for label, c in result["configs"].items():
        if not c["runs"]:
            lines.append(f"| {label} | 0 |" + " |" * 10)
            continue
        m, seeds = c["mean"], sorted(c["runs"])
        each = lambda k: "/".join(f"{c['runs'][s][k]:.3f}" for s in seeds)
        lines.append(
            f"| {label} | {len(seeds)} | {m['pass@1_start'][0]:.3f} | {m['pass@1'][0]:.3f} ± {m['pass@1'][1]:.3f} "
            f"[{each('pass@1')}] | {m['pass@k'][0]:.3f} ± {m['pass@k'][1]:.3f} [{each('pass@k')}] | "
            f"{m['samples'][0]:,.0f} | {m['samples_per_s'][0]:,.0f} | {m['steps'][0]:.1f} | {m['keep_rate'][0]:.2f} | "
            f"{m['rollout_tokens_per_s'][0]:,.0f} | {m['time_train_wall'][0]:.1f} | {m['time_train_cpu'][0]:.1f} |")
        diag.append(f"| {label} | {m['zero_adv_frac'][0]:.3f} | {m['entropy'][0]:.3f} | {m['mass_start'][0]:.3f} | "
                    f"{m['mass'][0]:.3f} | {m['mass_fell'][0]:.2f} |")
    lines += diag
    if result["paired"]:
        lines += ["", "Paired differences of final held-out pass@1 (a minus b), two-sided t tests: per seed (the "
                      "seeds both ran: the training's noise) and per held-out problem (each problem's pass@1 "
                      "averaged over those seeds: the paper's test; only when every run scored the same problems).", "",
                  "| a | b | seeds | per seed: mean diff, t, p | problems | per problem: mean diff, t, p |", "|" + "---|" * 6]
        for pr in result["paired"]:
            fmt = lambda r: f"{r['mean']:+.3f}, t = {r['t']:.2f}, p = {r['p']:.3g}" if r else "-"
            lines.append(f"| {pr['a']} | {pr['b']} | {len(pr['seeds'])} | {fmt(pr['per_seed'])} | "
                         f"{pr['per_problem']['n'] if pr['per_problem'] else '-'} | {fmt(pr['per_problem'])} |")
    lines += mass_markdown(result)
    crashed = [(label, s, e) for label, c in result["configs"].items() for s, e in c["crashed"].items()]
    if crashed:
        lines += ["", "Crashed runs (not in the table; rerun the command to retry them):", ""]
        lines += [f"- {label} seed {s}: {e}" for label, s, e in crashed]
    return "\n".join(lines) + "\n"


def mass_markdown(result: dict) -> list[str]:
    """The exact correct mass tables (runs that logged it): per config, then the paired tests."""
    rows = [(label, c) for label, c in result["configs"].items() if c["runs"] and "exact_q" in c["mean"]]
    if not rows:
        return []
    lines = ["", "Exact correct mass (lib/mass.py), first evaluation to last, means over seeds [each seed]: mean Q; "
                 "prompts in the gate at the start, lifted above it; prompts in the gate at the end; prompts above the gate "
                 "that fell below it (lost); the median change of log10 Q of the prompts below the gate at the "
                 "start (the unsampled-mass damage); sampling rounds and rollouts per step.", "",
             "| config | Q start | Q end | gate start | lifted | gate left | lost | below: median dlog10 Q | "
             "rounds/step | samples/step |", "|" + "---|" * 10]
    for label, c in rows:
        m, seeds = c["mean"], sorted(c["runs"])
        each = lambda k, f: "/".join(format(c["runs"][s][k], f) for s in seeds)
        lines.append(f"| {label} | {m['exact_q_start'][0]:.4f} | {m['exact_q'][0]:.4f} [{each('exact_q', '.3f')}] | "
                     f"{m['gate_start'][0]:.1f} | {m['gate_lifted'][0]:.1f} [{each('gate_lifted', 'd')}] | "
                     f"{m['gate_left'][0]:.1f} | {m['high_lost'][0]:.1f} [{each('high_lost', 'd')}] | "
                     f"{m['below_dlog10_median'][0]:+.2f} [{each('below_dlog10_median', '+.2f')}] | "
                     f"{m['rounds_per_step'][0]:.2f} | {m['samples_per_step'][0]:,.0f} |")
    if result.get("paired_mass"):
        lines += ["", "Paired differences on the exact-Q measures (a minus b). Primary: per seed, t test and exact "
                      "sign test (with 5 seeds the sign test's smallest p is 0.0625). Secondary, labelled: per "
                      "prompt, each prompt's change of log10 Q averaged over seeds (treats prompts as independent).", "",
                  "| a | b | seeds | " + " | ".join(f"{k}: diff, t, p, sign p" for k in MASS_MEASURES) +
                  " | secondary, per prompt dlog10 Q: diff, t, p |", "|" + "---|" * (4 + len(MASS_MEASURES))]
        fmt = lambda r: f"{r['mean']:+.3g}, {r['t']:.2f}, {r['p']:.2g}" + (f", {r['sign_p']:.3g}" if "sign_p" in r else "")
        for pr in result["paired_mass"]:
            lines.append(f"| {pr['a']} | {pr['b']} | {len(pr['seeds'])} | " +
                         " | ".join(fmt(pr["per_seed"][k]) for k in MASS_MEASURES) + f" | {fmt(pr['per_prompt'])} |")
    return lines


def plot_summary(result: dict, path: Path):
    """pass@1 against training time and against samples; one line per config, a min-max band over seeds."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    xlabels = [f"training time, s ({result['clock']} clock, evaluations excluded)", "rollouts generated"]
    for label, c in result["configs"].items():
        curves = [np.array(s["curve"], dtype=float) for s in c["runs"].values()]
        if not curves:
            continue
        for ax, col in zip(axes, (0, 1)):
            # each seed on a common grid, held at its last value after it ended (no more training)
            grid = np.linspace(0, max(cv[-1, col] for cv in curves), 200)
            ys = np.stack([np.interp(grid, cv[:, col], cv[:, 2]) for cv in curves])  # (seeds, 200)
            line, = ax.plot(grid, ys.mean(0), label=f"{label} ({len(curves)} seeds)")
            ax.fill_between(grid, ys.min(0), ys.max(0), color=line.get_color(), alpha=0.2, lw=0)
    for ax, xl in zip(axes, xlabels):
        ax.set_xlabel(xl)
        ax.set_ylabel("held-out pass@1")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


# ----------------------------------------------------------------------------
# The command line


def parse_args(argv=None):
    # the docstring is the help, as written (the grid, the layout, equal compute, a new axis)
    ap = config_lib.OneLineParser(prog="python -m tools.ablate", description=__doc__.strip().replace("%", "%%"),
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)  # so that no brorl flag is taken for an abbreviation of ours
    ap.add_argument("--grid", nargs="+", action="append", default=[], metavar="FLAG=V1,V2",
                    help="one axis: brorl flags whose values move together (zipped); repeat --grid to cross axes")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0], help="seeds; every config runs once per seed")
    ap.add_argument("--out", default="", help="sweep directory (default: runs/ablate-<time>)")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (default: 1)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads per run (OMP_NUM_THREADS); 0 leaves the environment's (default: 1)")
    ap.add_argument("--dry_run", action="store_true", help="print the runs' commands and stop")
    ap.add_argument("--compare", nargs=2, action="append", default=[], metavar=("A", "B"),
                    help="config labels (directory names) to test paired, A minus B; repeatable "
                         "(default: every config against the first)")
    args, passthrough = ap.parse_known_args(argv)
    for flag in passthrough:
        if flag.startswith("--") and flag[2:].split("=")[0] in RESERVED:
            ap.error(f"{flag}: ablate.py sets each run's --seed and --out (use --seeds and --out), and never resumes")
    if args.jobs < 1:
        ap.error(f"--jobs {args.jobs}: need >= 1")
    if len(set(args.seeds)) < len(args.seeds):
        ap.error(f"--seeds {args.seeds}: a seed twice")
    try:
        configs = parse_grid(args.grid)
    except ValueError as e:
        ap.error(str(e))
    return args, configs, passthrough


def main(argv=None) -> dict:
    args, configs, passthrough = parse_args(argv)
    out = Path(args.out or f"runs/ablate-{time.strftime('%Y%m%d-%H%M%S')}")
    labels = [config_label(c) for c in configs]
    if len(set(labels)) < len(labels):
        sys.exit(f"error: two configs get the same directory name ({labels}); a path value is named by its last part")
    runs = [dict(config=c, label=label, seed=s, dir=out / label / f"seed{s}",
                 argv=run_argv(c, s, out / label / f"seed{s}", passthrough))
            for c, label in zip(configs, labels) for s in args.seeds]
    for r in runs:  # every run's flags checked before any starts (exits with brorl's one-line error); as --plan,
        brorl.parse_config([*r["argv"], "--plan"])  # which lets --out hold a run: the sweep's own, finished or retried
    for pair in args.compare:
        if unknown := [x for x in pair if x not in labels]:
            sys.exit(f"error: --compare {' '.join(pair)}: no config {unknown[0]!r} in this grid (configs: {labels})")
    if args.dry_run:
        print("\n".join(f"python brorl.py {' '.join(r['argv'])}" for r in runs))
        return {}
    out.mkdir(parents=True, exist_ok=True)
    try:
        sweep(runs, args.jobs, args.threads)
    except ValueError as e:
        sys.exit(f"error: {e}")
    command = "python -m tools.ablate " + " ".join(sys.argv[1:] if argv is None else argv)
    result = summarize(runs, out, command, [tuple(p) for p in args.compare])
    table = (out / "summary").with_suffix(".md")
    print(table.read_text())
    print(f"wrote {table} and its .json, .png")
    return result


def exit_status(result: dict) -> int:
    """1 if a run of the sweep crashed (its summary is still written, the crash listed in it), else 0."""
    crashed = sum(len(c["crashed"]) for c in result.get("configs", {}).values())
    if crashed:
        print(f"error: {crashed} run(s) crashed (listed in the summary; rerun the command to retry them)", file=sys.stderr)
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(exit_status(main()))
