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


# ----------------------------------------------------------------------------
# --dtype bfloat16: each side in bf16 as its users run it, against the floor of bf16


def spy_floor(monkeypatch) -> list:
    """The dtypes every matmul floor of the run was measured in."""
    dtypes, floor = [], bench.matmul_floor
    monkeypatch.setattr(bench, "matmul_floor", lambda device, dtype, *a, **k:
                        dtypes.append(dtype) or floor(device, dtype, *a, **k))
    return dtypes


def test_the_floor_is_measured_in_the_dtype_the_parts_run_in(monkeypatch):
    floors = spy_floor(monkeypatch)
    given = []  # (dtype, amp) that the sampler part was handed
    monkeypatch.setattr(bench, "bench_sampler", lambda path, device, dtype, *a:
                        given.append((dtype, a[-1])))
    for argv, dtype in (([], torch.float32), (["--dtype", "float32"], torch.float32),
                        (["--dtype", "bfloat16"], torch.bfloat16)):
        floors.clear()
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            bench.main(["--part", "sampler", "--tiny", "--threads", str(torch.get_num_threads()),
                        *argv])
        assert floors == [dtype, dtype], (argv, floors)  # the start's floor and the end's
        line = next(ln for ln in out.getvalue().splitlines() if ln.startswith("matmul floor:"))
        assert str(dtype) in line, line  # the printed floor says its dtype
    # brorl's side under bf16 autocast only where bfloat16 was asked for; fp32 otherwise
    assert given == [(torch.float32, None)] * 2 + [(torch.bfloat16, torch.bfloat16)]


@pytest.mark.parametrize("argv, says", [
    (["--part", "lora", "--dtype", "bfloat16"], "--dtype bfloat16: only with --part"),
    (["--part", "gpu", "--tiny", "--dtype", "float32"], "--dtype float32: only with --part"),
    (["--part", "step", "--tiny", "--trl_ns", "4"], "--trl_ns 4: only with --trl"),
    (["--part", "step", "--step_ns", "64"], "--step_ns: only with --model"),
    (["--part", "step", "--tiny", "--trl", "x", "--trl_ns", "64"], "--trl_ns 64: each must be"),
    (["--part", "step", "--trl", "x", "--trl_ns", "a"], "--trl_ns a: need positive integers"),
    # a real model's N values are checked before it loads (no such model is ever looked for)
    (["--model", "no/such-model", "--ns", "4", "--step_ns", "8"],
     "--step_ns 8: each must be one of --ns (4)"),
    (["--model", "no/such-model", "--trl", "x", "--trl_ns", "128"],
     "--trl_ns 128: each must be an N of the step (64,512)")])
def test_dtype_and_trl_ns_are_refused_with_one_line(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and says in err, err


@pytest.mark.slow
def test_every_cpu_part_runs_in_bf16_each_side_as_its_users_run_it(monkeypatch, tmp_path):
    """--tiny --dtype bfloat16: brorl's sampler under bf16 autocast with fp32 weights (as brorl.py
    --dtype bfloat16), generate with bf16 weights, both trainers' processes given the dtype (TRL's
    here a stand-in that records its arguments), every floor in bf16."""
    floors = spy_floor(monkeypatch)
    ours, theirs = [], []  # (autocast on, its dtype, the weights' dtype) a call; generate's weights
    chunk, generate = bench.sampler.generate_group_chunk, bench.run_generate
    monkeypatch.setattr(bench.sampler, "generate_group_chunk", lambda model, *a: ours.append(
        (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), model.dtype))
                        or chunk(model, *a))
    monkeypatch.setattr(bench, "run_generate", lambda model, *a, **k: theirs.append(model.dtype)
                        or generate(model, *a, **k))
    trl, given = tmp_path / "python", tmp_path / "trl_args"
    trl.write_text(f'#!/usr/bin/env bash\necho "$*" >> {given}\necho \'RESULT {{"n": 4, '
                   '"step_s": 1.0, "completions_s": 8.0, "peak_rss_mb": 100.0}\'\n')
    trl.chmod(0o755)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.main(["--part", "all", "--tiny", "--dtype", "bfloat16", "--repeats", "1", "--steps",
                    "1", "--threads", str(torch.get_num_threads()), "--trl", str(trl)])
    out = out.getvalue()
    assert floors == [torch.bfloat16] * 2, floors
    assert ours and set(ours) == {(True, torch.bfloat16, torch.float32)}, ours
    assert theirs and set(theirs) == {torch.bfloat16}, theirs
    # each part's header says how each side computed; the step's children were told the dtype
    for header in ("== sampler:", "== varied lengths:", "== step:"):
        line = next(ln for ln in out.splitlines() if ln.startswith(header))
        assert "bfloat16" in line, line
    assert "--dtype bfloat16" in given.read_text(), given.read_text()
    step_row = next(ln for ln in out.splitlines() if ln.startswith("brorl     4 |"))
    assert float(step_row.split("|")[1].split()[1]) > 0, step_row  # brorl's step ran, in bf16
    assert "brorl / TRL completions/s at N=4:" in out


def test_the_step_child_computes_in_the_dtype_it_is_given(tmp_path):
    """The Config a step child times: --dtype bfloat16 as brorl.py's (rl_step's autocast reads
    it); none given, auto (fp32 on a CPU, as before the flag)."""
    bench.write_prompts(tmp_path / "prompts.json", [{"prompt": "1+2=", "answer": "3"}] * 2)
    bench.load_tokenizer().save_pretrained(tmp_path)
    from lib.policy import compute_dtype
    cpu = torch.device("cpu")
    for dtype, want in (("bfloat16", torch.bfloat16), ("auto", torch.float32)):
        cfg = bench.step_setup(tmp_path, 4, 4, 8, dtype=dtype)[2]
        assert (cfg.dtype, compute_dtype(cfg, cpu)) == (dtype, want)
