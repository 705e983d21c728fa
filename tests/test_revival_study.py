"""The revival study (tools/revival_study.py): its plateau rule, its measures and its report, by
hand on made-up raw files; and --train_prompts, the flag its testbed is built on."""

import json
import math
import random

import pytest
from scipy import stats as scipy_stats

import brorl
from lib import setup
from tools import revival_study as study


def _rows(qs: list, every: int = 10) -> list:
    """A trunk's eval rows: the mean exact Q at steps 0, every, 2 every, ..."""
    return [dict(step=i * every, answers_q=q) for i, q in enumerate(qs)]


def test_plateau_rule():
    """Flat with noise: a plateau; rising 0.05 per 100 steps (outside +-0.01): not, however
    straight; too few steps for the window: not yet; falling slowly inside the bound, the interval
    covering 0: a plateau."""
    rng = random.Random(0)
    flat = _rows([0.5] * 5 + [0.9 + rng.gauss(0, 1e-3) for _ in range(15)])
    assert study.plateau_test(flat, 100)["plateau"]
    rising = _rows([0.5 + 0.005 * i for i in range(20)])
    test = study.plateau_test(rising, 100)
    assert not test["plateau"] and abs(test["slope_per_100"] - 0.05) < 1e-9
    assert not study.plateau_test(flat[:8], 100)["plateau"]  # step 70 < the window
    drift = _rows([0.9 - 2e-5 * i + rng.gauss(0, 1e-3) for i in range(20)])
    assert study.plateau_test(drift, 100)["plateau"]


def test_zones_edges():
    """1/16 is high; 1/2048 is in the window; just under it is below."""
    lo, hi = math.log10(1 / 2048), math.log10(1 / 16)
    assert study.zones([hi, hi - 1e-9, lo, lo - 1e-9, -30]) == dict(high=1, window=2, below=2)


def test_arm_flags_replace_the_trunks_and_scale_the_lr_by_the_papers_rule(tmp_path):
    """Each flag once: the arm's value in place of the trunk's; n512-lr at 2e-4 x sqrt(512 / 16)."""
    argv = study.arm_argv("n512-lr", 3, tmp_path / "b", tmp_path / "r", 100)
    flags = [a for a in argv if a.startswith("--")]
    assert len(flags) == len(set(flags)), argv
    named = dict(zip(argv[:-1], argv[1:]))
    assert named["--n_rollouts"] == "512" and named["--seed"] == "3"
    assert abs(float(named["--lr"]) - 2e-4 * math.sqrt(32)) < 1e-6
    assert named["--prompts_per_step"] == named["--train_prompts"] == "64"
    long = study.arm_argv("n16-long", 0, tmp_path, tmp_path, 1)
    assert int(long[long.index("--steps") + 1]) == 32 * study.STEPS  # the rollouts of n512's steps at N = 16


def _arm_rows(q0: list, q1: list, cpu: float, n: int, steps: int = 4) -> list:
    """An arm run's rows: the branch eval, `steps` training steps of n rollouts a prompt, the end
    eval; per-prompt log10 Q from q0 to q1."""
    def ev(step, qs, t):
        return dict(step=step, answers_q=sum(10 ** q for q in qs) / len(qs),
                    answers_log10_q_per_prompt=qs, answers_right_rose=0.5,
                    answers_right_worst_drop=0.01, answers_worst_drop_max=0.02,
                    answers_entropy=0.1, time_train_cpu=t,
                    **{f"answers_pass@{k}": 0.9 for k in (1, 16, 256, 1024)})
    mid = [dict(step=s, samples=64 * n, groups_kept=3, time_train_cpu=cpu * s / steps,
                balance_groups=[dict(U_pos_before=0.2, U_pos_after=0.1, q_before=0.5)])
           for s in range(1, steps)]
    return [ev(0, q0, 0.0), *mid, {**ev(steps, q1, cpu), "samples": 64 * n, "groups_kept": 3}]


