"""The Theorem 1 study's measures (tools/theorem1_study.py), by hand; its statistics:
tests/test_stats.py."""

from tools import theorem1_study as study


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
