"""The SmolLM2 revival study's rules (tools/smollm2_revival_study.py): the plateau, fixed before its
trunk ran, and the census's go/no-go, fixed before the census ran; the report's tests, written
before any arm's end was read. Fast: no model."""

import json
import statistics
import threading
from pathlib import Path

import pytest
import scipy.stats

from tools import smollm2_revival_study as srs


def rows(pass1, mass, every=srs.EVAL_EVERY):
    """A trunk's metrics rows: an evaluation every `every` steps, training rows between."""
    out = []
    for i, (p, q) in enumerate(zip(pass1, mass)):
        out.append({"step": i * every, "eval_pass@1": p, "mass_mean": q})
        out += [{"step": i * every + j, "reward_mean": 0.5} for j in range(1, every)
                if i < len(pass1) - 1]
    return out


WOBBLE = [0.004, -0.003, 0.002, -0.004, 0.003, -0.002, 0.001]


def flat(level, n):
    return [level + WOBBLE[i % len(WOBBLE)] for i in range(n)]


def test_flat_evaluations_are_a_plateau():
    t = srs.plateau_test(rows(flat(0.6, 10), flat(0.5, 10)))
    assert t["plateau"] and t["verdict"] == "plateau" and t["step"] == 90 and t["evals"] == 6
    assert t["pass1"]["ci_low"] <= 0 <= t["pass1"]["ci_high"]


def test_a_rise_in_either_measure_is_no_plateau():
    rising = [0.3 + 0.01 * i for i in range(10)]  # 0.1 a 100 steps, steadily
    assert not srs.plateau_test(rows(rising, flat(0.5, 10)))["plateau"]
    assert not srs.plateau_test(rows(flat(0.6, 10), rising))["plateau"]


def test_too_noisy_to_tell_is_no_plateau():
    """An interval that holds 0 only because it is wide is not a plateau (the bound)."""
    noisy = [0.6 + (0.08 if i % 2 else -0.08) for i in range(10)]
    t = srs.plateau_test(rows(noisy, flat(0.5, 10)))
    assert t["pass1"]["ci_low"] <= 0 <= t["pass1"]["ci_high"] and not t["plateau"]


def test_not_before_the_window_and_only_the_window_counts():
    assert not srs.plateau_test(rows(flat(0.6, 6), flat(0.5, 6)))["plateau"]  # step 50 < 60
    # an early rise, then flat for the window: a plateau at step 120
    early = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.6] + flat(0.6, 6)
    t = srs.plateau_test(rows(early, flat(0.5, 13)))
    assert t["plateau"] and t["step"] == 120


@pytest.mark.parametrize("level, verdict", [(0.97, "saturated"), (0.03, "wall"), (0.5, "plateau")])
def test_verdicts(level, verdict):
    assert srs.plateau_test(rows(flat(level, 10), flat(0.5, 10)))["verdict"] == verdict


def test_at_the_cap_the_branch_says_no_plateau_and_judges_the_windows_mean():
    """The cap's record (fixed at step 200): plateau False, verdict "cap" unless the window's mean
    held-out pass@1, not its last evaluation, is a saturation or a wall."""
    rising = [0.3 + 0.02 * i for i in range(31)]  # 0.2 a 100 steps: never a plateau
    r = rows(rising, flat(0.5, 31))
    record = srs.cap_record(srs.plateau_test(r), r)
    assert (record["step"], record["plateau"], record["verdict"]) == (300, False, "cap")
    assert record["window_pass1_mean"] == pytest.approx(statistics.fmean(rising[-6:]))
    flat_test = srs.plateau_test(rows(flat(0.5, 7), flat(0.5, 7)))  # any tested window's record
    # the last evaluation at 0.96 in a window whose mean is 0.93: not a saturation
    last_high = [0.93, 0.92, 0.93, 0.92, 0.92, 0.96]
    assert srs.cap_record(flat_test, rows(last_high, flat(0.5, 6)))["verdict"] == "cap"
    high = [0.96, 0.95, 0.97, 0.96, 0.95, 0.94]
    assert srs.cap_record(flat_test, rows(high, flat(0.5, 6)))["verdict"] == "saturated"
    assert srs.cap_record(flat_test, rows(flat(0.03, 7), flat(0.5, 7)))["verdict"] == "wall"
    # a cap before the window (step 50 < 60) is no branch point: nothing to write
    early = rows(flat(0.5, 6), flat(0.5, 6))
    assert srs.cap_record(srs.plateau_test(early), early) == {}


