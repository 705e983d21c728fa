"""What a run shows beyond its numbers: samples.jsonl (the evaluation's own responses, the figures unchanged,
bounded, exact across a kill and --resume) and --report_to's dashboards (TensorBoard's event files and wandb's
offline run read back against metrics.jsonl; a resume continues the same run; a missing package is one line)."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

import brorl
import verify
from lib import harness, report, samples
from test_brorl import SMALL, run_in_process
from tools import ablate

FAST = [*SMALL, "--probe_samples", "16", "--device", "cpu"]  # on the CPU: bitwise reproducible across a resume


def train(*args):
    return brorl.train(brorl.parse_config([str(a) for a in args]))


def lines(path: Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


def figures(rows: list) -> list:
    """The rows without the clocks (the only values that differ between two runs of the same flags)."""
    return [{k: v for k, v in r.items() if not k.startswith("time") and k != "tokens_per_s"} for r in rows]


class Killed(Exception):
    pass


def kill_at_checkpoint(monkeypatch, at: int):
    """The run dies at step `at`'s checkpoint: that step's records written, its checkpoint and eval row not."""
    checkpoint = harness.Run.checkpoint

    def killed(self, step, *args):
        if step == at:
            raise Killed
        checkpoint(self, step, *args)
    monkeypatch.setattr(harness.Run, "checkpoint", killed)


# ----------------------------------------------------------------------------
# samples.jsonl


@pytest.mark.slow
def test_a_cut_short_last_samples_line_is_dropped_on_resume(tmp_path, capsys):
    """A full disk or a kill while samples.jsonl was written leaves half a line: --resume drops it with a line
    and ends with the uninterrupted run's file; a bad line before the last stops with one line naming it."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--eval_every", "1", *FAST]
    train("--steps", "3", "--out", a, *common)
    train("--steps", "2", "--out", b, *common)
    with open(b / "samples.jsonl", "a") as f:
        f.write('{"step": 3, "kind": "ev')  # cut short
    capsys.readouterr()
    train("--resume", b, "--steps", "3")
    assert "samples.jsonl: dropped its last line, cut short (23 characters)" in capsys.readouterr().err
    assert lines(b / "samples.jsonl") == lines(a / "samples.jsonl")
    text = (b / "samples.jsonl").read_text()
    (b / "samples.jsonl").write_text("not json\n" + text)
    with pytest.raises(SystemExit):
        samples.read(b / "samples.jsonl")
    assert "samples.jsonl: line 1 is not a record" in capsys.readouterr().err


@pytest.mark.slow
def test_samples_are_the_evaluations_own_responses_and_change_no_figure(tmp_path):
    """Each eval's first responses to the first held-out prompts, scored as the evaluation scored them; with
    --sample_groups the trained responses and their advantages. Recording them draws nothing: the figures
    equal those of a run that records nothing, and metrics.jsonl holds no responses."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "2", "--eval_every", "1", *FAST]
    rows = train(*common, "--sample_prompts", "2", "--sample_responses", "3", "--sample_groups", "2", "--out", a)
    bare = train(*common, "--sample_prompts", "0", "--out", b)
    assert figures(rows) == figures(bare) == figures(lines(a / "metrics.jsonl"))
    assert lines(b / "samples.jsonl") == [] and "eval_responses" not in rows[0]
    evals = [r for r in lines(a / "samples.jsonl") if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0] * 6 + [1] * 6 + [2] * 6  # 2 prompts x 3 responses an eval
    assert len({r["prompt"] for r in evals}) == 2
    for r in evals:
        assert r["reward"] == verify.reward(r["response"], r["answer"], task="arith") * (not r["truncated"])
        assert r["length"] >= len(r["response"])  # tokens: a character each, and the EOS
    train_recs = [r for r in lines(a / "samples.jsonl") if r["kind"] == "train"]
    assert {r["step"] for r in train_recs} == {1, 2} and len(train_recs) <= 2 * 2 * 3
    for step in (1, 2):  # within a group, a right response's advantage is above a wrong one's
        group = [r for r in train_recs if r["step"] == step and r["prompt"] == train_recs[0]["prompt"]]
        right, wrong = [r["advantage"] for r in group if r["reward"]], [r["advantage"] for r in group if not r["reward"]]
        assert not right or not wrong or min(right) > max(wrong)


def test_samples_stay_bounded_whatever_the_runs_length(tmp_path):
    """At most cap steps of each kind, the first and the last always kept; a function of the steps alone (so
    thinning again changes nothing); a long response keeps its head and its tail."""
    steps = list(range(0, 10_000, 25))
    kept = samples.kept_steps(steps, 64)
    assert len(kept) <= 64 and {0, 9975} <= kept and samples.kept_steps(sorted(kept), 64) == kept
    assert samples.kept_steps(steps[:64], 64) == set(steps[:64])  # within the cap: every one
    path = tmp_path / "samples.jsonl"
    for step in range(300):  # as a run: records at every step, thinned at each eval (here every 3rd)
        samples.append(path, step, [dict(kind="eval", response="x"), dict(kind="train", response="y")])
        if step % 3 == 0:
            samples.thin(path, cap=8)
            assert len(path.read_text().splitlines()) <= 2 * 8
    assert {0, 297} <= {r["step"] for r in lines(path)}
    long = "h" * 3000 + "t" * 5000
    clipped = samples.clip(long)
    assert clipped.startswith("h" * 1000 + " [... 4000 characters ...] ") and clipped.endswith("t" * 3000)
    assert samples.clip("short") == "short"


KILLED_RUN = ["--steps", "3", "--eval_every", "1", "--sample_groups", "1", "--sample_responses", "2", *FAST]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """samples.jsonl of a run never killed, thinned to 2 steps a kind (so that a resume must thin alike)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(samples, "MAX_STEPS", 2)
        out = tmp_path_factory.mktemp("uninterrupted")
        train(*KILLED_RUN, "--out", out)
    return lines(out / "samples.jsonl")


