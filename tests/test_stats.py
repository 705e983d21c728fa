"""The studies' statistics (tools/stats.py, on scipy.stats) against references computed here by
other means: printed tables, closed forms, a Simpson integral of the t density, enumerations."""

import itertools
import math
import random
import statistics

import pytest
import scipy.stats

from tools import stats


def t_density_tail(t: float, df: float, steps: int = 20_000) -> float:
    """Two-sided p by Simpson's rule on Student's t density over [0, |t|] (an independent
    reference)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    f = lambda x: c * (1 + x * x / df) ** (-(df + 1) / 2)
    h = abs(t) / steps
    area = h / 3 * sum(f(i * h) * (1 if i in (0, steps) else 4 if i % 2 else 2)
                       for i in range(steps + 1))
    return 1 - 2 * area


@pytest.mark.parametrize("t, df", [(2.0, 10), (0.3, 1), (1.5, 3), (4.2, 7), (0.05, 40),
                                   (2.6, 127), (1.7, 2.5)])
def test_t_p_against_the_density(t, df):
    assert math.isclose(stats.t_p(t, df), t_density_tail(t, df), rel_tol=1e-7, abs_tol=1e-10)
    if df == 1:  # Cauchy: closed form
        assert math.isclose(stats.t_p(t, df), 1 - 2 / math.pi * math.atan(t), rel_tol=1e-12)


def test_t_quantile_against_tables():
    """Student's 97.5% quantiles from printed tables: df 2, 9, 30 and a large df (the normal's)."""
    for df, q in ((2, 4.302653), (9, 2.262157), (30, 2.042272), (10 ** 6, 1.959966)):
        assert abs(stats.t_quantile(df) - q) < 1e-5, (df, stats.t_quantile(df))
    assert math.isclose(stats.t_p(stats.t_quantile(7), 7), 0.05, rel_tol=1e-9)


def test_paired_t_test_of_known_differences():
    """mean 0.17, sd 0.2387 over 5: t = 1.5925 with 4 df; no spread: no test, not p = 0."""
    diffs = [0.1, 0.3, -0.2, 0.4, 0.25]
    r = stats.t_test(diffs)
    sd = statistics.stdev(diffs)
    assert r["n"] == 5 and math.isclose(r["t"], 0.17 / (sd / math.sqrt(5)))
    assert math.isclose(r["p"], t_density_tail(r["t"], 4), rel_tol=1e-7)
    assert math.isnan(stats.t_test([0.2, 0.2, 0.2])["p"])


def test_sign_test_exact_values():
    assert stats.sign_test([1.0] * 5) == pytest.approx(2 / 32)  # five of five: never below 0.05
    assert stats.sign_test([1.0, 1, 1, 1, -1]) == pytest.approx(2 * 6 / 32)
    assert stats.sign_test([1.0, -1.0, 0.0]) == 1.0  # the tie dropped
    assert math.isnan(stats.sign_test([0.0, 0.0]))
    n, k = 12, 2  # against the binomial sum written out
    assert stats.sign_test([1.0] * (n - k) + [-1.0] * k) == pytest.approx(2 * (1 + 12 + 66) / 4096)


def test_welch_against_known_values():
    """Equal sizes and variances: Welch's t is Student's; its two-sided p at the 5% critical values
    (df 8: 2.306; df 4: 2.776) is 0.05."""
    for df, crit in ((8, 2.306), (4, 2.776)):
        n = df // 2 + 1  # two samples of n: df = 2n - 2
        xs = [float(i) for i in range(n)]
        sd = math.sqrt(sum((x - sum(xs) / n) ** 2 for x in xs) / (n - 1))
        shift = crit * sd * math.sqrt(2 / n)
        t, p = stats.welch([x + shift for x in xs], xs)
        assert abs(t - crit) < 1e-9 and abs(p - 0.05) < 2e-3, (df, t, p)
    assert all(math.isnan(x) for x in stats.welch([1.0, 1.0], [2.0, 2.0]))  # no spread


def test_welch_at_one_and_two_degrees_of_freedom():
    """Two seeds an arm: Welch's df falls to 1 (one arm without spread) or 2, where the two-sided p
    has a closed form: 1 - 2 atan(|t|) / pi (Cauchy), 1 - |t| / sqrt(2 + t^2)."""
    t, p = stats.welch([0.0, 2.0], [10.0, 10.0])  # df = 1: t = -9
    assert t == pytest.approx(-9) and abs(p - (1 - 2 * math.atan(9) / math.pi)) < 1e-9, p
    t, p = stats.welch([0.0, 2.0], [5.0, 7.0])  # df = 2: t = -5 / sqrt(2)
    assert abs(p - (1 - abs(t) / math.sqrt(2 + t * t))) < 1e-9, (t, p)


def test_welch_interval_by_hand():
    """The interval is d +- t(0.975, Welch-Satterthwaite df) sqrt(va / n + vb / m); without spread
    it is the point."""
    rng = random.Random(0)
    a, b = [rng.gauss(1, 1) for _ in range(5)], [rng.gauss(0, 2) for _ in range(4)]
    va, vb = statistics.variance(a) / 5, statistics.variance(b) / 4
    df = (va + vb) ** 2 / (va ** 2 / 4 + vb ** 2 / 3)
    d = statistics.fmean(a) - statistics.fmean(b)
    half = stats.t_quantile(df) * math.sqrt(va + vb)
    assert stats.welch_interval(a, b) == pytest.approx((d, d - half, d + half), rel=1e-10)
    assert stats.welch_interval([1.0, 1.0], [0.0, 0.0]) == (1.0, 1.0, 1.0)


def mann_whitney_by_enumeration(a: list, b: list) -> float:
    """The share of the relabellings whose U is as far from its mean as the observed (ties a
    half), enumerated here."""
    pooled, centre = a + b, len(a) * len(b) / 2
    u = lambda xs, ys: sum((x > y) + 0.5 * (x == y) for x in xs for y in ys)
    seen = abs(u(a, b) - centre)
    splits = list(itertools.combinations(range(len(pooled)), len(a)))
    hits = sum(abs(u([pooled[i] for i in idx], [pooled[i] for i in range(len(pooled))
                                                 if i not in idx]) - centre) >= seen - 1e-12
               for idx in splits)
    return hits / len(splits)


def test_mann_whitney_exact():
    """Three against three, fully separated: 2 of the C(6, 3) = 20 relabellings are as extreme;
    U = 3 against its mean 4.5: 14 of 20; all ties: 1. With ties (counts, as the studies' are),
    the enumeration's p, which scipy's no-ties exact distribution would not give."""
    assert stats.mann_whitney([4, 5, 6], [1, 2, 3]) == pytest.approx(2 / 20)
    assert stats.mann_whitney([1, 3, 5], [2, 4, 6]) == pytest.approx(14 / 20)
    assert stats.mann_whitney([1.0] * 3, [1.0] * 3) == 1.0
    rng = random.Random(1)
    for n, m in ((5, 5), (4, 5), (2, 5), (5, 3)):
        pooled = [rng.choice([0, 1, 2, 3]) for _ in range(n + m)]
        a, b = pooled[:n], pooled[n:]
        assert stats.mann_whitney(a, b) == pytest.approx(mann_whitney_by_enumeration(a, b)), (a, b)


def test_slope_and_its_interval_by_hand():
    """y = 1, 2, 2, 4 at x = 0..3: slope 0.9, residuals 0.1, 0.2, -0.7, 0.4 (sum of squares 0.7),
    s.e. sqrt(0.7 / 2 / 5), interval +- t(2) s.e.; two points have no interval."""
    b, lo, hi = stats.slope([0, 1, 2, 3], [1, 2, 2, 4])
    se = math.sqrt(0.7 / 2 / 5)
    assert abs(b - 0.9) < 1e-12
    assert abs(hi - b - 4.302653 * se) < 1e-5 and abs(b - lo - 4.302653 * se) < 1e-5
    assert stats.slope([0, 10, 20], [0.5] * 3) == (0.0, 0.0, 0.0)  # flat: an exact fit
    with pytest.raises(ValueError):
        stats.slope([0, 1], [1, 2])


def test_pearson():
    assert stats.pearson([1, 2, 3, 4], [2, 4, 6, 8.5]) == pytest.approx(
        statistics.correlation([1, 2, 3, 4], [2, 4, 6, 8.5]))
    assert math.isnan(stats.pearson([1, 2], [3, 4]))
    assert math.isnan(stats.pearson([1] * 3, [1, 2, 3]))


def test_paired_is_the_paired_t_the_sign_test_and_welch():
    a, b = [0.40, 0.45, 0.55, 0.50], [0.30, 0.45, 0.35, 0.52]
    c = stats.paired(a, b)
    assert c["n"] == 4 and c["mean"] == pytest.approx(0.07)
    assert c["p"] == pytest.approx(scipy.stats.ttest_rel(a, b).pvalue, rel=1e-12)
    # Differences +0.10, 0, +0.20, -0.02: 2 up, 1 down, the tie dropped.
    assert c["sign_p"] == pytest.approx(scipy.stats.binomtest(2, 3).pvalue, rel=1e-12)
    ci = scipy.stats.ttest_ind(a, b, equal_var=False).confidence_interval()
    assert (c["d"], c["lo"], c["hi"]) == pytest.approx((0.07, ci.low, ci.high), rel=1e-12)
