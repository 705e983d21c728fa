"""
stats.py: the studies' statistics, each from scipy.stats (none re-derived here): Welch's t for a
difference of means and its interval, the exact Mann-Whitney test, the paired t test, its interval
and its power, the exact sign test, Student's t quantiles and two-sided p-values, and an ordinary
least squares slope with its interval. Runs of two arms share no random draws, so arms are
compared unpaired (Welch, Mann-Whitney); configs of a sweep run on the same seeds are compared
paired (t, sign).
"""

import math
import statistics

import numpy as np
from scipy import stats


def welch(a: list, b: list) -> tuple:
    """Welch's t of mean(a) - mean(b) and its two-sided p (Welch-Satterthwaite's df); (nan, nan)
    when neither sample varies."""
    if statistics.variance(a) + statistics.variance(b) == 0:
        return float("nan"), float("nan")
    r = stats.ttest_ind(a, b, equal_var=False)
    return float(r.statistic), float(r.pvalue)


def welch_interval(a: list, b: list, level: float = 0.95) -> tuple:
    """The difference of means a - b and its Welch interval at `level`: (d, low, high); the
    interval is the point when neither sample varies."""
    d = statistics.fmean(a) - statistics.fmean(b)
    if statistics.variance(a) + statistics.variance(b) == 0:
        return d, d, d
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(level)
    return d, float(ci.low), float(ci.high)


def mann_whitney(a: list, b: list) -> float:
    """The exact two-sided Mann-Whitney p: the share of the C(n, k) relabellings of the pooled
    values whose U lies at least as far from its mean n k / 2 as the observed U (a tie counts a
    half in U). scipy's mannwhitneyu(method="exact") assumes no ties, which the studies' counts
    have: the permutation distribution of U is enumerated whole (scipy.stats.permutation_test)."""
    centre = len(a) * len(b) / 2

    def distance(x, y, axis=-1):
        # x (..., n), y (..., k): U counts the pairs where x wins, ties a half; (...,)
        x, y = np.moveaxis(x, axis, -1), np.moveaxis(y, axis, -1)
        wins = x[..., :, None] > y[..., None, :]  # (..., n, k)
        ties = x[..., :, None] == y[..., None, :]  # (..., n, k)
        return np.abs((wins + 0.5 * ties).sum(axis=(-1, -2)) - centre)

    return float(stats.permutation_test((a, b), distance, permutation_type="independent",
                                        alternative="greater", n_resamples=np.inf,
                                        vectorized=True).pvalue)


def t_test(diffs: list) -> dict:
    """Paired t test of mean(diffs) = 0: n, mean, t and the two-sided p (n - 1 df); t and p are nan
    without spread (identical runs, or one pair)."""
    n, mean = len(diffs), statistics.fmean(diffs)
    if n < 2 or statistics.stdev(diffs) == 0:
        return dict(n=n, mean=mean, t=float("nan"), p=float("nan"))
    r = stats.ttest_1samp(diffs, 0.0)
    return dict(n=n, mean=mean, t=float(r.statistic), p=float(r.pvalue))


def paired_interval(diffs: list, level: float = 0.95) -> tuple:
    """The mean of paired differences and its interval at `level` (Student's t, n - 1 df): (mean,
    low, high); the point when the differences do not vary."""
    mean = statistics.fmean(diffs)
    if len(diffs) < 2 or statistics.stdev(diffs) == 0:
        return mean, mean, mean
    ci = stats.ttest_1samp(diffs, 0.0).confidence_interval(level)
    return mean, float(ci.low), float(ci.high)


def paired_power(n: int, effect: float, sd: float, alpha: float = 0.05) -> float:
    """The power of the two-sided paired t test at n pairs to find a mean difference `effect`
    whose differences spread with standard deviation sd (the noncentral t, n - 1 df)."""
    if n < 2 or sd <= 0:
        return float("nan")
    df, nc = n - 1, effect / (sd / math.sqrt(n))
    crit = stats.t.ppf(1 - alpha / 2, df)
    return float(stats.nct.sf(crit, df, nc) + stats.nct.cdf(-crit, df, nc))


def sign_test(diffs: list) -> float:
    """Two-sided exact sign test of median(diffs) = 0, ties dropped (binomial, 1/2); nan if every
    difference is 0. With 5 pairs its smallest p is 0.0625: five seeds can show a direction, never
    p < 0.05 alone."""
    pos, neg = sum(d > 0 for d in diffs), sum(d < 0 for d in diffs)
    return float(stats.binomtest(pos, pos + neg).pvalue) if pos + neg else float("nan")


def paired(a: list, b: list) -> dict:
    """a against b, paired by position: the paired t test of the differences (n, mean, t, p), the
    sign test's p (sign_p), and Welch's difference of means with its 95% interval (d, lo, hi)."""
    diffs = [x - y for x, y in zip(a, b)]
    d, lo, hi = welch_interval(a, b)
    return dict(**t_test(diffs), sign_p=sign_test(diffs), d=d, lo=lo, hi=hi)


def t_quantile(df: float, p: float = 0.975) -> float:
    """Student's t quantile with df degrees of freedom."""
    return float(stats.t.ppf(p, df))


def t_p(t: float, df: float) -> float:
    """The two-sided p of Student's t with df degrees of freedom."""
    return float(2 * stats.t.sf(abs(t), df))


def slope(xs: list, ys: list, level: float = 0.95) -> tuple:
    """The ordinary least squares slope of ys on xs and its interval at `level` (Student's t,
    n - 2 df): (slope, low, high). Needs 3 points or more."""
    if len(xs) < 3:
        raise ValueError(f"a slope's interval needs 3 points or more, got {len(xs)}")
    r = stats.linregress(xs, ys)
    # ys that do not vary fit exactly: linregress's stderr is then nan (r undefined), the fit's 0
    se = 0.0 if statistics.pstdev(ys) == 0 else r.stderr
    half = t_quantile(len(xs) - 2, (1 + level) / 2) * se
    return float(r.slope), float(r.slope - half), float(r.slope + half)


def pearson(x: list, y: list) -> float:
    """Pearson's r; nan with fewer than 3 points or no spread."""
    if len(x) < 3 or statistics.pstdev(x) == 0 or statistics.pstdev(y) == 0:
        return float("nan")
    return float(stats.pearsonr(x, y).statistic)


def mean_sd(xs: list) -> tuple:
    """The mean and the sample standard deviation (0 for one value)."""
    return statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
