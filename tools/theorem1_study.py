"""
theorem1_study.py: Theorem 1 inside a transformer. Every run is a `python brorl.py` in a subprocess,
one thread, from the shipped warm start, its steps fixed (equal steps within a sweep) and a cap of
process CPU seconds (--cap) so that no run can run away. Three sweeps, --seeds a config:

  nalone  the theorem's comparison, N alone: the sets task, B = 8, N in 4, 16, 64, 512, equal steps,
          --mass_balance 4 (every 4th step, each trained group's four parts and the theorem's terms,
          lib/balance.py: about 5 CPU s a measured step)
  iso     equal rollouts a step (IsoCompute's axis): the sets task, N x B = 1,024: 16 x 64, 64 x 16,
          512 x 2, equal steps
  keys2x2 the keys task (one right answer a prompt): N 16 / 512 x B 4 / 16, equal steps: what N
          and B each do where the unsampled right term cannot act
  prorl   the keys task, ProRL's shape (N 16, B 16) for 150 steps: which prompts below the gate at
          the start were never sampled right, and what became of them

Runs go seed by seed (every config's seed 0, then seed 1, ...), so a study cut short is balanced.
Each run's metrics.jsonl, the raw result, is copied to <raw>/<sweep>/<config>/seed<S>.jsonl as soon
as the run ends; a rerun of the command skips every run whose raw file exists. --report reads the
raw files alone: the tables (markdown, to stdout and assets/theorem1/report.md), the tests, and
the figure assets/theorem1/figure3.png (Figure 3's three panels by N, seeds shaded, above the
free-logit simulation's). The reading: docs/results/theorem1.md.

Statistics (tools/stats.py, on scipy.stats). Runs of two configs share no random draws (each
seed's rollouts depend on N and B), so configs are compared unpaired: the exact two-sided
Mann-Whitney (permutation) test on the per-seed values, and Welch's t for the difference of means.

  python -m tools.theorem1_study --out runs/theorem1                 # all three sweeps, 5 seeds
  python -m tools.theorem1_study --out runs/theorem1 --only nalone --seeds 0 1
  python -m tools.theorem1_study --report                            # tables and figure from <raw>
"""

import argparse
import math
import statistics
from pathlib import Path

from lib.errors import fail
from tools import stats, study
from tools.stats import mann_whitney, pearson, welch

HERE = Path(__file__).resolve().parent.parent
RAW = HERE / "assets" / "theorem1"
SETS = ["--preset", "sets", "--lr", "2e-4", "--eval_samples", "4", "--probe_prompts", "4",
        "--probe_samples", "64", "--save", "0"]
SWEEPS = {  # name: (configs as flag lists, the flags common to the sweep)
    "nalone": ([["--n_rollouts", str(n), "--prompts_per_step", "8"] for n in (4, 16, 64, 512)],
               [*SETS, "--mass_balance", "4"]),
    "iso": ([["--n_rollouts", str(n), "--prompts_per_step", str(b)] for n, b in
             ((16, 64), (64, 16), (512, 2))], SETS),
    "keys2x2": ([["--n_rollouts", str(n), "--prompts_per_step", str(b)] for n in (16, 512)
                 for b in (4, 16)], ["--preset", "keys", "--lr", "2e-4", "--save", "0"]),
    "prorl": ([["--n_rollouts", "16", "--prompts_per_step", "16"]],
              ["--preset", "keys", "--lr", "2e-4", "--save", "0"]),
}


def label(flags: list) -> str:
    """A config's name from its flags: N=16,B=8."""
    named = dict(zip(flags[::2], flags[1::2]))
    return f"N={named['--n_rollouts']},B={named['--prompts_per_step']}"