@pytest.mark.parametrize("verdict", ["saturated", "wall"])
def test_a_saturated_or_walled_trunk_runs_no_census(tmp_path, capsys, verdict):
    raw = tmp_path / "raw"
    (raw / "trunk").mkdir(parents=True)
    (raw / "trunk" / "plateau.json").write_text(json.dumps(
        dict(step=300, pass1={}, mass={}, plateau=False, verdict=verdict)))
    with pytest.raises(SystemExit):
        srs.main(["--only", "census", "--out", str(tmp_path / "out"), "--raw", str(raw)])
    assert f"verdict is {verdict}; the task is made harder" in capsys.readouterr().err
    assert not (raw / "census-plateau" / "census.jsonl").exists()


@pytest.mark.parametrize("verdict", ["saturated", "wall"])
def test_the_harder_task_saturated_or_walled_is_censused_all_the_same(tmp_path, monkeypatch,
                                                                      capsys, verdict):
    """The task is made harder once: add3's trunk (a testbed with a start), whatever its verdict,
    goes on to its census, whose go or no-go decides."""
    raw = tmp_path / "raw"
    (raw / "add3" / "trunk").mkdir(parents=True)
    (raw / "add3" / "trunk" / "plateau.json").write_text(json.dumps(
        dict(step=300, pass1={}, mass={}, plateau=False, verdict=verdict)))
    (raw / "add3" / "trunk" / "chunks.jsonl").write_text("")
    censused = []
    monkeypatch.setattr(srs, "plateau_census", lambda out, raw, first, task: censused.append(
        (raw, task)) or {"go": False})
    srs.main(["--testbed", "add3", "--only", "census", "--out", str(tmp_path / "out"),
              "--raw", str(raw)])
    assert censused == [(raw / "add3", srs.TESTBEDS["add3"].task)]
    assert f"verdict is {verdict}, on a task made harder once" in capsys.readouterr().out


def timed_rows(steps_cpu: list) -> str:
    """A run's metrics.jsonl rows: (step, cumulative time_train_cpu) each, flags in the first."""
    return "".join(json.dumps({"step": s, "time_train_cpu": c, **({"argv": []} if not i else {})})
                   + "\n" for i, (s, c) in enumerate(steps_cpu))


def made_up_costs(raw: Path, chunks=((10, 150), (20, 160), (30, 300)), prompts=8):
    """A trunk of three chunks (steps 20-30 at 20 s a step, earlier at 10) and a pilot: N = 256
    steps of 250, 100 and 550 s; a census prompt 80 s / 8 at 128 samples; an evaluation 60 s."""
    trunk, pilot = raw / "add3" / "trunk", raw / "add3-pilot"
    trunk.mkdir(parents=True), pilot.mkdir(exist_ok=True)
    (trunk / "metrics.jsonl").write_text(timed_rows([(0, 0), (10, 100), (20, 200), (30, 400)]))
    (trunk / "chunks.jsonl").write_text("".join(json.dumps({"steps_to": t, "cpu_s": c}) + "\n"
                                                for t, c in chunks))
    (pilot / "n256-steps.jsonl").write_text(timed_rows([(0, 0), (1, 250), (2, 350), (3, 900)]))
    (pilot / "census-cpu.json").write_text(json.dumps(dict(cpu_s=80, prompts=prompts,
                                                           samples=128)))
    (pilot / "base-eval.json").write_text(json.dumps(dict(seconds=60)))


