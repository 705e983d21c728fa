"""ablate.py (the grid, the skip rule, the summary against the runs' own metrics.jsonl, a real
2-config x 2-seed sweep) and what brorl.py gives it: --time_budget, the training clock, --probe_samples."""

import json
import math
import statistics
import time

import pytest
import torch

from tools import ablate, study
import brorl
from lib import diagnostics, policy, step
import sampler

TINY = ["--n_rollouts", "8", "--prompts_per_step", "2", "--eval_prompts", "4", "--eval_samples", "4",
        "--probe_prompts", "2", "--probe_samples", "8", "--max_rows", "256", "--save", "0"]


# ----------------------------------------------------------------------------
# the grid


def test_grid_zips_one_axis_and_crosses_axes():
    configs = ablate.parse_grid([["n_rollouts=16,512", "--prompts_per_step=8,2"], ["lr=1e-4,2e-4,3e-4"]])
    want = [dict(n_rollouts=n, prompts_per_step=b, lr=lr) for n, b in (("16", "8"), ("512", "2"))
            for lr in ("1e-4", "2e-4", "3e-4")]
    assert configs == want  # the first axis varies slowest
    assert ablate.parse_grid([]) == [{}]  # no grid: one config, brorl's defaults and the flags passed
    assert ablate.config_label(dict(model="assets/tiny-arith-hard", n_rollouts="16")) == "model=tiny-arith-hard,n_rollouts=16"


@pytest.mark.parametrize("axes, needle", [
    ([["n_rollouts=16,512", "prompts_per_step=8"]], "need equal counts"),
    ([["n_rollouts"]], "expected flag=v1,v2"),
    ([["n_rollouts="]], "expected flag=v1,v2"),
    ([["n_rollouts=16,,512"]], "an empty value"),
    ([["no_such_flag=1,2"]], "brorl.py has no flag --no_such_flag"),
    ([["seed=0,1"]], "--seed is set by the sweep"),
    ([["n_rollouts=16,512"], ["n_rollouts=32"]], "--n_rollouts is already on an axis"),
    ([["n_rollouts=16,16"]], "the same config twice"),
])
def test_grid_errors_name_the_item(axes, needle):
    with pytest.raises(ValueError, match=needle):
        ablate.parse_grid(axes)


def test_command_line_passes_other_flags_through(capsys):
    args, configs, passthrough = ablate.parse_args(
        ["--preset", "hard", "--grid", "n_rollouts=16,512", "prompts_per_step=8,2", "--seeds", "0", "1",
         "--temperature", "0.9", "--grid", "lr=1e-4,2e-4"])
    assert passthrough == ["--preset", "hard", "--temperature", "0.9"] and args.seeds == [0, 1]
    assert len(configs) == 4
    for bad, needle in ((["--seed", "3"], "--seed: ablate.py sets"), (["--resume=x"], "--resume=x: ablate.py sets"),
                        (["--jobs", "0"], "--jobs 0"), (["--grid", "n_rollouts=16,8", "prompts_per_step=2"], "equal counts")):
        with pytest.raises(SystemExit):
            ablate.parse_args(bad)
        assert needle in capsys.readouterr().err


# ----------------------------------------------------------------------------
# brorl.py: the time budget, the training clock, the probe


@pytest.mark.slow
def test_time_budget_stops_at_the_first_step_boundary_past_it(tmp_path):
    budget = 0.4  # CPU seconds: a few tiny steps, however fast the machine
    rows = brorl.train(brorl.parse_config(["--steps", "1000", "--eval_every", "1000", "--time_budget", str(budget),
                                           "--budget_clock", "cpu", "--out", str(tmp_path), *TINY[:-2]]))
    last = rows[-1]
    assert last["time_train_cpu"] >= budget and all(r["time_train_cpu"] < budget for r in rows[:-1])
    assert 1 <= last["step"] < 1000 and [r["step"] for r in rows] == list(range(last["step"] + 1))
    assert "eval_pass@1" in last and "mass_mean" in last  # evaluated as at the end
    state = torch.load(tmp_path / "ckpt" / "trainer_state.pt", weights_only=False)
    assert state["step"] == last["step"]  # and checkpointed there
    clocks = [r["time_train_wall"] for r in rows]
    assert clocks[0] == 0 and clocks == sorted(clocks)
    # without a budget --steps decides, and the clock is still logged
    rows = brorl.train(brorl.parse_config(["--steps", "2", "--out", str(tmp_path / "b"), *TINY]))
    assert [r["step"] for r in rows] == [0, 1, 2] and rows[-1]["time_train_cpu"] > 0


