"""tools/census.py: the interval, pass@k and zones against references, and a census killed part way
that continues to the uninterrupted one's records."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import census

HERE = Path(__file__).resolve().parent.parent
TINY = ["--eval_prompts", "3", "--max_new_tokens", "8"]


def run(out, *extra, samples=8, check=True, first=None):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "tools.census", "--out", str(out), "--samples",
                        str(samples), *(["--first", str(first)] if first else []), "--",
                        *TINY, *extra], cwd=HERE, env=env,
                       capture_output=True, text=True)
    assert not check or p.returncode == 0, p.stderr[-2000:]
    return p


def test_clopper_pearson_matches_its_closed_forms():
    # With no right answer the upper bound solves (1 - p)^n = 0.025; with all right, p^n = 0.025.
    for n in (1, 16, 512):
        lo, hi = census.clopper_pearson(0, n)
        assert lo == 0 and hi == pytest.approx(1 - 0.025 ** (1 / n), rel=1e-9)
        lo, hi = census.clopper_pearson(n, n)
        assert hi == 1 and lo == pytest.approx(0.025 ** (1 / n), rel=1e-9)
    # In between, the bounds are where the binomial tails equal 0.025.
    from scipy.stats import binom
    lo, hi = census.clopper_pearson(7, 512)
    assert binom.sf(6, 512, lo) == pytest.approx(0.025, rel=1e-6)
    assert binom.cdf(7, 512, hi) == pytest.approx(0.025, rel=1e-6)


@pytest.mark.parametrize("right,n,k", [(0, 512, 16), (3, 512, 64), (30, 512, 256), (500, 512, 1),
                                       (5, 8, 4), (2, 8, 7)])
def test_pass_at_k_is_the_binomial_ratio(right, n, k):
    assert census.pass_at_k(right, n, k) == pytest.approx(
        1 - math.comb(n - right, k) / math.comb(n, k), rel=1e-12, abs=1e-15)


def test_zones_hold_their_bounds():
    assert [census.zone(q) for q in (1 / 16, 1 / 16 - 1e-9, 1 / 2048, 1 / 2048 - 1e-12)] == \
        ["high", "window", "window", "low"]
    # 0 of 512: the interval reaches 1/139, across the window's lower bound: unresolved.
    assert census.interval_zone(*census.clopper_pearson(0, 512)) == "unresolved"
    assert census.interval_zone(*census.clopper_pearson(10, 512)) == "window"
    assert census.interval_zone(*census.clopper_pearson(300, 512)) == "high"


@pytest.mark.slow
def test_a_killed_census_continues_to_the_uninterrupted_records(tmp_path):
    whole, part = tmp_path / "whole", tmp_path / "part"
    run(whole)
    rows = (whole / "census.jsonl").read_text().splitlines()
    assert len(rows) == 3 and [json.loads(r)["index"] for r in rows] == [0, 1, 2]
    # Each record also counts its samples right by the lenient reading (verify.py): >= right.
    assert all(r["right"] <= r["right_lenient"] <= r["samples"] for r in map(json.loads, rows))
    # As a kill after the first prompt leaves it: the header and one record.
    part.mkdir()
    (part / "census.json").write_text((whole / "census.json").read_text())
    (part / "census.jsonl").write_text(rows[0] + "\n")
    # Cut to a budget of two prompts, then gone on with to the whole.
    assert "1 recorded" in run(part, first=2).stdout
    assert (part / "census.jsonl").read_text().splitlines() == rows[:2]
    assert "2 recorded" in run(part).stdout
    assert (part / "census.jsonl").read_text() == (whole / "census.jsonl").read_text()
    # Each prompt's samples are its own: the second prompt alone, from its own seed, is the same.
    assert census.prompt_seed(0, 1) != census.prompt_seed(0, 2) != census.prompt_seed(1, 1)


def test_a_record_without_the_lenient_count_is_an_older_censuss():
    """right_lenient is optional (a census recorded before it still reads and continues); where it
    is, it lies between right and samples."""
    old = dict(index=0, prompt="1+2=", answer="3", right=2, samples=8, mean_len=3.0, truncated=0)
    assert census.is_record(old, 1, 8)
    assert census.is_record({**old, "right_lenient": 2}, 1, 8)
    assert census.is_record({**old, "right_lenient": 8}, 1, 8)
    for bad in (1, 9, 2.0, "2", None):
        assert not census.is_record({**old, "right_lenient": bad}, 1, 8), bad


@pytest.mark.slow
def test_another_census_or_a_torn_record_is_one_line(tmp_path):
    out = tmp_path / "c"
    run(out)
    p = run(out, samples=16, check=False)
    assert p.returncode == 2 and "another census (samples differ)" in p.stderr
    assert "Traceback" not in p.stderr
    (out / "census.jsonl").write_text('{"index": 0, "right": 3}\n')
    p = run(out, check=False)
    assert p.returncode == 2 and "census.jsonl, line 1: not this census's record" in p.stderr


def test_report_counts_zones_and_falls(tmp_path):
    def write(d, rights, n=512):
        d.mkdir()
        (d / "census.json").write_text(json.dumps({"samples": n}) + "\n")
        (d / "census.jsonl").write_text("".join(
            json.dumps(dict(index=i, prompt=f"p{i}", answer="1", right=r, samples=n,
                            mean_len=4.0, truncated=0)) + "\n" for i, r in enumerate(rights)))
    write(tmp_path / "a", [0, 5, 100, 40])
    write(tmp_path / "b", [0, 0, 300, 20])
    s = census.summary([json.loads(x) for x in (tmp_path / "a" / "census.jsonl")
                        .read_text().splitlines()])
    assert s["zones"] == {"high": 2, "window": 1, "low": 1}
    assert s["mean_q"] == pytest.approx((0 + 5 + 100 + 40) / 512 / 4)
    text = census.report([tmp_path / "a", tmp_path / "b"])
    assert "- window -> low: 1" in text and "- high -> window: 1" in text
    assert "Q fell on 2 prompts" in text


def records(n: int, samples: int = 8, drop: str = "") -> str:
    """A census.jsonl of n prompts, each record without the field `drop`."""
    rows = [dict(index=i, prompt=f"p{i}", answer="1", right=i, samples=samples, mean_len=4.0,
                 truncated=0) for i in range(n)]
    return "".join(json.dumps({k: v for k, v in r.items() if k != drop}) + "\n" for r in rows)


def refused(capsys, argv: list) -> str:
    """census.main(argv)'s refusal: exit status 2, one line on stderr, no traceback; that line."""
    with pytest.raises(SystemExit) as stop:
        census.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err
    return err.strip()