def test_the_plan_prices_each_arm_from_the_measured_costs(tmp_path, monkeypatch):
    """Each arm's CPU hours from the raw files, computed by hand here: an N = 16 step the mean of
    the trunk's last TRAILING steps, an N = 256 step the pilot's mean, a run's load and its two
    evaluations the first chunk's CPU beyond its steps, a census prompt the pilot's per sample."""
    raw = tmp_path / "raw"
    made_up_costs(raw)
    monkeypatch.setattr(srs, "TRAILING", 20)  # steps 10-30: 10 and 20 s a step
    text = srs.plan(raw, srs.TESTBEDS["add3"], 5, 40)
    row = lambda name: next(ln for ln in text.splitlines() if ln.startswith(f"| {name} |"))
    step, big, run = 15, (250 + 100 + 550) / 3, 150 - 100
    assert f"load and evaluations: {run} s" in text.splitlines()[0]
    assert row("n16") == f"| n16 | 5 | 4 | 15 | {5 * (4 * step + run) / 3600:.2f} |"
    assert row("n256-lr") == f"| n256-lr | 5 | 4 | 300 (100-550) | " \
                             f"{5 * (4 * big + run) / 3600:.2f} |"
    assert row("n16-long") == f"| n16-long | 5 | 64 | 15 | {5 * (64 * step + run) / 3600:.2f} |"
    prompt = 80 / 8 * 256 / 128  # a census prompt at 256 samples
    censuses = 20 * 48 * prompt / 3600
    assert row("end censuses (48 x 256)").endswith(f"| {prompt:.1f} a prompt | {censuses:.2f} |")
    arms = (5 * (4 * step + run) + 2 * 5 * (4 * big + run) + 5 * (64 * step + run)) / 3600
    assert f"**{arms + censuses:.2f}**" in row("**the arms**")
    assert row("spent: add3 trunk").endswith(f"| {610 / 3600:.2f} |")
    trunk = 10 * 610 / 30 / 3600  # 10 steps at the chunks' mean step
    assert row("to come: the trunk to step 40 (its mean step)").endswith(f"| {trunk:.2f} |")
    census_cost = 64 * 2 * prompt / 3600  # 64 prompts x 512 samples
    assert row("to come: its plateau census (64 x 512)").endswith(f"| {census_cost:.2f} |")
    pilot = (900 + 80 + 60) / 3600  # its N = 256 steps' training CPU, the census timing, an eval
    assert row("spent: add3-pilot (as its files record)").endswith(f"| {pilot:.2f} |")
    left = 30 - pilot - 610 / 3600 - trunk - census_cost
    assert row("left of 30 CPU h").endswith(f"| {left:.2f} (the arms fit) |")
    monkeypatch.setattr(srs, "BUDGET_H", 1)
    assert srs.plan(raw, srs.TESTBEDS["add3"], 5, 40).endswith("(the arms do not fit) |\n")


def test_the_plan_refuses_what_it_cannot_price_in_one_line(tmp_path, capsys):
    for broken, named in [(dict(chunks=()), "chunks.jsonl: no chunk recorded"),
                          (dict(chunks=((10, 150), (10, 160))), "do not increase"),
                          (dict(chunks=((5, 150),)), "no time_train_cpu at step 5"),
                          (dict(prompts=0), "census-cpu.json: cpu_s, prompts and samples")]:
        raw = tmp_path / str(len(named))
        made_up_costs(raw, **broken)
        with pytest.raises(SystemExit):
            srs.plan(raw, srs.TESTBEDS["add3"], 5, 40)
        err = capsys.readouterr().err
        assert named in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(SystemExit):
        srs.plan(tmp_path, srs.TESTBEDS["add2"], 5, 40)
    assert "no measured N = 256 step" in capsys.readouterr().err


def test_go_counts_prompts_resolved_inside_the_reach():
    # Q = 8/512 = 1/64: its interval [0.0068, 0.031] lies in [1/512, 1/16)
    inside = {"right": 8, "samples": 512}
    # Q = 1/512: its interval reaches below 1/512; Q = 40/512 lies above 1/16
    edge, high = {"right": 1, "samples": 512}, {"right": 40, "samples": 512}
    c = srs.reach_count([inside] * 3 + [edge, high])
    assert (c["reach_resolved"], c["reach_point"], c["go"]) == (3, 4, False)
    assert srs.reach_count([inside] * srs.GO_PROMPTS)["go"]