@pytest.mark.slow
@pytest.mark.parametrize("kill", ["before_checkpoint", "before_thinning"])
def test_samples_survive_a_kill_and_resume(tmp_path, monkeypatch, uninterrupted, kill):
    """Killed after step 2's records were written, before its checkpoint (the resume redoes step 2 from step
    1's), or between step 2's checkpoint and the thinning that follows it: the resumed run's samples.jsonl is
    the uninterrupted run's, no step twice, none missing, thinned alike."""
    run = tmp_path / "run"
    monkeypatch.setattr(samples, "MAX_STEPS", 2)
    if kill == "before_checkpoint":
        kill_at_checkpoint(monkeypatch, 2)
    else:
        thin, calls = samples.thin, []

        def killed(path, *args):
            calls.append(path)
            if len(calls) == 3:  # at the start, then after the checkpoints of steps 1 and 2
                raise Killed
            thin(path, *args)
        monkeypatch.setattr(samples, "thin", killed)
    with pytest.raises(Killed):
        train(*KILLED_RUN, "--out", run)
    assert max(r["step"] for r in lines(run / "samples.jsonl")) == 2  # the killed step's records were written
    monkeypatch.undo()  # the real checkpoint and thinning again; then the same cap
    monkeypatch.setattr(samples, "MAX_STEPS", 2)
    train("--resume", run, "--steps", "3")
    assert lines(run / "samples.jsonl") == uninterrupted
    assert sorted({r["step"] for r in uninterrupted if r["kind"] == "eval"}) == [0, 3]  # 4 evals thinned to 2
    assert sorted({r["step"] for r in uninterrupted if r["kind"] == "train"}) == [1, 3]
    assert [r["step"] for r in lines(run / "metrics.jsonl")] == [0, 1, 2, 3]


# ----------------------------------------------------------------------------
# --report_to


def test_rows_go_under_grouped_names():
    row = {"step": 3, "reward_mean": 0.5, "pass@N": 1.0, "entropy": 0.2, "eval_pass@1": 0.4, "eval_correct": [1, 2],
           "mass_mean": 0.3, "time_rollout": 1.5, "time_train_cpu": 9.0, "grad_norm": 0.1}
    assert report.grouped(row) == {"rollout/reward_mean": 0.5, "rollout/pass@N": 1.0, "update/entropy": 0.2,
                                   "eval/pass@1": 0.4, "mass/mean": 0.3, "time/rollout": 1.5,
                                   "time/train_cpu": 9.0, "update/grad_norm": 0.1}
    assert report.backends("none") == [] and report.backends("tensorboard,wandb") == ["tensorboard", "wandb"]


@pytest.mark.slow
def test_tensorboard_scalars_read_back_equal_metrics_jsonl(tmp_path, monkeypatch):
    """A run killed after step 3's rows were logged, before its checkpoint, then resumed: TensorBoard's own
    reader (the one its server uses) finds every row of metrics.jsonl under its grouped names, each step once
    (purge_step), exactly (float64 scalars); the config as text and hyperparameters; the samples as text."""
    from tensorboard.backend.event_processing import plugin_event_accumulator as event_accumulator
    from tensorboard.util import tensor_util
    out = tmp_path / "run"
    kill_at_checkpoint(monkeypatch, 3)
    with pytest.raises(Killed):
        train("--steps", "3", "--eval_every", "2", "--report_to", "tensorboard", "--sample_groups", "1", "--out", out, *FAST)
    monkeypatch.undo()
    train("--resume", out, "--steps", "3")
    acc = event_accumulator.EventAccumulator(str(out / "tensorboard"), size_guidance={event_accumulator.TENSORS: 0})
    acc.Reload()
    want = {}
    for row in lines(out / "metrics.jsonl"):
        for name, value in report.grouped(row).items():
            want.setdefault(name, []).append((row["step"], value))
    got = {name: [(e.step, tensor_util.make_ndarray(e.tensor_proto).item()) for e in acc.Tensors(name)] for name in want}
    assert got == want and [s for s, _ in want["eval/pass@1"]] == [0, 2, 3] and len(want["rollout/reward_mean"]) == 3
    tags = acc.Tags()["tensors"]
    assert {"config/text_summary", "samples/eval/text_summary", "samples/train/text_summary"} <= set(tags)
    assert [e.step for e in acc.Tensors("samples/train/text_summary")] == [1, 2, 3]
    assert "_hparams_/session_start_info" in acc.PluginTagToContent("hparams")  # the HPARAMS tab's config