@pytest.mark.slow
def test_evaluations_are_off_the_training_clock(tmp_path, monkeypatch):
    """An evaluation made slow (a sleep inside it) must not move time_train_wall: the clock counts the
    steps only. With the evaluations on the clock it would exceed the run's wall time less the sleeps."""
    pause, calls, evaluate = 0.3, [], brorl.evaluate

    def slow_evaluate(*args, **kwargs):
        calls.append(1)
        time.sleep(pause)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(brorl, "evaluate", slow_evaluate)
    t0 = time.perf_counter()
    rows = brorl.train(brorl.parse_config(["--steps", "3", "--eval_every", "1", "--out", str(tmp_path), *TINY]))
    wall = time.perf_counter() - t0
    assert len(calls) == 4  # step 0 and every step
    assert 0 < rows[-1]["time_train_wall"] <= wall - pause * len(calls)


def test_probe_uses_probe_samples_whatever_n(monkeypatch):
    model, tok = policy.load_policy(str(brorl.data.EMBEDDED_MODEL), torch.device("cpu"))
    probe = brorl.data.load_task("arith", "test", n=3, seed=0)
    cfg = brorl.Config(n_rollouts=4, probe_samples=7, verifier="rules")
    sizes, generate = [], step.generate
    monkeypatch.setattr(step, "generate", lambda m, t, prompts, n, *a: sizes.append(n) or generate(m, t, prompts, n, *a))
    q, m = diagnostics.probe_mass(model, tok, probe, cfg, torch.Generator().manual_seed(0))
    assert sizes == [7] and q.shape == (3,)
    assert torch.allclose(q * 7, (q * 7).round(), atol=1e-5)  # pass rates of 7 samples
    assert math.isclose(m["mass_mean"], q.double().mean().item(), rel_tol=1e-6)


# ----------------------------------------------------------------------------
# a real sweep: 2 configs x 2 seeds, the summary against metrics.jsonl, the skip rule