@pytest.mark.parametrize("head, rows, said", [
    ('{"samples": 8, "argv": ["--eval', records(2), "census.json: unreadable"),  # cut
    ('["not", "a", "header"]', records(2), "census.json: not a census's header"),  # foreign
    ('{"argv": []}', records(2), "census.json: not a census's header"),  # no samples
    ('{"samples": 8}', records(2, drop="mean_len"),
     "census.jsonl, line 1: not this census's record of prompt 0 (it lacks mean_len)"),
    ('{"samples": 8}', records(2).replace('"mean_len": 4.0', '"mean_len": "4"'),
     "census.jsonl, line 1: not this census's record of prompt 0"),
    ('{"samples": 8}', records(2)[:-20], "census.jsonl, line 2: not this census's record"),
])
def test_a_cut_or_foreign_census_or_a_record_without_a_field_is_one_line(tmp_path, capsys, head,
                                                                         rows, said):
    """--report over a census.json cut short or of something else (once a JSONDecodeError, a
    TypeError), records without a field the report reads (once a KeyError on mean_len), and the
    same folder as a census's --out: one line naming the file, nothing rewritten."""
    folder = tmp_path / "c"
    folder.mkdir()
    (folder / "census.json").write_text(head)
    (folder / "census.jsonl").write_text(rows)
    assert said in refused(capsys, ["--report", str(folder)])
    if head.startswith('{"samples": 8, "argv'):  # the cut header, as a census's --out
        line = refused(capsys, ["--out", str(folder), "--samples", "8", "--", *TINY])
        assert "census.json: unreadable" in line
    assert (folder / "census.json").read_text() == head and \
        (folder / "census.jsonl").read_text() == rows


def test_an_out_that_is_a_file_or_a_bad_task_is_one_line_before_out_is_made(tmp_path, capsys):
    """--out a file (once a FileExistsError after the model loaded) and a --task that is not
    there (once refused after --out was made): one line, --out as it was."""
    line = refused(capsys, ["--out", str(tmp_path / "new"), "--samples", "8", "--", *TINY,
                            "--task", f"math:{tmp_path / 'none.jsonl'}"])
    assert f"--task math:{tmp_path / 'none.jsonl'}" in line and not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("mine")
    line = refused(capsys, ["--out", str(tmp_path / "file"), "--", *TINY])
    assert f"--out {tmp_path / 'file'}: cannot make it (a file is in the way)" in line
    assert (tmp_path / "file").read_text() == "mine"


@pytest.mark.slow
def test_a_census_samples_in_the_dtype_it_began_in(tmp_path, monkeypatch):
    """--dtype auto's choice is the census's: on a CPU that computes bf16 natively (made so here)
    a new census samples under bf16 autocast and its header says so; one begun in fp32 (a header
    naming no dtype, as every census before --dtype auto chose bf16) goes on in fp32."""
    import brorl
    import torch
    from lib import policy
    monkeypatch.setattr(policy, "cpu_bf16", lambda: "AVX512_BF16")
    monkeypatch.setattr(policy, "BF16_MIN_HIDDEN", 0)  # the embedded model counts as wide
    seen, real = [], brorl.sample_share

    def spy(*args, **kw):
        seen.append(torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None)
        return real(*args, **kw)

    monkeypatch.setattr(brorl, "sample_share", spy)
    census.run_census(tmp_path / "new", 4, TINY, first=1)
    assert json.loads((tmp_path / "new" / "census.json").read_text())["dtype"] == "bfloat16"
    assert seen == [torch.bfloat16]
    old = tmp_path / "old"
    old.mkdir()
    head = json.loads((tmp_path / "new" / "census.json").read_text())
    (old / "census.json").write_text(json.dumps({k: v for k, v in head.items() if k != "dtype"}))
    seen.clear()
    census.run_census(old, 4, TINY, first=1)
    assert seen == [None] and "dtype" not in json.loads((old / "census.json").read_text())
    # A dtype given goes on as given: the same command continues its census.
    seen.clear()
    for first in (1, 2):
        census.run_census(tmp_path / "given", 4, [*TINY, "--dtype", "bfloat16"], first=first)
    assert seen == [torch.bfloat16, torch.bfloat16]
    assert len((tmp_path / "given" / "census.jsonl").read_text().splitlines()) == 2