def test_report_from_made_up_raw_files(tmp_path):
    """The report's numbers from raw files written by hand: a prompt in the window that crossed
    1/16 is revived; the change of the mean exact Q compared arm against arm; a report over no
    trunk is an error."""
    raw = tmp_path / "raw"
    trunk = [dict(step=s, answers_q=0.5, answers_log10_q_per_prompt=[-3.0, 0.0])
             for s in range(0, 110, 10)]
    (raw / "trunk").mkdir(parents=True)
    (raw / "trunk" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trunk))
    (raw / "trunk" / "chunks.jsonl").write_text(json.dumps(dict(steps_to=100, cpu_s=9.0)) + "\n")
    rec = {**study.plateau_test(trunk, 100), **study.branch_point(trunk, dict(step=100), 100),
           "window": 100}
    assert rec["plateau"] and rec["zones_branch"] == dict(high=1, window=1, below=0)
    (raw / "trunk" / "plateau.json").write_text(json.dumps(rec))
    for seed in range(3):
        for arm, end in (("prorl", -3.0), ("n512", -0.5 - 0.1 * seed)):
            path = raw / "arms" / arm / f"seed{seed}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            rows = _arm_rows([-3.0, 0.0], [end, 0.0], 10.0, 16 if arm == "prorl" else 512)
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = study.arm_measures(rows)
    assert m["revived_window"] == 1 and m["revived_below"] == 0
    assert m["du_pos"] == pytest.approx(-0.1) and m["u_share"] == pytest.approx(0.4)
    assert m["rollouts"] == 4 * 64 * 512 and m["updates"] == 8
    text = study.report(raw)
    want = statistics_mean([(10 ** (-0.5 - 0.1 * s) - 1e-3) / 2 for s in range(3)])
    assert f"| n512 | {want:+.4f} [" in text, text
    study.main(["--report", "--raw", str(raw)])
    assert (raw / "revival.png").stat().st_size > 0 and (raw / "report.md").is_file()


def statistics_mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize("flags", [["--jobs", "0"], ["--cap", "nan"], ["--trunk_cap", "-5"],
                                   ["--seeds", "-1"], ["--chunk", "0"]])
def test_study_flags_are_checked_before_any_run(tmp_path, flags, capsys):
    with pytest.raises(SystemExit):
        study.main([*flags, "--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw")])
    assert not (tmp_path / "out").exists() and flags[0] in capsys.readouterr().err


def test_train_prompts_trains_on_the_eval_sets_first_prompts(capsys):
    """--train_prompts n: the training set is the eval set's first n prompts (those the answer
    distributions measure); refused where train and eval differ, or past --eval_prompts."""
    cfg = brorl.parse_config(["--preset", "sets", "--train_prompts", "8", "--eval_prompts", "16",
                              "--prompts_per_step", "8", "--answer_prompts", "8"])
    cfg, _, train_set, eval_set, *_ = setup.setup(cfg, cfg.model, "--model")
    assert [x["prompt"] for x in train_set] == [x["prompt"] for x in eval_set[:8]]
    assert len(eval_set) == 16
    for flags, said in ((["--train_prompts", "8"], "--train_prompts 8: needs a task"),
                        (["--preset", "sets", "--train_prompts", "300"], "at most --eval_prompts")):
        with pytest.raises(SystemExit):
            brorl.parse_config(flags)
        assert said in capsys.readouterr().err


# ----------------------------------------------------------------------------
# The early branches

LO, HI = math.log10(1 / 2048), math.log10(1 / 16)  # the reach window's edges in log10 Q


