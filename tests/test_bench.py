"""bench.py runs: every part (the sampler against generate, varied lengths, a full rl_step in its
own process, and the GPU part's driver with its breadth sweep) at toy sizes, on whatever device is
here."""

import contextlib
import io
import re

import pytest
import torch

from tools import bench


@pytest.fixture(scope="module")
def tiny_output():
    """What every part prints at a tiny size, run once for the tests below."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # --part gpu drives all four parts (on a CPU without CUDA); --threads keeps this process's
        # setting
        bench.main(["--part", "gpu", "--tiny", "--repeats", "1", "--steps", "1",
                    "--threads", str(torch.get_num_threads())])
    return out.getvalue()


@pytest.mark.slow
def test_every_bench_part_runs_at_a_tiny_size(tiny_output):
    out = tiny_output
    for header in ("== sampler:", "== varied lengths:", "== step:", "== breadth:"):
        assert header in out, out[-2000:]
    step_row = next(ln for ln in out.splitlines() if ln.startswith("brorl     4 |"))
    completions_s, step_s = (float(x) for x in step_row.split("|")[1].split()[:2])
    # A step ran (completions/s is printed rounded: 0 on a slow CPU).
    assert step_s > 0 and completions_s >= 0


@pytest.mark.slow
def test_every_speed_is_shown_against_the_matmul_floor_of_the_same_run(tiny_output):
    lines = tiny_output.splitlines()
    floor = next(ln for ln in lines if ln.startswith("matmul floor:"))
    again = next(ln for ln in lines if ln.startswith("matmul floor at the end:"))
    assert float(floor.split()[2]) > 0 and float(again.split()[5]) > 0, (floor, again)  # GFLOP/s
    # A share of the floor is a ratio of two rates measured in this run: no timing bound, only
    # that it is printed and positive. Each row's percentages: the sampler's (brorl, generate),
    # the step's (step, rollout, update), varied lengths' (brorl, generate), breadth's (one a row).
    rows = {"sampler": next(ln for ln in lines if ln.startswith("    8      4    4 |")),
            "step": next(ln for ln in lines if ln.startswith("brorl     4 |")),
            "varlen": next(ln for ln in lines if ln.startswith("brorl ") and "floor:" in ln),
            **{f"breadth {i}": ln for i, ln in enumerate(x for x in lines if x.startswith("N="))}}
    shares = {k: [float(x) for x in re.findall(r"(\d[\d.e+-]*)%", ln)] for k, ln in rows.items()}
    counts = {"sampler": 2, "step": 3, "varlen": 2, "breadth 0": 1, "breadth 1": 1}
    assert {k: len(v) for k, v in shares.items()} == counts, tiny_output[-2000:]
    assert all(x > 0 for v in shares.values() for x in v), shares