def reference_summary(run_dir):
    """The summary's per-run numbers, recomputed here from the run's metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval_pass@1" in r]
    steps = rows[1:]
    n = sum(r["samples"] for r in steps)
    return {"pass@1": evals[-1]["eval_pass@1"], "pass@k": evals[-1]["eval_pass@k"],
            "pass@1_start": rows[0]["eval_pass@1"], "steps": len(steps), "samples": n,
            "keep_rate": sum(r["keep_rate"] * r["samples"] for r in steps) / n,
            "rollout_tokens_per_s": sum(r["resp_len"] * r["samples"] for r in steps) / sum(r["time_rollout"] for r in steps),
            "time_train_cpu": steps[-1]["time_train_cpu"], "time_train_wall": steps[-1]["time_train_wall"],
            "samples_per_s": n / steps[-1]["time_train_wall"],  # the sweep's budget clock: wall, the default
            "zero_adv_frac": sum(r["zero_adv_frac"] * r["samples"] for r in steps) / n,
            "entropy": statistics.fmean(r["entropy"] for r in steps), "mass_start": rows[0]["mass_mean"],
            "mass": evals[-1]["mass_mean"], "mass_fell": evals[-1]["mass_fell"], "correct": evals[-1]["eval_correct"]}


@pytest.mark.slow
def test_smoke_sweep_summary_equals_metrics_and_reruns_skip(tmp_path, monkeypatch):
    out = tmp_path / "sweep"
    argv = ["--grid", "n_rollouts=4,8", "prompts_per_step=4,2", "--seeds", "0", "1", "--jobs", "2",
            "--out", str(out), "--steps", "2", "--eval_every", "1", *TINY[4:]]
    result = ablate.main(argv)
    labels = ["n_rollouts=4,prompts_per_step=4", "n_rollouts=8,prompts_per_step=2"]
    assert list(result["configs"]) == labels
    md = (out / "summary").with_suffix(".md").read_text()
    assert (out / "summary.png").stat().st_size > 10_000 and "Crashed" not in md
    for label in labels:
        runs = result["configs"][label]["runs"]
        assert sorted(runs) == [0, 1]
        ref = {s: reference_summary(out / label / f"seed{s}") for s in (0, 1)}
        for s in (0, 1):
            for k, v in ref[s].items():
                assert runs[s][k] == v if k == "correct" else math.isclose(runs[s][k], v, rel_tol=1e-12), (label, s, k)
            assert sum(ref[s]["correct"]) / (4 * 4) == ref[s]["pass@1"]  # 4 problems x 4 samples
        final = [ref[s]["pass@1"] for s in (0, 1)]
        mean, sd = result["configs"][label]["mean"]["pass@1"]
        assert math.isclose(mean, statistics.fmean(final)) and math.isclose(sd, statistics.stdev(final))
        row = next(line for line in md.splitlines() if line.startswith(f"| {label} |"))
        assert f"{statistics.fmean(final):.3f} ± {statistics.stdev(final):.3f} [{final[0]:.3f}/{final[1]:.3f}]" in row
        assert f"| {statistics.fmean(ref[s]['samples'] for s in (0, 1)):,.0f} |" in row
        config = json.loads((out / label / "seed1" / "config.json").read_text())
        assert config["seed"] == 1 and config["steps"] == 2 and str(config["n_rollouts"]) in label

    # the second config against the first, paired by seed and by problem (both seeds scored the same problems)
    (pair,) = result["paired"]
    a, b = (result["configs"][label]["runs"] for label in labels[::-1])
    assert (pair["a"], pair["b"], pair["seeds"]) == (labels[1], labels[0], [0, 1])
    assert math.isclose(pair["per_seed"]["mean"], statistics.fmean(a[s]["pass@1"] - b[s]["pass@1"] for s in (0, 1)))
    per_problem = [statistics.fmean(a[s]["correct"][j] - b[s]["correct"][j] for s in (0, 1)) / 4 for j in range(4)]
    assert pair["per_problem"]["n"] == 4 and math.isclose(pair["per_problem"]["mean"], statistics.fmean(per_problem))
    assert f"| {labels[1]} | {labels[0]} | 2 |" in md

    # the same command again: every run is complete, nothing is launched, the summary is the same
    launched = []
    monkeypatch.setattr(ablate, "launch", lambda argv, run_dir, threads: launched.append(run_dir) or dict(code=0, seconds=0))
    again = ablate.main(argv)
    assert launched == [] and json.dumps(again["configs"]) == json.dumps(result["configs"])
    # a run without done.json (crashed, killed) is run again, and only it
    (out / labels[1] / "seed0" / "done.json").unlink()
    ablate.main(argv)
    assert launched == [out / labels[1] / "seed0"]
    # another command on finished runs is refused, never mixed in
    with pytest.raises(SystemExit, match="holds a finished run of another command"):
        ablate.main([*argv, "--lr", "1e-4"])


# ----------------------------------------------------------------------------
# paired comparisons (their statistics: tests/test_stats.py)


def test_paired_needs_the_same_problems_for_the_per_problem_test():
    run = lambda p1, correct, problems: {"pass@1": p1, "correct": correct, "eval_samples": 4, "eval_problems": problems}
    result = {"configs": {
        "a": {"runs": {0: run(0.5, [2, 2], "x"), 1: run(0.75, [4, 2], "x"), 2: run(0.0, [0, 0], "x")}},
        "b": {"runs": {0: run(0.25, [1, 1], "x"), 1: run(0.25, [2, 0], "x")}}}}
    pr = ablate.paired(result, "a", "b")
    assert pr["seeds"] == [0, 1] and math.isclose(pr["per_seed"]["mean"], 0.375)  # seed 2 has no partner
    assert pr["per_problem"]["n"] == 2 and math.isclose(pr["per_problem"]["mean"], (1.5 + 1.5) / 2 / 4)
    result["configs"]["b"]["runs"][1]["eval_problems"] = "y"  # scored on other problems: per seed only
    pr = ablate.paired(result, "a", "b")
    assert pr["per_problem"] is None and pr["per_seed"]["n"] == 2


@pytest.mark.slow
def test_a_crashed_run_is_reported_and_the_sweep_goes_on(tmp_path):
    out = tmp_path / "sweep"
    result = ablate.main(["--grid", f"model={ablate.HERE}/assets/tiny-arith,{tmp_path}/no-model", "--out", str(out),
                          "--steps", "1", *TINY[4:]])
    ok, bad = result["configs"]["model=tiny-arith"], result["configs"]["model=no-model"]
    assert sorted(ok["runs"]) == [0] and (out / "model=tiny-arith" / "seed0" / "done.json").is_file()
    assert bad["runs"] == {} and "exit 2" in bad["crashed"][0] and "no such directory" in bad["crashed"][0]
    assert not (out / "model=no-model" / "seed0" / "done.json").exists()
    assert "model=no-model seed 0: exit 2" in (out / "summary").with_suffix(".md").read_text()


def test_harder_model_loads_and_its_right_answer_is_rarer_than_the_hard_ones():
    """The far end of the difficulty map (data.py VARIANTS["harder"]): it answers in format, and its
    build report puts the correct rate at T = 1 under 1% and under the hard model's."""
    import re
    model, tok = policy.load_policy(str(brorl.data.EMBEDDED_MODEL_HARDER), torch.device("cpu"))
    report = json.loads((brorl.data.EMBEDDED_MODEL_HARDER / "warmstart.json").read_text())
    hard = json.loads((brorl.data.EMBEDDED_MODEL_HARD / "warmstart.json").read_text())
    assert report["config"]["p_correct"] == brorl.data.VARIANTS["harder"]["p_correct"]
    assert report["heldout"]["temp1"]["pass@1"] < min(0.01, hard["heldout"]["temp1"]["pass@1"])
    probs = brorl.data.load_task("arith", "test", n=8, seed=5)
    ro = sampler.generate(model, tok, [p["prompt"] for p in probs], 16, 6, 1.0, 1.0, 4096, torch.Generator().manual_seed(0))
    assert sum(not t and re.fullmatch(r"[0-9]+", x) is not None for x, t in zip(ro.texts, ro.truncated.tolist())) >= 0.9 * len(ro.texts)