def test_flags_refused_in_one_line(tmp_path, capsys):
    for argv, what in [(["--chunk", "15"], "--chunk 15"), (["--census_first", "65"],
                                                          "--census_first 65"),
                       (["--max_steps", "0"], "--max_steps 0")]:
        with pytest.raises(SystemExit):
            srs.main([*argv, "--out", str(tmp_path / "o"), "--raw", str(tmp_path / "r")])
        assert what in capsys.readouterr().err
    assert not (tmp_path / "o").exists() and not (tmp_path / "r").exists()


def write_census(folder, rights, samples, lenient=None):
    """A census folder of made-up records; lenient: each prompt's right_lenient."""
    folder.mkdir(parents=True)
    (folder / "census.json").write_text(json.dumps({"samples": samples}))
    extra = lambda i: {} if lenient is None else {"right_lenient": lenient[i]}
    (folder / "census.jsonl").write_text("".join(
        json.dumps(dict(index=i, prompt=f"p{i}", answer="1", right=r, samples=samples, mean_len=20,
                        truncated=0, **extra(i))) + "\n" for i, r in enumerate(rights)))


def test_the_report_pairs_each_arm_with_n16_by_seed(tmp_path):
    """The report's tests on made-up raw files: the held-out pass@1 differences and a census
    measure recomputed here by hand (mean, paired t's p, the reach prompts lifted)."""
    raw = tmp_path / "raw"
    # the plateau census: prompts 0 and 1 in the reach (4/512 and 20/512), 2 above, 3 below
    write_census(raw / "census-plateau", [4, 20, 100, 0], 512)
    ends = {"n16": [0.50, 0.52, 0.48], "n256": [0.56, 0.55, 0.53]}
    lifted = {"n16": [[0, 1, 60, 0], [0, 1, 60, 0], [20, 1, 60, 0]],  # 0, 0, 1 lifted
              "n256": [[20, 20, 0, 0], [20, 1, 0, 0], [20, 20, 0, 0]]}  # 2, 1, 2 (prompt 2 fell)
    for arm, values in ends.items():
        for s, v in enumerate(values):
            path = raw / "arms" / arm / f"seed{s}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"step": 0, "eval_pass@1": 0.4, "argv": []}) + "\n"
                            + json.dumps({"step": 4, "eval_pass@1": v}) + "\n")
            write_census(raw / "census-arms" / arm / f"seed{s}", lifted[arm][s], 256)
    text = srs.report(raw)
    diffs = [a - b for a, b in zip(ends["n256"], ends["n16"])]
    p = scipy.stats.ttest_1samp(diffs, 0).pvalue
    row = next(ln for ln in text.splitlines() if ln.startswith("| held-out pass@1 |"))
    ci = scipy.stats.ttest_1samp(diffs, 0).confidence_interval()
    assert f"| 3 | {statistics.fmean(diffs):+.4f} | {ci.low:+.4f} .. {ci.high:+.4f} | {p:.3g} |" \
        in row, row
    row = next(ln for ln in text.splitlines() if ln.startswith("| reach prompts lifted |"))
    assert "| 3 | +1.3333 |" in row, row
    assert "n256-lr" not in text  # an arm with no runs is left out


def test_arms_branch_from_the_plateau_with_the_arms_flags(tmp_path):
    argv = srs.arm_argv("n256-lr", 3, tmp_path)
    value = lambda flag: argv[len(argv) - 1 - argv[::-1].index(flag) + 1]
    assert (value("--seed"), value("--n_rollouts"), value("--steps"), value("--eval_every")) == \
        ("3", "256", "4", "4")
    assert float(value("--lr")) == pytest.approx(srs.LR * 4) and argv.count("--lr") == 1
    assert value("--init_from") == str(tmp_path / "trunk-branch") and "--init_optimizer" in argv
    long = srs.arm_argv("n16-long", 0, tmp_path)
    assert long[long.index("--steps") + 1] == "64" and "--n_rollouts" not in long  # the preset's 16