def _branch_rows(curves: list, steps: int = 25, n: int = 16) -> list:
    """An early branch run's rows: a training row a step (64 n rollouts), and at every 5th step
    (and step 0, the branch) an eval of each prompt's log10 Q, curves[i][step // 5]."""
    rows = []
    for step in range(steps + 1):
        row = dict(step=step)
        if step:
            row.update(samples=64 * n, time_train_cpu=0.5 * step)
        if step % 5 == 0:
            qs = [c[step // 5] for c in curves]
            row.update(answers_log10_q_per_prompt=qs, answers_q=sum(10 ** q for q in qs) / len(qs))
        rows.append(row)
    rows[0]["time_train_cpu"] = 0.0
    return rows


# Nine prompts, log10 Q at steps 0, 5, ..., 25: four in the window at the branch (0, 1, 2, 5).
CURVES = [[-1.5, -1.3, -1.1, -1.0, -0.9, -0.9],  # caught at step 10
          [-2.0, -2.0, -1.9, -1.6, -1.3, -1.0],  # caught at step 25, the last eval
          [-3.0, -3.1, -3.2, -3.3, -3.4, -3.5],  # never: ends below 1/2048, a window loss
          [-4.0, -4.0, -4.1, -4.1, -4.2, -4.2],  # below at the branch and at the end: neither
          [0.0] * 6,  # high throughout
          [-3.2, HI, -1.5, -1.5, -1.5, -1.5],  # exactly 1/16 at step 5: caught there, then fell
          [-3.5, -3.4, -3.3, -3.3, -3.3, LO],  # below, exactly 1/2048 at the end: a lift
          [-0.5, -1.0, -2.0, -3.0, -3.5, -4.0],  # high at the branch, ends below: a loss
          [-3.6, -3.0, -2.0, -1.0, -0.5, HI]]  # below, exactly 1/16 at the end: a lift, revived


def test_catches_and_losses_by_hand():
    """The window at the branch, each window prompt's first eval at or above 1/16 (1/16 itself
    counts), the rollouts spent by then (64 x 16 a step), the losses (at or above 1/2048 at the
    branch, below at the end) and those of them in the window at the branch, the lifts (below
    at the branch, at or above at the end, 1/2048 itself counting) and of them the revivals (at or
    above 1/16 at the end, 1/16 itself counting); a prompt below at both ends is neither."""
    c = study.catches(_branch_rows(CURVES))
    assert c["window"] == [0, 1, 2, 5]
    assert c["first"] == {0: 10, 1: 25, 2: None, 5: 5}
    assert c["caught"] == 3 and c["steps_to_catch"] == [5, 10, 25]
    assert c["rollouts_to_catch"] == [5 * 1024, 10 * 1024, 25 * 1024]
    assert c["losses"] == 2 and c["window_losses"] == 1 and c["lifts"] == 2
    assert c["revivals"] == 1
    assert c["rollouts"] == 25 * 1024 and c["steps"] == 25 and c["cpu_s"] == 12.5
    # 1/2048 itself is in the window: a prompt leaving it from there is a loss, one ending there
    # is not, and one starting there is not lifted.
    edges = [[LO, -3.4, -3.5, -3.6, -3.8, -4.0], [-2.5, -2.8, -3.0, -3.1, -3.2, LO],
             [LO, -3.0, -2.8, -2.5, -2.2, -2.0]]
    c = study.catches(_branch_rows(edges))
    assert c["window"] == [0, 1, 2] and c["caught"] == 0
    assert (c["losses"], c["window_losses"], c["lifts"], c["revivals"]) == (1, 1, 0, 0)


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _early_raw(raw, trunk_rows, early_rows):
    """A made-up study's raw files: the committed trunk and its plateau, the early trunk, and
    from its step 20 three seeds of prorl (catching fewer) and n512."""
    _write(raw / "trunk" / "metrics.jsonl", trunk_rows)
    _write(raw / "trunk" / "chunks.jsonl", [dict(steps_to=450, cpu_s=9.0)])
    zones = dict(high=1, window=4, below=1)
    (raw / "trunk" / "plateau.json").write_text(json.dumps(dict(
        step=450, slope_per_100=0.0, ci_low=-0.001, ci_high=0.001, evals=10, window=100,
        answers_q=0.5, answers_q_start=0.5, zones_start=zones, zones_branch=zones, go=True,
        stuck=[])))
    _write(raw / "early" / "trunk" / "metrics.jsonl", early_rows)
    _write(raw / "early" / "trunk" / "chunks.jsonl", [dict(steps_to=20, cpu_s=30.0)])
    slow = [c[:1] + [max(q - 0.6, -9) if q < 0 else q for q in c[1:]] for c in CURVES]
    for seed in range(3):
        # prorl seed s: the slow curves (prompt 0 alone caught, at step 25 for seed 0)
        prorl = [c if i != 0 or seed else c[:5] + [-1.2] for i, c in enumerate(slow)]
        _write(raw / "early" / "step20" / "prorl" / f"seed{seed}.jsonl", _branch_rows(prorl))
        _write(raw / "early" / "step20" / "n512" / f"seed{seed}.jsonl",
               _branch_rows(CURVES, n=512))


def test_early_report_from_made_up_raw_files(tmp_path):
    """The early report by hand: the window at step 20, the catches per seed, their median steps,
    the losses, the paired test against prorl (scipy's), and whether the rerun trunk's rows are
    the committed trunk's, clock fields aside."""
    branch = [c[0] for c in CURVES]
    trunk = [dict(step=s, answers_q=0.5, answers_log10_q_per_prompt=branch, time_train_cpu=s)
             for s in range(0, 40, 10)]
    raw = tmp_path / "raw"
    early = [{**r, "time_train_cpu": 2 * r["step"]} for r in trunk[:3]]
    _early_raw(raw, trunk, early)
    text = study.early_report(raw)
    assert "identical to step 20, clock fields aside" in text, text
    assert "- in the reach window (4): 0 (-1.50), 1 (-2.00), 2 (-3.00), 5 (-3.20)" in text
    # prorl: seed 0 catches prompt 0 at step 25 (-1.2 >= log10 1/16); seeds 1, 2 catch none
    # (-0.9 - 0.6 = -1.5 < -1.204); n512 catches 3 a seed, at steps 5, 10, 25 (median 10).
    assert "| caught by the run's end, per seed | 1 0 0 | 3 3 3 |" in text, text
    assert "steps; caught ones, seeds pooled) | 25 | 10 |" in text, text
    assert "| median rollouts to a catch (caught ones, seeds pooled) | 25600 | 327680 |" in text
    assert "| losses that were in the window at the branch, per seed | 1 1 1 | 1 1 1 |" in text
    assert "below it at the end, per seed | 2 2 2 | 2 2 2 |" in text, text  # prompts 2 and 7
    # prorl's slow prompt 8 ends at log10 1/16 - 0.6: a lift, not a revival
    assert "at or above it at the end, per seed | 1 1 1 | 2 2 2 |" in text, text  # prompts 6, 8
    assert "ended at or above 1/16, per seed | 0 0 0 | 1 1 1 |" in text, text  # prompt 8
    t = scipy_stats.ttest_1samp([2, 3, 3], 0.0)
    assert f"| n512 | caught | 3 | +2.667 | {t.pvalue:.3g} | 0.25 |" in text, text
    # One field of one row changed in the rerun: named, and the rerun's rows used.
    early[2]["answers_q"] = 0.51
    _early_raw(raw, trunk, early)
    assert "they differ, first at step 20 in answers_q (mean exact Q at step 20: 0.5100 here, " \
        "0.5000 there)" in study.early_report(raw)
    study.main(["--report", "--raw", str(raw)])
    assert (raw / "early" / "report.md").read_text() == study.early_report(raw) and \
        (raw / "report.md").is_file()


@pytest.mark.parametrize("flags, said", [(["--branch_steps", "30"], "--branch_steps 30: need a"),
                                         (["--branch_steps", "460"], "--branch_steps 460: need"),
                                         (["--branch_steps", "20", "20"], "20 twice"),
                                         (["--prompts", "32"], "--prompts 32: the early")])
def test_early_flags_are_checked_before_any_run(tmp_path, flags, said, capsys):
    """A branch step off the early trunk's chunks (a multiple of 20) or past the plateau (450 in
    the made-up record), one given twice, another trunk's prompts: one line, exit 2, nothing
    made."""
    raw = tmp_path / "raw"
    _early_raw(raw, [dict(step=0)], [dict(step=0)])
    with pytest.raises(SystemExit) as e:
        study.main(["--only", "early", *flags, "--out", str(tmp_path / "out"), "--raw", str(raw)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, said", [
    (["--prompts", "300"], "--prompts 300: the sets task holds 256 prompts"),
    (["--only", "arms"], "no plateau yet"),
])
def test_what_the_driver_can_know_is_one_line_before_out_or_the_lock(tmp_path, flags, said,
                                                                     capsys, monkeypatch):
    """--prompts past the sets task's 256 (once refused by each spawned trunk run, its reason in
    a log alone) and --only arms with no plateau yet (once refused after --out and its lock were
    made): one line, exit 2, nothing made, no run started."""
    from tools import study as skeleton
    monkeypatch.setattr(skeleton.ChunkedRun, "advance", lambda *a: pytest.fail("a run started"))
    monkeypatch.setattr(skeleton, "run_jobs", lambda *a: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as e:
        study.main([*flags, "--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "raw").exists()


def test_a_report_over_a_missing_or_empty_raw_is_one_line(tmp_path, capsys):
    """--report over a --raw that is not there, or empty: one line, nothing written."""
    (tmp_path / "empty").mkdir()
    for raw in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(SystemExit) as e:
            study.main(["--report", "--raw", str(raw)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "nothing to report" in err, err
    assert not (tmp_path / "missing").exists() and not any((tmp_path / "empty").iterdir())
