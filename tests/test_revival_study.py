"""The revival study (tools/revival_study.py): its plateau rule, its measures and its report, by
hand on made-up raw files; and --train_prompts, the flag its testbed is built on."""

import json
import math
import random

import pytest

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