def test_the_end_censuses_run_jobs_at_a_time_and_name_each_failure(tmp_path, monkeypatch, capsys):
    """After the arm runs, their end censuses run --jobs at a time (two at once meet at a barrier
    that one at a time never reaches), each on its run's checkpoint; a failed one is named."""
    out, raw = tmp_path / "out", tmp_path / "raw"
    for folder in (out / "trunk-branch" / "ckpt", out / "arms", raw / "census-plateau"):
        folder.mkdir(parents=True)
    (raw / "census-plateau" / "go.json").write_text(json.dumps({"go": True}))
    for arm in srs.ARMS:  # every arm run done: only the censuses are left
        (raw / "arms" / arm).mkdir(parents=True)
        (raw / "arms" / arm / "seed0.jsonl").write_text("{}\n")
    meet, censused = threading.Barrier(2, timeout=60), []

    def child(argv, log, cwd=None):
        meet.wait()
        censused.append(argv[-1])
        return 1 if "n256-lr" in argv[-1] else 0

    monkeypatch.setattr(srs.study, "run_child", child)
    with pytest.raises(SystemExit):
        srs.arms(out, raw, [0], jobs=2)
    assert sorted(censused) == sorted(str(out / "arms" / a / "seed0" / "ckpt") for a in srs.ARMS)
    err = capsys.readouterr().err
    assert "1 run(s) failed" in err and "the census of n256-lr seed 0" in err, err


def made_up_study(raw):
    """A trunk at its cap, the plateau census and two arms at two seeds, with lenient counts."""
    trunk = rows(flat(0.9, 8), flat(0.95, 8))
    for r in trunk:
        if "eval_pass@1" in r:
            r["eval_lenient_pass@1"] = r["eval_pass@1"] + 0.02
    trunk[0]["argv"] = srs.TRUNK_FLAGS
    (raw / "trunk").mkdir(parents=True)
    (raw / "trunk" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trunk))
    record = srs.cap_record(srs.plateau_test(trunk), trunk)
    (raw / "trunk" / "plateau.json").write_text(json.dumps(record))
    write_census(raw / "census-plateau", [4, 20, 100, 0], 512, lenient=[6, 20, 110, 1])
    ends = {"n16": [(0.90, 0.91), (0.88, 0.92)], "n256": [(0.93, 0.93), (0.92, 0.95)]}
    for arm, values in ends.items():
        for s, (rules, lenient) in enumerate(values):
            path = raw / "arms" / arm / f"seed{s}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"step": 0, "eval_pass@1": 0.9, "argv": []}) + "\n"
                            + json.dumps({"step": 4, "eval_pass@1": rules,
                                          "eval_lenient_pass@1": lenient}) + "\n")
            write_census(raw / "census-arms" / arm / f"seed{s}", [20, 1 + s, 60, 0], 256,
                         lenient=[30, 1 + 2 * s, 60, 4])
    return record, ends


def test_the_report_starts_with_the_branch_and_census_and_reads_form_apart(tmp_path):
    """The report's first tables are the branch point (its step, verdict, last evaluation by the
    rules and leniently) and the plateau census (mean Q and lenient Q, the go/no-go); each arm's
    tests hold a lenient row beside the rules' (held-out and census), computed by hand here."""
    raw = tmp_path / "raw"
    record, ends = made_up_study(raw)
    text = srs.report(raw)
    branch = text.split("## The trunk's branch point", 1)[1].split("\n")[4]
    assert branch.startswith(f"| 70 | cap | {flat(0.9, 8)[-1]:.4f} | "
                             f"{flat(0.9, 8)[-1] + 0.02:.4f} | {flat(0.95, 8)[-1]:.4f} |"), branch
    assert record["verdict"] == "cap"
    plateau = text.split("## The plateau census", 1)[1].split("\n")[4]
    assert plateau.startswith(f"| 4 x 512 | {124 / 2048:.4f} | {137 / 2048:.4f} |"), plateau
    assert plateau.endswith("| 2 | 2 | no |"), plateau  # 2 resolved inside (< 4: no go)
    line = lambda name: next(ln for ln in text.splitlines() if ln.startswith(f"| {name} |"))
    diffs = [a[1] - b[1] for a, b in zip(ends["n256"], ends["n16"])]
    assert f"| 2 | {statistics.fmean(diffs):+.4f} |" in line("held-out lenient pass@1")
    # the end censuses are alike in both arms: no difference, by the rules or leniently
    assert "| 2 | +0.0000 |" in line("lenient pass@1") and "| 2 | +0.0000 |" in line("pass@1")


