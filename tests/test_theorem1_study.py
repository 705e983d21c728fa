"""The Theorem 1 study's statistics and measures (tools/theorem1_study.py), by hand."""

import math

from tools import theorem1_study as study


def test_mann_whitney_exact():
    """Three against three, fully separated: 2 of the C(6, 3) = 20 relabellings are as extreme."""
    assert study.mann_whitney([4, 5, 6], [1, 2, 3]) == 2 / 20
    # U = 3 against its mean 4.5: U <= 3 or U >= 6 in 7 + 7 of the 20 (U's counts 1 1 2 3 3 3 3 2 1 1)
    assert study.mann_whitney([1, 3, 5], [2, 4, 6]) == 14 / 20
    assert study.mann_whitney([1.0] * 3, [1.0] * 3) == 1.0  # all ties


def test_welch_against_known_values():
    """Equal sizes and variances: Welch's t is Student's; its two-sided p at the 5% critical values
    (df 8: 2.306; df 4: 2.776) is 0.05."""
    for df, crit in ((8, 2.306), (4, 2.776)):
        n = df // 2 + 1  # two samples of n: df = 2n - 2
        xs = [float(i) for i in range(n)]
        sd = math.sqrt(sum((x - sum(xs) / n) ** 2 for x in xs) / (n - 1))
        shift = crit * sd * math.sqrt(2 / n)
        t, p = study.welch([x + shift for x in xs], xs)
        assert abs(t - crit) < 1e-9 and abs(p - 0.05) < 2e-3, (df, t, p)


def test_welch_at_one_and_two_degrees_of_freedom():
    """Two seeds an arm: Welch's df falls to 1 (one arm without spread) or 2, where the t
    distribution's tails are heavy (at df 1, P(|T| > 200) is 0.003) and its two-sided p has a
    closed form: 1 - 2 atan(|t|) / pi (Cauchy), 1 - |t| / sqrt(2 + t^2)."""
    t, p = study.welch([0.0, 2.0], [10.0, 10.0])  # df = 1: t = -9
    assert t == -9 and abs(p - (1 - 2 * math.atan(9) / math.pi)) < 1e-6, p
    t, p = study.welch([0.0, 2.0], [5.0, 7.0])  # df = 2: t = -5 / sqrt(2)
    assert abs(p - (1 - abs(t) / math.sqrt(2 + t * t))) < 1e-6, (t, p)


def test_reach_separates_below_the_gate_from_never_sampled_right():
    """Four prompts: two below the gate at the start, of which one was sampled right; one in the gate
    never sampled right that sank below it. At N = 2 the steps draw 2 and 1 of the 4 prompts, so
    4 (1 - 2/4) (1 - 1/4) = 1.5 prompts are expected never drawn."""
    rows = [dict(step=0, mass_exact_prompts=["a", "b", "c", "d"], mass_exact_mean=0.1,
                 mass_exact_log10=[-4.0, -3.0, -2.0, -0.5]),
            dict(step=1, sampled_right=["a", "d"], samples=4),
            dict(step=2, sampled_right=["d"], samples=2, mass_exact_mean=0.1,
                 mass_exact_log10=[-1.0, -4.5, -3.0, -0.4])]
    m = study.reach(rows, n=2)
    assert m["never_drawn"] == 1.5
    assert (m["below"], m["below_fell"], m["below_fell_decade"]) == (2, 1, 1)
    assert m["below_dlog10_median"] == (3.0 - 1.5) / 2
    assert (m["never"], m["never_fell"], m["never_dlog10_median"]) == (2, 2, -1.25)
    assert (m["below_never"], m["below_never_dlog10_median"]) == (1, -1.5)
    assert (m["gate"], m["gate_sank"]) == (1, 1)
