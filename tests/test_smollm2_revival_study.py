"""The SmolLM2 revival study's rules (tools/smollm2_revival_study.py): the plateau, fixed before its
trunk ran, and the census's go/no-go, fixed before the census ran. Fast: no model."""

import pytest

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