def test_the_report_refuses_a_branch_record_cut_short_in_one_line(tmp_path, capsys):
    """A plateau.json without a slope's interval, or a branch step before any evaluation: one line
    naming the file, not a KeyError or an IndexError."""
    raw = tmp_path / "raw"
    record, _ = made_up_study(raw)
    path = raw / "trunk" / "plateau.json"
    for broken, named in [({**record, "mass": {"slope_per_100": 0.0}}, "mass.ci_low"),
                          ({**record, "step": -10}, "no evaluation at or before")]:
        path.write_text(json.dumps(broken))
        with pytest.raises(SystemExit):
            srs.report(raw)
        err = capsys.readouterr().err
        assert named in err and str(raw / "trunk") in err, err


def test_the_figure_is_the_same_bytes_from_the_same_raw_files(tmp_path):
    raw = tmp_path / "raw"
    made_up_study(raw)
    srs.figure(raw, tmp_path / "a.png")
    srs.figure(raw, tmp_path / "b.png")
    png = (tmp_path / "a.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png == (tmp_path / "b.png").read_bytes()


@pytest.mark.parametrize("bed", list(srs.TESTBEDS))
def test_the_committed_report_and_figure_regenerate_from_the_raw_files(bed):
    """assets/smollm2-revival/report.md and figure.png, and those of each later testbed, are what
    --report makes of the raw files beside them, byte for byte (the PNG with the pinned
    matplotlib), once the testbed's census has made a report possible."""
    raw = srs.RAW / srs.TESTBEDS[bed].folder
    if not (raw / "report.md").is_file():
        pytest.skip(f"no report of {bed} committed yet: its plateau census has not ended")
    import tempfile
    assert srs.report(raw) == (raw / "report.md").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        srs.figure(raw, Path(tmp) / "figure.png", srs.TESTBEDS[bed].window)
        assert (Path(tmp) / "figure.png").read_bytes() == (raw / "figure.png").read_bytes(), \
            f"{raw / 'figure.png'} differs: rerun --report (matplotlib, Pillow at their pins?)"


def test_add3_continues_add2s_branch_on_three_digit_sums(tmp_path, capsys):
    """The second testbed, fixed after add2's no-go: its trunk's flags are add2's with the
    three-digit task, started from add2's branch point with its AdamW moments; its census and arms
    read the same task, its arms branch from its own branch point; add2's commands are unchanged
    (its committed census's argv); a missing start is one line before anything is made."""
    add3 = srs.TESTBEDS["add3"]
    flags = srs.trunk_flags(add3, tmp_path)
    assert flags == [*srs.TRUNK_FLAGS, "--task", "math:assets/smollm2/add3.jsonl", "--init_from",
                     str(tmp_path / "trunk-branch"), "--init_optimizer"]
    assert srs.trunk_flags(srs.TESTBEDS["add2"], tmp_path) == srs.TRUNK_FLAGS
    out = tmp_path / "add3"
    census = srs.census_argv(out, tmp_path / "raw", 64, add3.task)
    assert census[census.index("--task") + 1] == "math:assets/smollm2/add3.jsonl"
    assert census[-1] == str(out / "trunk-branch" / "ckpt")
    arm = srs.arm_argv("n256", 0, out, add3.task)
    assert arm[arm.index("--task") + 1] == "math:assets/smollm2/add3.jsonl"
    assert arm[arm.index("--init_from") + 1] == str(out / "trunk-branch")
    committed = json.loads((srs.RAW / "census-plateau" / "census.json").read_text())["argv"]
    argv = srs.census_argv(__import__("pathlib").Path("runs/smollm2-revival"), srs.RAW, 64)
    assert argv[argv.index("--") + 1:] == committed
    with pytest.raises(SystemExit) as stop:
        srs.main(["--testbed", "add3", "--out", str(tmp_path / "out"), "--raw",
                  str(tmp_path / "raw")])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1, err
    assert "starts from add2's branch point" in err and not (tmp_path / "out").exists(), err