def wandb_records(run_dir: Path) -> list:
    """The records of an offline wandb run: its run-<id>.wandb is a LevelDB-style log (a 7-byte file header,
    32 KiB blocks of chunks each with a 7-byte header: CRC, length, type; types 1 full, 2-4 first/middle/last)."""
    from wandb.proto import wandb_internal_pb2
    data = next(run_dir.glob("run-*.wandb")).read_bytes()
    pos, chunk, records = 7, b"", []
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4: pos + 6], "little"), data[pos + 6]
        chunk += data[pos + 7: pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(wandb_internal_pb2.Record.FromString(chunk))
            chunk = b""
    return records


@pytest.mark.slow
def test_wandb_offline_run_holds_the_rows_and_a_resume_continues_it(tmp_path, monkeypatch):
    """WANDB_MODE=offline (no network, no login): a 2-step run's offline run directory holds metrics.jsonl's
    rows under the grouped names, the config, the samples as tables; --resume continues the same run id."""
    for name in ("WANDB_RUN_GROUP", "WANDB_NAME", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    out = tmp_path / "run"
    train("--steps", "2", "--eval_every", "2", "--report_to", "wandb", "--sample_groups", "1", "--out", out, *FAST)
    train("--resume", out, "--steps", "3")
    sessions = sorted((tmp_path / "wandb").glob("offline-run-*"))
    records = [wandb_records(s) for s in sessions]
    runs = [r.run for recs in records for r in recs if r.WhichOneof("record_type") == "run"]
    assert len(sessions) == 2 and {r.run_id for r in runs} == {(out / "wandb_id").read_text()}
    assert runs[0].display_name == "run" and json.loads(runs[0].config.update[0].value_json) is not None
    history = {}
    for recs in records:
        for r in recs:
            if r.WhichOneof("record_type") == "history":
                item = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                history[item["_step"]] = item
    for row in lines(out / "metrics.jsonl"):
        logged = history[row["step"]]
        assert {k: v for k, v in logged.items() if k.split("/")[0] in ("rollout", "update", "eval", "mass", "time")} \
            == report.grouped(row)
    assert history[2]["samples/eval/_type"] == "table-file" and history[3]["samples/train/_type"] == "table-file"


@pytest.mark.parametrize("name", ["tensorboard", "wandb"])
def test_a_missing_backend_is_one_line_exit_2_and_nothing_written(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # import name raises ImportError
    out = tmp_path / "run"
    code, err = run_in_process(capsys, "--report_to", "tensorboard,wandb", "--out", str(out), "--steps", "1", *FAST)
    assert code == 2 and err.strip().splitlines() == [f"error: --report_to {name}: the {name} package is not "
                                                      f"installed ({report.INSTALL[name]})"]
    assert not out.exists()
    code, err = run_in_process(capsys, "--report_to", "mlflow", "--out", str(out), "--steps", "1")
    assert code == 2 and "--report_to 'mlflow': choose none, tensorboard, wandb" in err and not out.exists()


def test_rank_0_alone_reports(tmp_path):
    cfg = brorl.parse_config(["--report_to", "tensorboard,wandb"])
    assert report.Report(cfg, tmp_path, 0, main=False).backends == [] and not any(tmp_path.iterdir())


def test_a_sweeps_runs_share_a_wandb_group(tmp_path, monkeypatch):
    """tools/ablate.py names each run's group (the sweep directory) and name (config/seed) for wandb."""
    for name in ("WANDB_RUN_GROUP", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    seen = {}
    monkeypatch.setattr(ablate.study.subprocess, "run", lambda cmd, env, **kw: seen.update(env) or SimpleNamespace(returncode=1))
    ablate.launch(["--steps", "1"], tmp_path / "shape" / "n_rollouts=16" / "seed0", threads=1)
    assert seen["WANDB_RUN_GROUP"] == "shape" and seen["WANDB_NAME"] == "n_rollouts=16/seed0"
