"""bench.py runs: every part (the sampler against generate, varied lengths, a full rl_step in its own
process, and the GPU part's driver with its breadth sweep) at toy sizes, on whatever device is here."""

import torch

from tools import bench


def test_every_bench_part_runs_at_a_tiny_size(capsys):
    # --part gpu drives all four parts (on a CPU without CUDA); --threads keeps this process's setting
    bench.main(["--part", "gpu", "--tiny", "--repeats", "1", "--steps", "1",
                "--threads", str(torch.get_num_threads())])
    out = capsys.readouterr().out
    for header in ("== sampler:", "== varied lengths:", "== step:", "== breadth:"):
        assert header in out, out[-2000:]
    step_row = next(ln for ln in out.splitlines() if ln.startswith("brorl     4 |"))
    completions_s, step_s = (float(x) for x in step_row.split("|")[1].split()[:2])
    assert step_s > 0 and completions_s >= 0  # a step ran (completions/s is printed rounded: 0 on a slow CPU)