def jobs(sweeps: list, seeds: list, steps: dict, out: Path, raw: Path, cap: float) -> list:
    """Every run of the sweeps, seed by seed (every config's seed 0, then seed 1, ...: a study cut
    short is balanced); each one's metrics.jsonl copied to its raw file when it ends."""
    out_jobs = []
    for seed in seeds:
        for sweep in sweeps:
            configs, common = SWEEPS[sweep]
            for flags in configs:
                name, n = label(flags), steps[sweep]
                argv = [*common, *flags, "--seed", str(seed), "--steps", str(n), "--eval_every",
                        str(n // 4), "--time_budget", str(cap), "--budget_clock", "cpu",
                        "--out", str(out / sweep / name / f"seed{seed}")]
                out_jobs.append(study.Job(f"{sweep} {name} seed {seed}", argv,
                                          out / sweep / name / f"seed{seed}",
                                          raw / sweep / name / f"seed{seed}.jsonl",
                                          out / sweep / f"{name}-seed{seed}.log"))
    return out_jobs


# ----------------------------------------------------------------------------
# The report: from the raw files alone


def read(raw: Path) -> dict:
    """{sweep: {config: {seed: rows}}} from the raw files; none of this study's: one line."""
    return study.raw_to_report(raw, "<raw>/<sweep>/<config>/seed<S>.jsonl", groups=SWEEPS)


def sets_measures(rows: list, n: int, b: int, prompts: int = 256) -> dict:
    """A sets run's measures (N = n, B = b, of `prompts` prompts): the last eval's Figure 3 panels
    and mean Q against the first's; the mass balance over its steps (a nalone run); rollouts and
    steps."""
    evals = [r for r in rows if "answers_q" in r]
    first, last = evals[0], evals[-1]
    steps = [r for r in rows if r["step"] > 0]
    m = dict(q_start=first["answers_q"], q_end=last["answers_q"],
             dq=last["answers_q"] - first["answers_q"], right_rose=last["answers_right_rose"],
             worst_drop=last["answers_right_worst_drop"], pass1024=last["answers_pass@1024"],
             pass1024_start=first["answers_pass@1024"], entropy=last["answers_entropy"],
             samples=sum(r["samples"] for r in steps), steps=len(steps), **reach(rows, n))
    groups = [g for r in steps for g in r.get("balance_groups", [])]
    if groups:
        du = [g["U_pos_after"] - g["U_pos_before"] for g in groups]
        has_u = [(g, d) for g, d in zip(groups, du) if g["U_pos_before"] > 0]
        m.update(groups=len(groups), term3_neg=sum(g["term3"] < 0 for g in groups) / len(groups),
                 u_pos2=statistics.mean(g["U_pos2"] for g in groups),
                 u_pos=statistics.mean(g["U_pos_before"] for g in groups),
                 du_pos_loss=statistics.mean(max(0.0, -d) for d in du),
                 pred_du_pos_loss=statistics.mean(max(0.0, -g["pred_du_pos"]) for g in groups),
                 du_pos_mean=statistics.mean(du),
                 du_pos_fell=sum(d < 0 for _, d in has_u) / max(len(has_u), 1),
                 u_pos_share=statistics.mean(g["U_pos_before"] / max(g["q_before"], 1e-300)
                                             for g in groups),
                 sign_agree=sum((g["pred_du_pos"] < 0) == (d < 0) for g, d in has_u)
                 / max(len(has_u), 1),
                 corr=pearson([g["pred_du_pos"] for g, _ in has_u], [d for _, d in has_u]),
                 dq_trained=statistics.mean(g["q_after"] - g["q_before"] for g in groups),
                 dlog10q_trained=statistics.mean(math.log10(g["q_after"] / g["q_before"])
                                                 for g in groups),
                 others_dlog10q=statistics.mean(r["balance_others_dlog10q"] for r in steps
                                                if "balance_others_dlog10q" in r))
        # A prompt is trained in about steps * B / prompts steps and left out of the rest: the
        # share of its change of log10 Q over a run that came from the steps it was left out of.
        own = len(steps) * b / prompts
        others = (len(steps) - own) * m["others_dlog10q"]
        m["others_share"] = others / (others + own * m["dlog10q_trained"])
    return m


def reach(rows: list, n: int, small_n: int = 16, large_n: int = 512) -> dict:
    """Where each prompt's exact Q went, by two different measures (every prompt of the task is
    followed): the prompts below the gate AT THE START (Q < 1/large_n at the first eval), and the
    prompts NEVER SAMPLED RIGHT (no rollout of any generated group, dropped ones included, was right
    in the whole run). For each: how many, the median change of log10 Q first eval -> last, how many
    fell and how many fell by more than a decade; and the gate prompts that ended below the gate.
    never_drawn: how many prompts no step drew at all, expected from each step's draws (its
    rollouts / n, distinct prompts drawn uniformly); each is also never sampled right."""
    evals = [r for r in rows if "mass_exact_log10" in r]
    prompts = evals[0]["mass_exact_prompts"]
    start = dict(zip(prompts, evals[0]["mass_exact_log10"]))
    end = dict(zip(prompts, evals[-1]["mass_exact_log10"]))
    hit = {p for r in rows for p in r.get("sampled_right", [])}
    low, high = -math.log10(large_n), -math.log10(small_n)
    below = [p for p in prompts if start[p] < low]
    never = [p for p in prompts if p not in hit]
    m = {}
    for name, group in (("below", below), ("never", never),
                        ("below_never", [p for p in below if p not in hit])):
        d = [end[p] - start[p] for p in group]
        m.update({name: len(group),
                  f"{name}_dlog10_median": statistics.median(d) if d else math.nan,
                  f"{name}_fell": sum(x < 0 for x in d),
                  f"{name}_fell_decade": sum(x < -1 for x in d)})
    gate = [p for p in prompts if low <= start[p] < high]
    m.update(gate=len(gate), gate_sank=sum(end[p] < low for p in gate))
    m["never_drawn"] = len(prompts) * math.prod(
        1 - min(r["samples"] / n, len(prompts)) / len(prompts) for r in rows if r["step"] > 0)
    return m


def keys_measures(rows: list, n: int, b: int = 0) -> dict:
    """A keys run's measures (N = n; B is not one of them): the mean exact Q first eval -> last,
    the gate at the end, rollouts and steps, where the prompts went (reach)."""
    evals = [r for r in rows if "mass_exact_mean" in r]
    steps = [r for r in rows if r["step"] > 0]
    return dict(q_start=evals[0]["mass_exact_mean"], q_end=evals[-1]["mass_exact_mean"],
                dq=evals[-1]["mass_exact_mean"] - evals[0]["mass_exact_mean"],
                gate_end=evals[-1]["mass_exact_gate"], samples=sum(r["samples"] for r in steps),
                steps=len(steps), **reach(rows, n))


def table(title: str, configs: dict, keys: list) -> list:
    """A markdown table: per config the mean (sd) over seeds of each measure, and the seed count."""
    lines = [f"### {title}", "", "| config | seeds | " + " | ".join(keys) + " |",
             "|---" * (len(keys) + 2) + "|"]
    for name, runs in configs.items():
        cells = []
        for k in keys:
            xs = [r[k] for r in runs.values() if k in r and not math.isnan(r[k])]
            cells.append(f"{statistics.mean(xs):.4g} ({statistics.stdev(xs):.2g})" if len(xs) > 1
                         else f"{xs[0]:.4g}" if xs else "-")
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines + [""]


def tests(configs: dict, key: str, base: str) -> list:
    """Each config against `base` on one measure: difference of means, Welch t and p, exact MW p."""
    lines = [f"{key}, each config against {base} (unpaired):", ""]
    a = [r[key] for r in configs[base].values()]
    for name, runs in configs.items():
        b = [r[key] for r in runs.values()]
        if name == base or len(a) < 2 or len(b) < 2:
            continue
        t, p = welch(b, a)
        lines.append(f"- {name}: {statistics.mean(b) - statistics.mean(a):+.4g} "
                     f"(Welch t {t:.2f}, p {p:.3g}; Mann-Whitney p {mann_whitney(b, a):.3g}; "
                     f"{len(b)} vs {len(a)} seeds)")
    return lines + [""]


REACH = ["below", "below_dlog10_median", "below_fell", "never", "never_dlog10_median", "never_fell",
         "never_fell_decade", "never_drawn", "below_never", "below_never_dlog10_median", "gate",
         "gate_sank"]


def n_b(name: str) -> tuple:
    """(N, B) from a config's name: N=16,B=8 -> (16, 8)."""
    named = dict(part.split("=") for part in name.split(","))
    return int(named["N"]), int(named["B"])


def pass_against_trained(runs: list) -> list:
    """Over runs of the sets task, as (dq, pass1024, N): pass@1024's Pearson r with dq, and the
    least-squares fit pass1024 = a + b dq + c log2 N, with c's t and two-sided p: does N widen the
    answer distribution beside how far a run trained?"""
    import numpy as np
    x = np.array([[1.0, dq, math.log2(n)] for dq, _, n in runs])  # (runs, 3)
    y = np.array([p for _, p, _ in runs])  # (runs,)
    beta = np.linalg.lstsq(x, y, rcond=None)[0]  # (3,)
    resid, df = y - x @ beta, len(y) - 3  # (runs,)
    se = np.sqrt(np.diag(resid @ resid / df * np.linalg.inv(x.T @ x)))  # (3,)
    r = pearson([dq for dq, _, _ in runs], [p for _, p, _ in runs])
    tc = beta[2] / se[2]
    return [f"pass1024 against dq over the {len(runs)} sets runs (nalone and iso): Pearson r "
            f"{r:.2f};", f"fitted pass1024 = {beta[0]:.4g} {beta[1]:+.4g} dq {beta[2]:+.4g} "
            f"log2 N, log2 N's coefficient t {tc:.2f}, p {stats.t_p(tc, df):.2g} ({df} df)", ""]


def measures(raw: Path, sweep: str, config: str, runs: dict, measure) -> dict:
    """{seed: measure(rows, N, B)} of one config's raw files, each checked (study.measured: one
    line for a file or a config's name that is not this study's)."""
    return {s: study.measured(raw / sweep / config / f"seed{s}.jsonl",
                              lambda rows: measure(rows, *n_b(config)), rows)
            for s, rows in runs.items()}


def report(raw: Path) -> str:
    """The tables and tests, as markdown, from the raw files alone."""
    data = read(raw)
    lines = []
    order = lambda d: dict(sorted(d.items(), key=lambda kv: int(kv[0].split(",")[0][2:])))
    trained = []  # (dq, pass1024, N) of every sets run
    for sweep in ("nalone", "iso"):
        if sweep not in data:
            continue
        configs = {c: measures(raw, sweep, c, runs, sets_measures)
                   for c, runs in order(data[sweep]).items()}
        trained += [(m["dq"], m["pass1024"], n_b(c)[0]) for c, runs in configs.items()
                    for m in runs.values()]
        lines += table(f"{sweep}: the answer distribution, first eval -> last", configs,
                       ["q_start", "q_end", "dq", "right_rose", "worst_drop", "pass1024_start",
                        "pass1024", "entropy", "samples"])
        base = next(iter(configs))
        lines += tests(configs, "dq", base) + tests(configs, "right_rose", base)
        lines += table(f"{sweep}: the 256 prompts' exact Q, by where they started and by what was "
                       "sampled", configs, REACH)
        if sweep == "nalone":
            lines += table("nalone: the mass balance, over every trained group of every step",
                           configs, ["groups", "u_pos_share", "u_pos2", "term3_neg", "du_pos_mean",
                                     "du_pos_fell", "sign_agree", "corr", "dq_trained",
                                     "dlog10q_trained", "others_dlog10q"])
            lines += tests(configs, "du_pos_mean", base) + tests(configs, "du_pos_fell", base)
            # u_pos: the unsampled right mass before the step; du_pos_loss and pred_du_pos_loss:
            # its measured and predicted fall in the update (0 where it rose), means over groups.
            lines += table("nalone: sizes, over the same groups", configs,
                           ["u_pos2", "u_pos", "du_pos_loss", "pred_du_pos_loss", "others_share"])
            lines += tests(configs, "du_pos_loss", base) + tests(configs, "u_pos", base)
    if len(trained) > 3:
        lines += pass_against_trained(trained)
    if "keys2x2" in data:
        configs = {c: measures(raw, "keys2x2", c, runs, keys_measures)
                   for c, runs in data["keys2x2"].items()}
        lines += table("keys2x2: mean exact Q of the 512 prompts", configs,
                       ["q_start", "q_end", "dq", "gate_end", "samples"])
        lines += tests(configs, "dq", "N=16,B=4") + tests(configs, "dq", "N=16,B=16")
        lines += table("keys2x2: the 512 prompts by where they started and by what was sampled",
                       configs, REACH)
        lines += (tests(configs, "never_dlog10_median", "N=16,B=16")
                  + tests(configs, "never_fell_decade", "N=16,B=16"))
    if "prorl" in data:
        configs = {c: measures(raw, "prorl", c, runs, keys_measures)
                   for c, runs in data["prorl"].items()}
        lines += table("prorl: ProRL's shape on keys, mean exact Q", configs,
                       ["q_start", "q_end", "gate_end", "samples", "steps"])
        lines += table("prorl: below the gate at the start, against never sampled right", configs,
                       REACH)
    return "\n".join(lines)


def figure(raw: Path, path: Path) -> None:
    """Figure 3 for a transformer: Q, the share of right answers that rose, the worst drop, each by
    N at every eval (mean over seeds, the seeds' range shaded), beside the free-logit simulation's
    figure (assets/massbalance/simulation.png, tools/massbalance.py)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = read(raw).get("nalone", {})
    panels = [("answers_q", "Q (mean over prompts)"),
              ("answers_right_rose", "share of right answers that rose"),
              ("answers_right_worst_drop", "worst drop of a right answer")]
    sim = HERE / "assets" / "massbalance" / "simulation.png"
    fig = plt.figure(figsize=(15, 8.5 if sim.is_file() else 3.8))
    rows = 2 if sim.is_file() else 1
    grid = fig.add_gridspec(rows, 3, height_ratios=[1, 1.3][:rows])
    axes = [fig.add_subplot(grid[0, i]) for i in range(3)]
    by_n = sorted(runs.items(), key=lambda kv: int(kv[0][2:].split(",")[0]))
    for i, (name, seeds) in enumerate(by_n):
        evals = [[r for r in run if "answers_q" in r] for run in seeds.values()]
        steps = [r["step"] for r in evals[0]]
        for ax, (key, title) in zip(axes, panels):
            ys = [[e[j][key] for e in evals if len(e) > j] for j in range(len(steps))]
            ax.plot(steps, [statistics.mean(y) for y in ys], color=f"C{i}",
                    label=f"{name} ({len(evals)} seeds)")
            ax.fill_between(steps, [min(y) for y in ys], [max(y) for y in ys], color=f"C{i}",
                            alpha=0.2, lw=0)
            ax.set(title=f"transformer, sets task: {title}", xlabel="step")
            ax.title.set_fontsize(9)
    axes[0].legend(fontsize=8)
    if sim.is_file():
        below = fig.add_subplot(grid[1, :])
        below.imshow(plt.imread(sim))
        below.set_title("free logits: the paper's Figure 3, simulated (tools/massbalance.py)",
                        fontsize=9)
        below.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m tools.theorem1_study", description=__doc__.strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/theorem1",
                    help="run directories (default: runs/theorem1)")
    ap.add_argument("--raw", default=str(RAW), help="raw results (default: assets/theorem1)")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="default 0..4")
    ap.add_argument("--only", nargs="+", choices=list(SWEEPS), default=list(SWEEPS))
    ap.add_argument("--steps_nalone", type=int, default=40, help="steps a nalone run (default 40)")
    ap.add_argument("--steps_iso", type=int, default=40, help="steps an iso run (default 40)")
    ap.add_argument("--steps_keys2x2", type=int, default=20, help="steps a keys run (default 20)")
    ap.add_argument("--steps_prorl", type=int, default=150, help="steps a prorl run (default 150)")
    ap.add_argument("--cap", type=float, default=900, help="CPU s a run at most (default 900)")
    ap.add_argument("--report", action="store_true",
                    help="tables and figure from --raw; run nothing")
    args = ap.parse_args(argv)
    raw, out = Path(args.raw), Path(args.out)
    # Every flag, folder and raw file checked before anything is made or run.
    steps = dict(nalone=args.steps_nalone, iso=args.steps_iso, keys2x2=args.steps_keys2x2,
                 prorl=args.steps_prorl)
    if small := [k for k in steps if steps[k] < 4 and k in args.only]:
        fail(f"--steps_{small[0]} {steps[small[0]]}: need >= 4 (an eval every quarter)")
    study.finite_positive("--cap", args.cap)
    study.check_seeds(args.seeds)
    study.check_distinct("--only", args.only)
    study.check_folder("--raw", raw, files=("report.md", "figure3.png"))
    if args.report:  # over raw files that exist, into --raw
        text = report(raw)  # (every raw file read and measured before anything is written)
        study.write_outputs(raw, {"report.md": study.text_writer(text + "\n"),
                                  "figure3.png": lambda path: figure(raw, path)})
        print(text)
        return
    study.check_folder("--out", out)
    study.read_raw(raw)
    todo = jobs(args.only, args.seeds, steps, out, raw, args.cap)
    study.pending(todo)
    study.make_folders(raw, out)
    with study.DriverLock(out):  # one driver at a time on --out
        study.exit_if_failed(study.run_jobs(todo, 1))


if __name__ == "__main__":
    main()
