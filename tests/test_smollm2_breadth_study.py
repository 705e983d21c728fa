"""The SmolLM2 breadth study (tools/smollm2_breadth_study.py): its arms' flags, its plan, its
measures and tests against hand computations on made-up raw files, and the refusals of raw files
that are not its own."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from scipy import stats as sps

from tools import smollm2_breadth_study as study

HERE = Path(__file__).resolve().parent.parent


def run_rows(pass1: float, correct: list, samples=(128, 160), cpu=100.0) -> list:
    """A run's rows: step 0's evaluation, then one row a step, the last with its evaluation."""
    ev = lambda p, c: {"eval_pass@1": p, "eval_pass@4": min(1.0, 2 * p),
                       "eval_greedy_pass@1": p / 2, "eval_resp_len": 20.0, "eval_correct": c}
    rows = [dict(step=0, **ev(0.02, [0] * len(correct)), time_train_cpu=0.0)]
    for i, n in enumerate(samples, 1):
        rows.append(dict(step=i, samples=n, entropy=0.1 * i, keep_rate=0.5,
                         time_train_cpu=cpu * i / len(samples)))
    rows[-1].update(ev(pass1, correct))
    return rows


def write_raw(raw: Path, arm: str, seed: int, rows: list):
    path = raw / "arms" / arm / f"seed{seed}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def census_records(n: int, samples: int = 512, drop: str = "") -> str:
    """A census.jsonl of n prompts (tools/census.py's records), without the field `drop`."""
    rows = [dict(index=i, prompt=f"p{i}", answer="1", right=i, samples=samples, mean_len=4.0,
                 truncated=0) for i in range(n)]
    return "".join(json.dumps({k: v for k, v in r.items() if k != drop}) + "\n" for r in rows)


def test_arms_share_everything_but_n_and_b(tmp_path):
    jobs = study.jobs(list(study.ARMS), [3], 4, tmp_path / "out", tmp_path / "raw")
    flags = {j.name.split()[0]: dict(zip(j.argv[::2], j.argv[1::2])) for j in jobs}
    assert flags["n64"].pop("--n_rollouts") == "64" and flags["n64"].pop("--micro_batch") == "64"
    assert flags["n16b16"].pop("--prompts_per_step") == "16"
    assert flags["n16b16"].pop("--micro_batch") == "64"
    for arm in flags:
        flags[arm].pop("--out")
    assert flags["n16"] == flags["n64"] == flags["n16b16"]
    # fp32 on any CPU, as the committed runs were (--dtype auto is bf16 where the CPU computes it)
    assert flags["n16"] == {"--preset": "smollm2", "--dtype": "float32", "--steps": "4",
                           "--eval_every": "4", "--seed": "3"}
    # Seed by seed: a study cut short is balanced.
    assert [j.name for j in study.jobs(["n16", "n64"], [0, 1], 4, tmp_path, tmp_path)] == \
        ["n16 seed 0", "n64 seed 0", "n16 seed 1", "n64 seed 1"]


def test_plan_counts_kept_rollouts_and_two_evaluations(tmp_path):
    todo = study.jobs(["n16", "n64"], [0], 4, tmp_path, tmp_path)
    hours = (4 * 64 * 1.2 + 160 + 4 * 256 * 1.2 + 160) / 3600
    assert f"2 run(s) to do, about {hours:.1f} CPU hours" in study.plan(todo, 4)
    assert study.plan(todo, 4, 6, 20).endswith(
        f"then at most 6 end census(es) of 20 prompts, about {6 * 20 * 90 / 3600:.1f} CPU hours")


def test_end_censuses_census_each_runs_end_with_the_base_censuses_flags(tmp_path, monkeypatch,
                                                                       capsys):
    """The census of a finished run's end: tools/census.py on its checkpoint, the base census's
    flags (its committed header's), one thread; a census already holding K prompts, or a run not
    finished, is not run; a checkpoint that is not the raw file's last step, or a census folder
    of another model, stops the driver in one line (exit 2) before any census runs."""
    import torch
    assert study.CENSUS_FLAGS == json.loads((study.RAW / "census-base" / "census.json")
                                            .read_text())["argv"]
    raw, out = tmp_path / "raw", tmp_path / "out"
    for arm in ("n16", "n64"):
        (raw / "arms" / arm).mkdir(parents=True)
        (raw / "arms" / arm / "seed0.jsonl").write_text('{"step": 0}\n{"step": 4}\n')
        (out / arm / "seed0" / "ckpt").mkdir(parents=True)
        (out / arm / "seed0" / "ckpt" / "model.safetensors").write_text("")
        torch.save(dict(step=4), out / arm / "seed0" / "ckpt" / "trainer_state.pt")
    full = raw / "census-arm-n64-s0"
    full.mkdir()
    (full / "census.json").write_text(json.dumps(dict(samples=512, argv=[
        *study.CENSUS_FLAGS, "--model", str(out / "n64" / "seed0" / "ckpt")])))
    (full / "census.jsonl").write_text(census_records(2))
    calls = []
    monkeypatch.setattr("subprocess.run", lambda argv, **kw: calls.append((argv, kw["env"])) or
                        type("Done", (), dict(returncode=0))())
    assert study.end_censuses(["n16", "n64", "n16b16"], [0, 1], 2, out, raw, 2) == []
    (argv, env), = calls
    assert argv[1:] == ["-m", "tools.census", "--out", str(raw / "census-arm-n16-s0"),
                        "--samples", "512", "--first", "2", "--", *study.CENSUS_FLAGS,
                        "--model", str(out / "n16" / "seed0" / "ckpt")]
    assert env["OMP_NUM_THREADS"] == "1"
    # The n64 census, cut to 3 prompts, would go on: from a checkpoint of step 2, it may not.
    torch.save(dict(step=2), out / "n64" / "seed0" / "ckpt" / "trainer_state.pt")
    with pytest.raises(SystemExit) as e:
        study.end_censuses(["n64"], [0], 3, out, raw, 1)
    assert e.value.code == 2 and "its checkpoint is at step 2" in capsys.readouterr().err
    (full / "census.json").write_text(json.dumps(dict(samples=512, argv=["--model", "elsewhere"])))
    with pytest.raises(SystemExit):
        study.end_censuses(["n64"], [0], 3, out, raw, 1)
    assert "a census of --model elsewhere, not of" in capsys.readouterr().err
    assert len(calls) == 1

def test_measures_and_tests_against_hand_computation(tmp_path):
    raw = tmp_path / "raw"
    a = {0: 0.40, 1: 0.45, 2: 0.55}  # n64's end pass@1 by seed
    b = {0: 0.30, 1: 0.45, 2: 0.35}  # n16's
    # Prompt by prompt (4 prompts): n64 - n16 summed over seeds is +3, -1, 0, +2.
    ca = {0: [2, 0, 1, 3], 1: [1, 0, 0, 0], 2: [1, 1, 0, 1]}
    cb = {0: [1, 1, 1, 2], 1: [0, 0, 0, 0], 2: [0, 1, 0, 0]}
    for s in a:
        write_raw(raw, "n64", s, run_rows(a[s], ca[s], samples=(512, 256), cpu=400.0))
        write_raw(raw, "n16", s, run_rows(b[s], cb[s]))
    data = study.read(raw)
    m = data["n64"][0]
    assert (m["sampled"], m["updates"], m["cpu_s"]) == (768, 4, 400.0)
    assert m["entropy"] == pytest.approx(0.15) and m["pass1_start"] == 0.02
    text = study.report(raw)
    xa, xb = [a[s] for s in a], [b[s] for s in b]
    d = sum(xa) / 3 - sum(xb) / 3
    ci = sps.ttest_ind(xa, xb, equal_var=False).confidence_interval()
    paired = sps.ttest_rel(xa, xb).pvalue
    line = next(x for x in text.splitlines() if x.startswith("- n64 - n16"))
    assert line.startswith(f"- n64 - n16, on the 3 shared seeds: {d:+.4f} (Welch 95% interval "
                           f"{ci.low:+.4f} .. {ci.high:+.4f}); paired t p {paired:.3g}")
    assert "by prompt 2 up, 1 down, 1 even, sign test p 1" in line
    assert "| n64 | 3 | 0.02 +- 0 | 0.4667 +- 0.0764 |" in text  # mean, sd of 0.40 0.45 0.55


def _censuses(raw, named: dict):
    """Made-up census folders of 512 samples a prompt: {name: each prompt's right count}."""
    for name, rights in named.items():
        d = raw / name
        d.mkdir(parents=True)
        (d / "census.json").write_text(json.dumps(dict(samples=512)) + "\n")
        (d / "census.jsonl").write_text("".join(
            json.dumps(dict(index=i, prompt=f"p{i}", answer="1", right=r, samples=512,
                            mean_len=10.0, truncated=0)) + "\n" for i, r in enumerate(rights)))


def test_censuses_pair_over_the_prompts_both_recorded(tmp_path):
    raw = tmp_path / "raw"
    _censuses(raw, {"census-base": [3, 0, 40, 1], "census-x": [200, 0, 10]})
    text = "\n".join(study.census_section(*study.censuses(raw)))
    assert "### census-base -> census-x, their first 3 prompts" in text
    assert "- window -> high: 1" in text and "- high -> window: 1" in text
    assert "- low -> low: 1" in text and "- window -> window" not in text  # no 4th prompt
    assert "Q fell on 1 prompts" in text and "- prompt 2: 0.0781 -> 0.0195" in text
    assert "Below 1/16 in census-x (2):\n- prompt 1 (1): 0/512 -> 0/512\n" \
        "- prompt 2 (1): 40/512 -> 10/512" in text


def test_arm_ends_censused_per_seed_and_against_n16s(tmp_path):
    """The arms' end censuses over the prompts every census shares, by hand: per seed pass@1, the
    base's window prompts that reached 1/16 (32 of 512, the edge, counting), the prompts below
    the base's Q; n64 against n16 paired by seed (scipy's t); per seed each prompt's Q higher or
    lower than n16's (scipy's binomial) and the falls. An arm with no n16 of its seed: not
    paired."""
    raw = tmp_path / "raw"
    _censuses(raw, {"census-base": [1, 0, 3, 40, 1, 2, 7],  # window: prompts 0, 2, 4, 5
                    "census-arm-n16-s0": [40, 0, 3, 50, 0, 9],
                    "census-arm-n64-s0": [60, 1, 33, 20, 2, 40],
                    "census-arm-n16-s1": [2, 0, 3, 40, 1, 2],
                    "census-arm-n64-s1": [32, 0, 2, 45, 1, 2],
                    "census-arm-n64-s2": [0, 0, 0, 0, 0, 0],
                    "census-arm-n16b16-s0": [60, 1, 33, 20, 2, 40],  # as n64's, on seed 0
                    "census-arm-n16b16-s2": [0, 0, 0, 0, 0, 0]})
    text = "\n".join(study.census_section(*study.censuses(raw)))
    assert "### The arms' ends, censused (the first 6 prompts; 4 in the base's window" in text
    assert "| n16 | 0 1 | 0.0332, 0.0156 |" in text and "| 1, 0 | 1, 0 |" in text, text
    assert "| n64 | 0 1 2 | 0.0508, 0.0267, 0 |" in text and "| 3, 1, 0 | 1, 1, 5 |" in text
    p = sps.ttest_rel([156 / 3072, 82 / 3072], [102 / 3072, 48 / 3072]).pvalue
    assert f"- n64 - n16, pass@1 of the ends, on the 2 shared seeds: +0.0143" in text
    assert f"paired t p {p:.3g}" in text
    # n64 against n16b16 over seeds 0 and 2 (no n16b16 seed 1): equal on both, no spread
    assert "- n64 - n16b16, pass@1 of the ends, on the 2 shared seeds: +0.0000" in text
    assert "- n16b16 - n16," not in text  # one shared seed only
    assert "### census-arm-n16-s0 -> census-arm-n64-s0, their first 6 prompts" in text
    p0, p1 = sps.binomtest(5, 6).pvalue, sps.binomtest(2, 3).pvalue
    assert f"Q higher on 5 prompts, lower on 1, equal on 0 (sign test p {p0:.3g})." in text
    assert f"Q higher on 2 prompts, lower on 1, equal on 3 (sign test p {p1:.3g})." in text
    assert "- prompt 3: 0.0977 -> 0.0391" in text and "n16-s2 -> census-arm-n64-s2" not in text


@pytest.mark.parametrize("bad,said", [
    ("arms/n32/seed0.jsonl", "not an arm of this study"),
    ("arms/n16/seed0.jsonl", "not a run of this study"),
])
def test_foreign_raw_files_are_refused_in_one_line(tmp_path, bad, said):
    raw = tmp_path / "raw"
    path = raw / bad
    path.parent.mkdir(parents=True)
    # A whole run's rows, but without what this study measures (no evaluation at the end).
    path.write_text(json.dumps(dict(step=0)) + "\n" + json.dumps(dict(step=1)) + "\n")
    p = subprocess.run([sys.executable, "-m", "tools.smollm2_breadth_study", "--report", "--raw",
                        str(raw)], cwd=HERE, capture_output=True, text=True)
    assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert not (raw / "report.md").exists()


def test_one_seed_is_compared_by_prompt_only(tmp_path):
    """With one shared seed no test over seeds is made; the prompts' sign test still is, and n64
    is also held against n16b16 (equal kept rollouts)."""
    raw = tmp_path / "raw"
    write_raw(raw, "n16", 0, run_rows(0.25, [0, 1, 2, 0]))
    write_raw(raw, "n64", 0, run_rows(0.5, [2, 2, 2, 1]))  # 3 up, 1 even against n16
    write_raw(raw, "n16b16", 0, run_rows(0.5, [2, 3, 2, 1]))  # 1 down, 3 even against n64
    lines = study.report(raw).splitlines()
    assert "- n64 - n16: +0.2500 on seed 0 alone (no test over seeds); by prompt 3 up, 0 down, " \
        "1 even, sign test p 0.25" in lines
    assert "- n64 - n16b16: +0.0000 on seed 0 alone (no test over seeds); by prompt 0 up, " \
        "1 down, 3 even, sign test p 1" in lines


@pytest.mark.parametrize("flags, said", [(["--census", "65"], "--census 65: the held-out set "
                                          "has 64 prompts"), (["--census", "0"], "--census 0: "
                                          "need >= 1"), (["--jobs", "0"], "--jobs 0: need >= 1")])
def test_bad_flags_are_named_before_any_run(tmp_path, flags, said, capsys, monkeypatch):
    monkeypatch.setattr(study.study, "run_jobs", lambda *a: pytest.fail("a run was started"))
    with pytest.raises(SystemExit) as e:
        study.main(["--out", str(tmp_path / "out"), "--raw", str(tmp_path / "raw"), *flags])
    assert e.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def base_census(raw: Path, head: str = None, records: str = None):
    """<raw>/census-base: a census header and records, each replaced by the text given."""
    (raw / "census-base").mkdir(parents=True)
    (raw / "census-base" / "census.json").write_text(
        head or json.dumps(dict(samples=512, argv=study.CENSUS_FLAGS)) + "\n")
    (raw / "census-base" / "census.jsonl").write_text(records or census_records(3))


@pytest.mark.parametrize("making, said", [
    (None, "--raw {raw}: no raw files of this study to report on"),  # missing
    (lambda raw: raw.mkdir(), "--raw {raw}: no raw files of this study to report on"),  # empty
    (lambda raw: base_census(raw, head='{"samples": 512, "argv": ["--pre'),
     "census-base/census.json: unreadable"),  # cut
    (lambda raw: base_census(raw, head='["a list"]'), "census-base/census.json: not a census's "
                                                      "header"),  # foreign
    (lambda raw: base_census(raw, records=census_records(3, drop="mean_len")),
     "census-base/census.jsonl, line 1: not this census's record of prompt 0 (it lacks "
     "mean_len)"),
])
def test_a_report_over_nothing_or_a_broken_census_is_one_line_and_writes_nothing(
        tmp_path, capsys, making, said):
    """--report over a missing or empty --raw (once a FileNotFoundError, and a title-only report
    with exit 0), a census.json cut short or not a census's (once a JSONDecodeError), records
    without a field the report reads (once a KeyError): one line, exit 2, nothing written."""
    raw = tmp_path / "raw"
    if making:
        making(raw)
    before = sorted(raw.rglob("*")) if raw.exists() else None
    with pytest.raises(SystemExit) as e:
        study.main(["--report", "--raw", str(raw)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert said.format(raw=raw) in err, err
    assert (sorted(raw.rglob("*")) if raw.exists() else None) == before


def test_a_census_that_cannot_go_on_is_one_line_before_out_or_the_lock_is_made(tmp_path, capsys,
                                                                              monkeypatch):
    """--census K with a census folder of another model, or cut short, beside a run whose raw
    file is there: one line before --out and its lock are made (once after, by the driver inside
    its lock)."""
    monkeypatch.setattr(study.study, "run_jobs", lambda *a: pytest.fail("a run was started"))
    raw, out = tmp_path / "raw", tmp_path / "out"
    write_raw(raw, "n16", 0, run_rows(0.25, [0, 1]))
    folder = raw / "census-arm-n16-s0"
    folder.mkdir()
    for head, said in [(json.dumps(dict(samples=512, argv=["--model", "elsewhere"])),
                        "a census of --model elsewhere, not of"),
                       ('{"samples": 5', "census.json: unreadable")]:
        (folder / "census.json").write_text(head)
        with pytest.raises(SystemExit) as e:
            study.main(["--out", str(out), "--raw", str(raw), "--arms", "n16", "--seeds", "0",
                        "--census", "2"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and len(err.strip().splitlines()) == 1, err
        assert not out.exists()


def test_an_unreadable_end_census_is_one_line(tmp_path, capsys):
    """censuses_to_do reads each end census through census.py's reader: bytes that are not text,
    or a record that is not the census's, stop with one line naming the file, not a traceback."""
    folder = tmp_path / "census-arm-n16-s0"
    folder.mkdir()
    (folder / "census.json").write_text(json.dumps(dict(samples=512)))
    (folder / "census.jsonl").write_bytes(b"\xff\xfe not text\n")
    with pytest.raises(SystemExit):
        study.censuses_to_do(["n16"], [0], 12, tmp_path)
    err = capsys.readouterr().err
    assert "census.jsonl" in err and len(err.strip().splitlines()) == 1, err
    (folder / "census.jsonl").write_text(json.dumps(dict(index=0)) + "\n")
    with pytest.raises(SystemExit):
        study.censuses_to_do(["n16"], [0], 12, tmp_path)
    assert "census.jsonl" in capsys.readouterr().err