# ----------------------------------------------------------------------------
# the exact-Q measures (lib/mass.py's per-prompt log10 Q, first evaluation to last)


def test_zone_migration_counts_by_hand():
    lo, hi = -math.log10(512), -math.log10(16)  # the gate: lo <= log10 Q < hi
    start = [-0.5, -1.0, -2.0, -2.5, -2.0, -4.0, -5.0, -6.0]
    end = [-0.5, -1.5, -1.0, -2.5, -3.0, -4.5, -5.5, -5.0]  # lost 1 (into the gate); gate: 1 lifted, 1 stays, 1 fell; below: -0.5 x2, +1
    first = dict(mass_exact_mean=0.1, mass_exact_log10=start)
    last = dict(mass_exact_mean=0.2, mass_exact_log10=end)
    m = ablate.zone_migration(first, last, 16, 512)
    assert (lo, hi) == pytest.approx((-2.709, -1.204), abs=1e-3)
    assert m["gate_start"] == 3 and m["gate_lifted"] == 1 and m["high_lost"] == 1
    assert m["gate_left"] == 2  # in the gate at the end: the one that stayed and the one that fell into it
    assert m["below_dlog10_median"] == pytest.approx(-0.5) and m["exact_q"] == 0.2
    assert ablate.zone_migration({}, last, 16, 512) == {}  # a run without exact Q: no measures


def test_breadth_study_gate_and_plot(tmp_path):
    """tools/breadth_study.py's gate count (the branch point needs >= 30 prompts in it) and its figure from a
    summary's per-prompt log10 Q (a synthetic one: two arms, two seeds)."""
    from tools import breadth_study
    assert breadth_study.gate_count([-1.0, -1.3, -2.0, -2.7, -2.8, -5.0]) == 3  # -1.3, -2.0, -2.7 in [-2.709, -1.204)
    run = dict(log10_q_start=[-1.0, -2.0, -4.0], log10_q_end=[-0.5, -1.0, -5.0])
    result = dict(configs={"n_rollouts=16,prompts_per_step=16,lr=2e-4": dict(runs={0: run, 1: run}),
                           "n_rollouts=512,prompts_per_step=4,lr=2e-4": dict(runs={0: run})})
    breadth_study.plot_study({"warm": result, "mid": result}, tmp_path / "study.png")
    assert (tmp_path / "study.png").stat().st_size > 1000


def test_a_run_another_process_holds_is_left_alone(tmp_path):
    """A sweep started twice: the run the other sweep is running (its brorl.py holds <run>/.lock) is not
    cleared; once that process is gone the run is free again."""
    import subprocess
    import sys
    run = tmp_path / "cfg" / "seed0"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0}\n')
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()", str(run / ".lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        res = ablate.launch(["--steps", "1"], run, 1)
        assert res["code"] != 0 and "another process is running it" in res["error"]
        assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n'  # untouched
    finally:
        holder.stdin.close()
        holder.wait()
    assert not study.lock_holder(run)  # the holder is gone: its file left behind is free
