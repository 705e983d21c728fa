"""Bad input ends in one line on stderr and exit status 2, before any work, and leaves an existing run
directory byte-identical. The run directory protects itself: a run there is never started over, one
process holds it at a time, a stale lock is reclaimed. --resume finds what a crash left (the whole
ckpt.tmp of a save cut between its renames, a metrics line cut short) and continues exactly. A full
disk and Ctrl-C end in one line. The tools check their numbers the same way."""

import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import brorl
import data
from lib import checkpoint, config, harness, plan, samples, setup
from test_brorl import run_in_process

HERE = Path(__file__).resolve().parent.parent
TINY = ["--n_rollouts", "16", "--prompts_per_step", "2", "--eval_prompts", "4", "--eval_samples", "4",
        "--probe_prompts", "2", "--probe_samples", "16", "--max_rows", "256"]
strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("time") and k != "tokens_per_s"} for r in rows]


def snapshot(run: Path) -> dict:
    """Every file under run, by relative path: its bytes."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()}


def one_line(code, err: str, status: int = 2) -> str:
    """The refusal: exit status `status`, exactly one line on stderr, no traceback; that line."""
    lines = err.strip().splitlines()
    assert code == status and len(lines) == 1 and "Traceback" not in err, (code, err[-2000:])
    return lines[0]


def last_line(err: str) -> str:
    """stderr's last line, the progress bar's redraws (carriage returns) apart."""
    return [x for x in err.replace("\r", "\n").splitlines() if x.strip() and not x.startswith("brorl:")][-1]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(a / "ckpt" / "model.safetensors"), load_file(b / "ckpt" / "model.safetensors")
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.fixture(autouse=True)
def python_handles_ctrl_c():
    """A run that ends by an exception (as some here do) leaves its Ctrl-C handler set: Python's again after."""
    yield
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run, its checkpoint at step 2."""
    run = tmp_path_factory.mktemp("finished") / "run"
    brorl.train(brorl.parse_config(["--steps", "2", "--eval_every", "2", "--out", str(run), *TINY]))
    return run


@pytest.fixture
def run(finished, tmp_path) -> Path:
    """A copy of the finished run, to break."""
    shutil.copytree(finished, tmp_path / "run")
    return tmp_path / "run"


def cut(path: Path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def nan_model(tmp: Path) -> Path:
    """The embedded model with one NaN weight."""
    shutil.copytree(data.EMBEDDED_MODEL, tmp / "nan-model")
    w = load_file(tmp / "nan-model" / "model.safetensors")
    name = sorted(w)[0]
    w[name].view(-1)[0] = float("nan")
    save_file(w, tmp / "nan-model" / "model.safetensors", metadata={"format": "pt"})
    return tmp / "nan-model"


# (flags, what the one line says): a new run's flags, on a fresh --out that must stay unmade
NEW_RUN = [
    (["--lr", "0"], "--lr 0.0: need lr > 0"),
    (["--lr", "-1e-3"], "--lr -0.001: need lr > 0"),  # a value, not a missing one
    (["--lr", "nan"], "must be finite numbers: --lr nan"),
    (["--lr", "-inf"], "must be finite numbers: --lr -inf"),
    (["--weight_decay", "-0.1"], "--weight_decay -0.1: need >= 0"),
    (["--grad_clip", "-1"], "--grad_clip -1.0: need a max gradient norm > 0"),
    (["--grad_clip", "0"], "--grad_clip 0.0: need a max gradient norm > 0"),
    (["--kl_coef", "-1e-3"], "--kl_coef -0.001: need >= 0"),
    (["--kl_coef", "1e-3", "--ref_reset_every", "0"], "--ref_reset_every 0: need >= 1"),
    (["--clip_low", "1"], "--clip_low 1.0: need 0 <= eps_low < 1"),
    (["--clip_low", "-0.1"], "--clip_low -0.1"),
    (["--clip_high", "-0.1"], "--clip_high -0.1: need >= 0"),
    (["--loss", "sapo2"], "--loss 'sapo2': choose ppo, gspo, cispo or sapo"),
    (["--loss", "sapo", "--sapo_tau_neg", "0"], "--sapo_tau_pos 1.0, --sapo_tau_neg 0.0: need both > 0"),
    (["--probe_prompts", "0"], "--probe_prompts 0: need >= 1"),
    (["--probe_prompts", "-1"], "--probe_prompts -1: need >= 1"),
    (["--temperature", "inf"], "must be finite numbers: --temperature inf"),
    (["--device", "foo"], "--device 'foo': not a device"),
    (["--device", "cuda:99"], "--device cuda:99"),
    (["--device", "meta"], "--device meta: brorl runs on cpu or cuda"),
    (["--save", "maybe"], "'maybe' is not a boolean"),
    (["--steps", "x"], "argument --steps: invalid int value: 'x'"),
    (["--task", "math:{tmp}/dup.jsonl", "--eval_task", "math:{tmp}/dup.jsonl"], "37 of its 40 prompts are in --task's training set"),
    (["--model", "{nan_model}"], "holds NaN or inf"),
    (["--memory_gb", "0.00001"], "the smallest rollout chunk (16 rows decoding) needs 9.1 MB"),
    (["--init_from", "{run}", "--resume", "{run}"], "--init_from starts a new run from a checkpoint; --resume continues one: not both"),
    # a flag the preset set, not the user: said so
    (["--preset", "sets", "--task", "keys"], "needs --task sets (an answer space small enough to enumerate) "
                                             "(--answer_prompts 64 comes from --preset sets)"),
]
if not torch.cuda.is_available():
    NEW_RUN.append((["--device", "cuda"], "--device cuda: no CUDA device is available here"))


@pytest.mark.parametrize("flags, needle", NEW_RUN, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_a_bad_flag_is_one_line_and_writes_nothing(tmp_path, capsys, finished, flags, needle):
    if any("{nan_model}" in f for f in flags):
        nan_model(tmp_path)
    (tmp_path / "dup.jsonl").write_text("".join(json.dumps(dict(problem=f"{i}+{i}?", answer=str(2 * i))) + "\n"
                                                for i in range(40)))  # 3 of them in the test split, by hash
    flags = [f.format(tmp=tmp_path, nan_model=tmp_path / "nan-model", run=finished) for f in flags]
    before = snapshot(finished)
    out = tmp_path / "new"
    line = one_line(*run_in_process(capsys, *TINY, *flags, "--out", str(out), "--steps", "1"))
    assert needle in line and line.startswith("error: "), line
    assert not out.exists() and snapshot(finished) == before


def no_tokenizer_json(model: Path):
    (model / "tokenizer.json").unlink()


def another_vocab_size(model: Path):
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 5}))


@pytest.mark.parametrize("breaking, needle", [
    (no_tokenizer_json, "its tokenizer encodes text to no tokens (its tokenizer.json missing"),
    (another_vocab_size, "its config.json says vocab_size 263, hidden_size 128; its "
                         "model.safetensors' model.embed_tokens.weight is [258, 128]"),
], ids=["no-tokenizer.json", "vocab_size"])
@pytest.mark.parametrize("eval_only", [False, True], ids=["train", "--eval_only"])
def test_a_model_whose_files_disagree_is_one_line_before_any_write(tmp_path, capsys, breaking,
                                                                   needle, eval_only):
    """A tokenizer that encodes every prompt to nothing (it would pass the context check and crash
    in the sampler after the run directory is written), a config.json whose vocab_size is not its
    weights': one line naming the model, nothing written."""
    model, out = tmp_path / "model", tmp_path / "run"
    shutil.copytree(data.EMBEDDED_MODEL_SETS, model)
    breaking(model)
    line = one_line(*run_in_process(capsys, "--preset", "sets", *TINY, "--model", str(model),
                                    "--steps", "1", *["--eval_only"] * eval_only, "--out", str(out)))
    assert line.startswith(f"error: --model {model}: ") and needle in line, line
    assert not out.exists()


def break_config(run: Path):
    (run / "config.json").write_text('{"lr": 2e-4, "steps"')


# (how the run is broken, flags after --resume <run> or --out <run>, what the one line says)
ON_A_RUN = [
    (None, ["--out", "{run}", "--steps", "4"], "holds a run (config.json, metrics.jsonl, ckpt): continue it with --resume"),
    (None, ["--resume", "{run}", "--steps", "1"], "its checkpoint is at step 2 already"),
    (None, ["--resume", "{run}", "--out", "{run}/elsewhere"], "name different runs"),
    (break_config, ["--resume", "{run}"], "config.json is unreadable"),
    (lambda run: (run / "config.json").write_text('{"lr": "fast"}'), ["--resume", "{run}"], "holds lr = 'fast', not a number"),
    (lambda run: cut(run / "ckpt" / "trainer_state.pt"), ["--resume", "{run}", "--steps", "3"], "ckpt/trainer_state.pt is unreadable"),
    (lambda run: cut(run / "ckpt" / "model.safetensors"), ["--resume", "{run}", "--steps", "3"], "model.safetensors unreadable"),
    (lambda run: shutil.rmtree(run / "ckpt"), ["--resume", "{run}", "--steps", "3"], "no checkpoint to resume"),
    (lambda run: (run / "metrics.jsonl").write_text('{"step": 0}\n{"ste\n{"step": 1}\n'), ["--resume", "{run}", "--steps", "3"],
     "metrics.jsonl line 2 is not a metrics row"),
    (lambda run: shutil.rmtree(run / "ckpt"), ["--init_from", "{run}", "--out", "{run}-branch"], "the run holds no ckpt/"),
    (None, ["--resume", "{run}/ckpt", "--steps", "3"], "--resume {run}/ckpt: a run's checkpoint folder; give the run "
                                                     "directory: --resume {run}"),
    (lambda run: shutil.rmtree(run / "ckpt"), ["--out", "{run}", "--steps", "3"],
     "holds a run (config.json, metrics.jsonl) with no checkpoint to continue (--save 0, or deleted; step 2 was "
     "evaluated): give another --out, or delete that directory to start it over"),
]


@pytest.mark.parametrize("breaking, flags, needle", ON_A_RUN, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_a_bad_resume_is_one_line_and_leaves_the_run_as_it_was(run, capsys, breaking, flags, needle):
    if breaking:
        breaking(run)
    before = snapshot(run)
    line = one_line(*run_in_process(capsys, *[f.format(run=run) for f in flags], *TINY[:2]))
    assert needle.format(run=run) in line, line
    assert snapshot(run) == before and not Path(f"{run}-branch").exists()


@pytest.mark.slow
def test_a_second_run_on_a_finished_run_changes_no_byte(run):
    """The command line itself (a real process): one line, exit 2, the finished run byte-identical."""
    before = snapshot(run)
    p = subprocess.run([sys.executable, str(HERE / "brorl.py"), "--out", str(run), "--lr", "-1e-3"],
                       capture_output=True, text=True, cwd=HERE)
    assert "holds a run" in one_line(p.returncode, p.stderr) and snapshot(run) == before


@pytest.mark.slow
def test_one_process_holds_a_run_directory_and_a_stale_lock_is_reclaimed(tmp_path, capsys):
    """Another process holding --out's lock (as a run in progress does): this run is refused before it
    writes anything. Once that process is killed its lock is stale: the next run reclaims it, with a line."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from pathlib import Path; from lib.rundir import RunLock; "
         "out = Path(sys.argv[1]); out.mkdir(); RunLock(out, print).take(); print('held', flush=True); sys.stdin.read()",
         str(out)], cwd=HERE, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        args = ["--out", str(out), "--steps", "1", "--eval_every", "1", *TINY]
        line = one_line(*run_in_process(capsys, *args))
        assert f"--out {out}: another run (pid {holder.pid}) is using it" in line, line
        assert snapshot(out) == {".lock": f"{holder.pid}\n".encode()}
    finally:
        holder.kill()
        holder.wait()
    rows = brorl.train(brorl.parse_config(args))
    assert f"reclaimed the lock of pid {holder.pid}, which is gone" in capsys.readouterr().out
    assert [r["step"] for r in rows] == [0, 1] and not (out / ".lock").exists()  # a finished run leaves no lock


class Crash(Exception):
    pass


@pytest.mark.slow
def test_a_crash_between_the_checkpoints_two_renames_then_resume_is_the_uninterrupted_run(tmp_path, capsys, monkeypatch):
    """Killed after ckpt -> ckpt.old and before ckpt.tmp -> ckpt (the save's swap): no ckpt/, both others
    whole. --resume takes ckpt.tmp, says so, and ends where the uninterrupted run ends, to the bit."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "3", "--eval_every", "1", "--kl_coef", "1e-3", "--ref_reset_every", "2", "--device", "cpu", *TINY]
    rows_a = brorl.train(brorl.parse_config([*common, "--out", str(a)]))
    replace = checkpoint.os.replace

    def crash_in_the_swap(src, dst):
        if Path(src).name == "ckpt.tmp" and (Path(dst).parent / "ckpt.old").exists():
            raise Crash
        replace(src, dst)
    monkeypatch.setattr(checkpoint.os, "replace", crash_in_the_swap)
    with pytest.raises(Crash):  # the second checkpoint (step 2) is the first with a previous one to swap out
        brorl.train(brorl.parse_config([*common, "--out", str(b)]))
    monkeypatch.setattr(checkpoint.os, "replace", replace)
    assert not (b / "ckpt").exists() and {"ckpt.old", "ckpt.tmp"} <= set(p.name for p in b.iterdir())
    capsys.readouterr()
    rows_b = brorl.train(brorl.parse_config(["--resume", str(b), "--steps", "3"]))
    assert "no ckpt/ (a crash inside its save); took the whole ckpt.tmp/ as ckpt/" in capsys.readouterr().out
    assert strip(rows_b) == strip(rows_a) and same_weights(a, b)
    assert sorted(p.name for p in b.iterdir()) == ["ckpt", "config.json", "metrics.jsonl", "metrics.png", "samples.jsonl"]


@pytest.mark.slow
def test_resume_after_a_cut_short_metrics_line_is_the_uninterrupted_run(run, tmp_path, capsys):
    """A last line of metrics.jsonl cut short (the disk filled as it was written) is dropped with a line,
    and the run continues exactly as if it had never been cut."""
    a = tmp_path / "a"
    rows_a = brorl.train(brorl.parse_config(["--steps", "3", "--eval_every", "2", "--out", str(a), *TINY]))
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward_mean": 0.4')
    capsys.readouterr()
    rows_b = brorl.train(brorl.parse_config(["--resume", str(run), "--steps", "3"]))
    assert f"dropped the last line of {run / 'metrics.jsonl'}, cut short" in capsys.readouterr().out
    assert strip(rows_b) == strip(rows_a) and same_weights(a, run)
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3]


def test_a_full_disk_is_one_line_and_keeps_the_last_checkpoint(run, capsys, monkeypatch):
    """ENOSPC while the checkpoint of step 4 is written: one line naming the directory, ckpt/ still the
    step-2 checkpoint byte for byte, no ckpt.tmp left."""
    before = snapshot(run / "ckpt")

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch, "save", full)
    code, err = run_in_process(capsys, "--resume", str(run), "--steps", "4")
    assert code == 2 and "Traceback" not in err
    assert last_line(err) == (f"error: no space left on {run}: the checkpoint of step 4 was not "
                              "written; ckpt/ keeps the last one (--resume continues from it)")
    assert snapshot(run / "ckpt") == before and not (run / "ckpt.tmp").exists()


@pytest.mark.slow
def test_a_full_disk_at_the_first_checkpoint_says_the_run_starts_over(tmp_path, capsys,
                                                                      monkeypatch):
    """ENOSPC as the first checkpoint is written: the line says there is no earlier one and that
    --resume starts over, which it then does, ending where the uninterrupted run ends."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "2", "--eval_every", "1", *TINY]
    rows_a = brorl.train(brorl.parse_config([*common, "--out", str(a)]))
    save = torch.save

    def full(obj, path, *args, **kwargs):
        if Path(path).name == "trainer_state.part":
            raise OSError(errno.ENOSPC, "No space left on device")
        return save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", full)
    code, err = run_in_process(capsys, *common, "--out", str(b))
    assert code == 2 and last_line(err) == (
        f"error: no space left on {b}: the checkpoint of step 1 was not written; there is no "
        f"earlier one (--resume {b} starts the run over from step 0)")
    monkeypatch.setattr(torch, "save", save)
    assert strip(brorl.train(brorl.parse_config(["--resume", str(b)]))) == strip(rows_a)
    assert same_weights(a, b)


@pytest.mark.slow
def test_ctrl_c_is_one_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C in the middle of step 2: exit status 130 and one line saying what is kept; the step-1
    checkpoint is whole and --resume continues from it."""
    out = tmp_path / "run"
    rl_step = brorl.rl_step

    def interrupted_at_step_2(*args):
        if args[8] == 2:  # the step
            signal.raise_signal(signal.SIGINT)
        return rl_step(*args)
    monkeypatch.setattr(brorl, "rl_step", interrupted_at_step_2)
    code, err = run_in_process(capsys, "--out", str(out), "--steps", "3", "--eval_every", "1", *TINY)
    assert code == 130 and "Traceback" not in err
    assert last_line(err) == f"interrupted: {out} keeps its last checkpoint, if it has one (--resume {out} continues from it, or from step 0 if none)"
    monkeypatch.setattr(brorl, "rl_step", rl_step)
    assert [r["step"] for r in brorl.train(brorl.parse_config(["--resume", str(out)]))] == [0, 1, 2, 3]


# ----------------------------------------------------------------------------
# Data and the tools


def test_repeated_rows_are_dropped_with_a_count(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    rows = [dict(problem=f"{i}?", answer=str(i)) for i in (1, 2, 2, 3, 1, 1)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    got = setup.load_data(brorl.Config(), "--task", f"math:{path}", "all", 0)
    assert [r["answer"] for r in got] == ["1", "2", "3"]
    assert f"--task math:{path}: dropped 3 duplicated rows of 6 (all split)" in capsys.readouterr().out


def test_an_overlapping_eval_task_is_said_when_allowed(capsys):
    train = [dict(prompt=p, answer="1") for p in "abc"]
    held = [dict(prompt=p, answer="1") for p in "bcd"]
    setup.check_overlap(brorl.Config(eval_task="math:x", eval_overlap=True), train, held)
    assert "--eval_task math:x: 2 of its 3 prompts are in --task's training set (allowed by --eval_overlap)" in capsys.readouterr().out
    setup.check_overlap(brorl.Config(eval_task="math:x"), train, held[2:])  # none shared: nothing to say
    assert capsys.readouterr().out == ""


def test_resume_takes_one_directory_spelled_two_ways(finished, monkeypatch):
    """--out spelled relative to the working directory, --resume absolute: one run, not two."""
    monkeypatch.chdir(finished.parent)
    cfg = brorl.parse_config(["--resume", str(finished), "--out", f"./{finished.name}/", "--steps", "2"])
    assert Path(cfg.out).resolve() == finished.resolve()


def test_ablate_reads_values_before_comparing_and_fails_when_a_run_crashed(capsys):
    from tools import ablate
    with pytest.raises(ValueError, match="the same config twice"):
        ablate.parse_grid([["lr=1e-4,0.0001"]])
    with pytest.raises(ValueError, match="the same config twice"):
        ablate.parse_grid([["save=true,1"]])
    assert len(ablate.parse_grid([["lr=1e-4,2e-4"]])) == 2
    assert ablate.exit_status({"configs": {"a": {"crashed": {}}, "b": {"crashed": {0: "exit 2: ..."}}}}) == 1
    assert capsys.readouterr().err.strip() == "error: 1 run(s) crashed (listed in the summary; rerun the command to retry them)"
    assert ablate.exit_status({"configs": {"a": {"crashed": {}}}}) == 0


@pytest.mark.parametrize("main, argv, needle", [
    ("bench", ["--repeats", "0"], "--repeats 0: need >= 1"),
    ("bench", ["--threads", "-2"], "--threads -2: need >= 1"),
    ("bench", ["--micro_batch", "x"], "invalid int value: 'x'"),
    ("data", ["build", "--p_correct", "1.5"], "--p_correct: need a probability in [0, 1]"),
    ("data", ["build", "--lr=-1e-3"], "--lr: need a finite lr > 0"),
    ("data", ["build", "--digits", "0"], "--digits: need 1..20"),
    ("data", ["build", "--slips", "nope"], "--slips: unknown ['nope']"),
    ("data", ["rehearsal", "--layers", "0", "--out", "x"], "--layers 0: need >= 1"),
    ("ablate", ["--jobs", "0"], "--jobs 0: need >= 1"),
])
def test_the_tools_check_their_numbers(capsys, main, argv, needle):
    from tools import ablate, bench
    with pytest.raises(SystemExit) as exit_info:
        {"bench": bench.main, "data": data.main, "ablate": ablate.main}[main](argv)
    assert needle in one_line(exit_info.value.code, capsys.readouterr().err)


def raw_file(text: str, where: str = "keys/N=16"):
    def write(raw: Path):
        (raw / where).mkdir(parents=True)
        (raw / where / "seed0.jsonl").write_text(text)
    return write


STUDIES = [  # (study, flags, what is in --raw, the one line's needle)
    ("allocation_study", ["--budget", "0"], None, "--budget 0.0: need a finite number > 0"),
    ("allocation_study", ["--budget", "-5"], None, "--budget -5.0: need a finite number > 0"),
    ("allocation_study", ["--budget", "nan"], None, "--budget nan: need a finite number > 0"),
    ("allocation_study", ["--jobs", "0"], None, "--jobs 0: need >= 1"),
    ("allocation_study", [], raw_file(""), "seed0.jsonl: empty, not a run's rows"),
    ("allocation_study", [], raw_file('{"step": 0}\n{"step": 1, "re'),
     "seed0.jsonl: line 2 is not a metrics row (cut short?)"),
    ("allocation_study", ["--report"], None, "no raw files of this study to report on"),
    ("theorem1_study", ["--cap", "nan"], None, "--cap nan: need a finite number > 0"),
    ("theorem1_study", ["--cap", "0"], None, "--cap 0.0: need a finite number > 0"),
    ("theorem1_study", ["--steps_iso", "2"], None, "--steps_iso 2: need >= 4"),
    ("theorem1_study", ["--report"], None, "no raw files of this study to report on"),
    ("theorem1_study", [], raw_file('{"step": 3}\n'), "starts at step 3, not 0"),
    ("theorem1_study", ["--raw", "{tmp}/file"], None, "--raw {tmp}/file: cannot make it"),
    ("theorem1_study", ["--report"], lambda raw: (raw_file('{"step": 0}\n', "nalone/N=16,B=8")(raw),
                                                  (raw / "report.md").mkdir()),
     "--raw {tmp}/raw: {tmp}/raw/report.md is not a writable file"),
    ("allocation_study", ["--report", "--raw", "{tmp}/gone"], None,
     "--raw {tmp}/gone: no raw files of this study to report on"),
    ("theorem1_study", ["--report", "--raw", "{tmp}/gone"], None,
     "--raw {tmp}/gone: no raw files of this study to report on"),
    ("allocation_study", ["--out", "{tmp}/file"], None, "--out {tmp}/file: cannot make it"),
    ("allocation_study", ["--report"], raw_file('{"step": 0}\n'),
     "keys/N=16/seed0.jsonl holds no row with the exact Q (mass_exact_mean): not a run of this study"),
]


@pytest.mark.parametrize("study, flags, raw, needle", STUDIES,
                         ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_the_studies_check_their_flags_and_raw_files_before_any_run(tmp_path, capsys, monkeypatch,
                                                                    study, flags, raw, needle):
    """A budget or cap that is not a finite number > 0, a raw file that is not a whole run's rows,
    a report over nothing: one line, before any run starts."""
    from tools import allocation_study, theorem1_study
    from tools import study as skeleton
    monkeypatch.setattr(skeleton, "run_to_raw", lambda *a: pytest.fail("a run started"))
    (tmp_path / "raw").mkdir()
    (tmp_path / "file").write_text("")
    if raw:
        raw(tmp_path / "raw")
    main = dict(allocation_study=allocation_study.main, theorem1_study=theorem1_study.main)[study]
    with pytest.raises(SystemExit) as exit_info:
        main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "out"),
              *[f.format(tmp=tmp_path) for f in flags]])
    line = one_line(exit_info.value.code, capsys.readouterr().err)
    assert needle.format(tmp=tmp_path) in line, line
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


# ----------------------------------------------------------------------------
# Small training sets, prompts past the model's context, a resumed run's config, a checkpoint that
# cannot be written, and the ways out of a run directory


# a math prompt is longer than the embedded model's 64 positions: kept, said
SMALL = [*TINY, "--long_prompts", "allow", "--max_rounds", "2"]


def gsm8k_set(path: Path, train: int, test: int = 0, long: int = 0) -> str:
    """--task of a gsm8k file holding `train` rows of the training split and `test` of the held-out
    one (data.split_of decides each by its text), and `long` more training rows of ~5,200
    characters."""
    rows, want = {"train": [], "test": []}, {"train": train, "test": test}
    for a in range(100, 10_000):
        q = f"{a}+7=" if a < 9_000 else f"{a}+" + "7" * 5_200 + "="  # (the long ones last)
        split = data.split_of(f"{q} {data.MATH_SUFFIX}")
        if len(rows[split]) < want[split] + (long if split == "train" and a >= 9_000 else 0):
            if a < 9_000 or split == "train":
                rows[split].append(dict(question=q, answer=f"#### {a + 7}"))
    path.write_text("".join(json.dumps(r) + "\n" for r in rows["train"] + rows["test"]))
    assert len(data.load_task(f"gsm8k:{path}", "train")) == train + long
    return f"gsm8k:{path}"


def held_out_set(tmp: Path) -> list:
    """--eval_task of a separate 4-row file (no prompt of gsm8k_set's training rows)."""
    return ["--eval_task", gsm8k_set(tmp / "held.jsonl", 0, 4)]


@pytest.mark.parametrize("separate_eval", [False, True], ids=["test split", "--eval_task"])
def test_a_training_set_smaller_than_b_is_one_line(tmp_path, capsys, separate_eval):
    task = gsm8k_set(tmp_path / "three.jsonl", 3, 0 if separate_eval else 4)
    held = held_out_set(tmp_path) if separate_eval else []
    out = tmp_path / "run"
    flags = ["--task", task, *held, *SMALL, "--prompts_per_step", "4", "--out", str(out)]
    line = one_line(*run_in_process(capsys, *flags))
    assert line == (f"error: --task {task}: its training set holds 3 prompt(s), fewer than "
                    "--prompts_per_step 4 (a step trains on B distinct prompts)")
    assert not out.exists()


@pytest.mark.parametrize("rows, separate_eval", [(7, False), (7, True), (2, True)],
                         ids=["7 rows", "7 rows, --eval_task", "B rows, --eval_task"])
@pytest.mark.slow
def test_a_small_training_set_trains_and_resumes_exactly(tmp_path, rows, separate_eval):
    """A round asks for up to 4B prompts (8 here): it draws at most the whole set, and the run, cut
    after its step-2 checkpoint, resumes to the uninterrupted run's rows and weights."""
    task = gsm8k_set(tmp_path / "train.jsonl", rows, 0 if separate_eval else 4)
    flags = ["--task", task, *(held_out_set(tmp_path) if separate_eval else []), *SMALL,
             "--eval_every", "2"]
    a, b = tmp_path / "a", tmp_path / "b"
    rows_a = brorl.train(brorl.parse_config([*flags, "--steps", "3", "--out", str(a)]))
    brorl.train(brorl.parse_config([*flags, "--steps", "2", "--out", str(b)]))
    rows_b = brorl.train(brorl.parse_config(["--resume", str(b), "--steps", "3"]))
    assert [r["step"] for r in rows_a] == [0, 1, 2, 3]
    assert strip(rows_b) == strip(rows_a) and same_weights(a, b)
    # a round draws the set at most; with 7 rows, one asked for 8 (4B) and drew 7
    assert all(r["samples"] <= 16 * rows * r["sample_rounds"] for r in rows_a[1:])
    assert any(r["samples"] > 4 * 16 for r in rows_a[1:]) == (rows > 4)


def wide_model(tmp: Path) -> Path:
    """The embedded model with 200 positions in its config (rotary: the same weights), so that a
    math prompt fits it and a 5,200-character one does not."""
    shutil.copytree(data.EMBEDDED_MODEL, tmp / "wide")
    config = json.loads((tmp / "wide" / "config.json").read_text())
    config["max_position_embeddings"] = 200
    (tmp / "wide" / "config.json").write_text(json.dumps(config))
    return tmp / "wide"


@pytest.mark.slow
def test_a_prompt_past_the_context_is_one_line_or_dropped_with_a_count(tmp_path, capsys):
    task = gsm8k_set(tmp_path / "long.jsonl", 7, 4, long=1)
    flags = ["--task", task, "--model", str(wide_model(tmp_path)), *TINY, "--steps", "1"]
    out = tmp_path / "run"
    line = one_line(*run_in_process(capsys, *flags, "--out", str(out)))
    assert line.startswith(f"error: --task {task}: training row 7 ('9") and not out.exists()
    assert line.endswith("tokens: + 6 new > the model's 200 positions, as are 0 more "
                         "(--long_prompts drop drops them, allow keeps them)"), line
    rows = brorl.train(brorl.parse_config([*flags, "--long_prompts", "drop", "--out", str(out)]))
    said = capsys.readouterr().out
    assert f"--task {task}: training 1 of 8 rows are longer than the model's 200 positions" in said
    assert "dropped (--long_prompts drop)" in said and [r["step"] for r in rows] == [0, 1]


@pytest.mark.parametrize("template", [None, "{% for m in messages %}<|pad|>{{ m['content'] | trim }}"
                                      "\n{% endfor %}{% if add_generation_prompt %}>{% endif %}"],
                         ids=["plain", "chat template"])
def test_the_context_check_measures_few_rows_and_decides_as_measuring_all(template):
    """The context check bounds each prompt's tokens from its bytes and measures only the rows a
    bound cannot decide: the rows past the context and the longest prompt are those of every row
    measured, on short, long, non-ASCII and special-token rows, with and without a chat template."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(data.EMBEDDED_MODEL)
    tok.chat_template = template
    gen = torch.Generator().manual_seed(0)
    words = ["7+8=", "ünïcode ", " x", "∑ 12 ", "  ", "\n"]
    rows = [dict(prompt="".join(words[i] for i in torch.randint(len(words), (int(n),), generator=gen)))
            for n in torch.randint(1, 40, (600,), generator=gen)]
    for r in rows[::10]:  # a special token's text is one token
        r["prompt"] += "<|endoftext|>" * 3
    exact = setup.prompt_lengths(tok, rows)
    lengths = setup.PromptLengths(tok, rows, "")
    assert all(lo <= n <= hi for lo, n, hi in zip(lengths.lo, exact, lengths.hi))  # the bounds
    for limit in (0, 20, 50, 90, 400):
        assert lengths.over(limit) == [i for i, n in enumerate(exact) if n > limit]
    assert lengths.longest(range(len(rows))) == max(exact)
    kept = [i for i in range(len(rows)) if exact[i] <= 50]
    assert lengths.longest(kept) == max(exact[i] for i in kept)
    if template is None:  # a byte-level vocabulary and no template: most rows never tokenized
        fresh = setup.PromptLengths(tok, rows, "")
        fresh.over(50), fresh.longest(range(len(rows)))
        assert len(fresh.exact) < len(rows) // 2, len(fresh.exact)


def test_the_planner_plans_for_the_longest_prompt_not_a_sample(capsys):
    from transformers import AutoConfig, AutoTokenizer
    rows = [dict(prompt=f"{i}+{i}=") for i in range(2000)] + [dict(prompt="1" * 300)]
    tok = AutoTokenizer.from_pretrained(data.EMBEDDED_MODEL)
    model_config = AutoConfig.from_pretrained(data.EMBEDDED_MODEL)
    plan.plan_memory(brorl.Config(memory_gb=8), model_config, tok, rows, torch.device("cpu"),
                      report_only=True)
    assert "prompts up to 300 tokens" in capsys.readouterr().out


@pytest.mark.slow
def test_plan_measures_the_held_out_prompts_as_the_run_does(tmp_path, capsys):
    """--plan plans for the longest prompt of the training and the held-out sets, as the run
    does: a long held-out row counts."""
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(dict(question=q, answer="#### 1")) + "\n"
                            for q in ("1+0=", "2" * 3000 + "+1=")))
    flags = ["--task", gsm8k_set(tmp_path / "train.jsonl", 8), "--eval_task", f"gsm8k:{held}",
             "--long_prompts", "allow", "--memory_gb", "8"]
    plan.plan(brorl.parse_config([*TINY, *flags, "--plan"]))
    planned = capsys.readouterr().out
    brorl.train(brorl.parse_config([*TINY, *flags, "--steps", "0", "--out", str(tmp_path / "r")]))
    run = capsys.readouterr().out
    tokens = lambda out: next(line.split("prompts up to ")[1].split(" tokens")[0]
                              for line in out.splitlines() if "prompts up to " in line)
    assert int(tokens(planned)) > 3000 // 8 and tokens(planned) == tokens(run)


def drop_field(name: str):
    """A run's config.json without one field (an edit, or a run older than the field)."""
    def drop(run: Path):
        config = json.loads((run / "config.json").read_text())
        (run / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != name}))
    return drop


ON_A_RUN += [
    (drop_field("max_new_tokens"), ["--resume", "{run}", "--steps", "3"],
     "its config.json lacks max_new_tokens (edited, or older than the field): "
     "give the run's value"),
    (drop_field("clip_ratio_c"), ["--resume", "{run}", "--steps", "3"], "lacks clip_ratio_c"),
    (lambda run: os.symlink(run / "nowhere", run / "link"), ["--out", "{run}/link", "--steps", "1"],
     "/link: a symlink to"),
    (None, ["--model", "{run}/ckpt", "--seed", "99999999999999999999", "--out", "{run}/new"],
     "--seed 99999999999999999999, --eval_seed 0: need |seed| < 2**63"),
]


@pytest.mark.slow
def test_a_field_older_runs_lack_is_said_and_recorded(run, capsys):
    """A config.json without --tis_cap (a run older than TIS): resumed with the value that
    reproduces the code before it, said in the first lines, recorded in config_history.jsonl."""
    drop_field("tis_cap")(run)
    brorl.train(brorl.parse_config(["--resume", str(run), "--steps", "3"]))
    said = capsys.readouterr().out.splitlines()
    assert said[0] == (f"--resume {run}: its config.json lacks --tis_cap (taken as 0.0); "
                       "config_history.jsonl records it as the run starts")
    history = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert history == [dict(step=2, was={"steps": 2}, now={"steps": 3, "tis_cap": 0.0},
                            absent=["tis_cap"])]
    assert json.loads((run / "config.json").read_text())["tis_cap"] == 0.0


@pytest.mark.slow
def test_a_flag_that_changes_a_resumed_run_is_said_and_kept(run, capsys):
    brorl.train(brorl.parse_config(["--resume", str(run), "--steps", "3", "--n_rollouts", "8"]))
    said = capsys.readouterr().out.splitlines()
    assert said[0] == (f"--resume {run}: --n_rollouts 16 -> 8, --steps 2 -> 3 from its checkpoint "
                       "on (config_history.jsonl records it as the run starts)")
    history = [json.loads(x) for x in (run / "config_history.jsonl").read_text().splitlines()]
    assert history == [dict(step=2, was={"n_rollouts": 16, "steps": 2},
                            now={"n_rollouts": 8, "steps": 3}, absent=[])]


def refuse(name: str, err: int):
    """os.replace raising OSError(err) when it would move `name` (as an immutable ckpt/ does)."""
    replace = os.replace

    def replace_unless(src, dst):
        if Path(src).name == name:
            raise OSError(err, os.strerror(err), str(src))
        replace(src, dst)
    return replace_unless


@pytest.mark.parametrize("how, needle", [
    ("ckpt", "cannot swap the new checkpoint in (Operation not permitted: "),
    ("ckpt.tmp", "cannot swap the new checkpoint in (Permission denied: "),
    ("torch.save", "cannot write in {run} (Read-only file system)"),
    ("ckpt.old", "cannot swap the new checkpoint in (Not a directory: "),  # a file in the way
])
def test_every_failure_of_a_checkpoint_is_one_line_and_keeps_the_last(run, capsys, monkeypatch, how,
                                                                       needle):
    before = snapshot(run / "ckpt")
    if how == "ckpt":
        monkeypatch.setattr(checkpoint.os, "replace", refuse("ckpt", errno.EPERM))
    elif how == "ckpt.tmp":  # the second rename: the previous checkpoint is put back
        monkeypatch.setattr(checkpoint.os, "replace", refuse("ckpt.tmp", errno.EACCES))
    elif how == "torch.save":  # a file system turned read-only under the run
        def read_only(*args, **kwargs):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        monkeypatch.setattr(torch, "save", read_only)
    else:
        (run / "ckpt.old").write_text("someone's file")
    code, err = run_in_process(capsys, "--resume", str(run), "--steps", "4")
    assert code == 2 and "Traceback" not in err, err[-2000:]
    line = last_line(err)
    assert needle.format(run=run) in line and line.endswith(
        "the checkpoint of step 4 was not written; ckpt/ keeps the last one "
        "(--resume continues from it)"), line
    assert snapshot(run / "ckpt") == before and not (run / "ckpt.tmp").exists()
    assert (run / "ckpt.old").is_file() == (how == "ckpt.old")


@pytest.mark.parametrize("left", ["all but ckpt/", "config.json alone"])
@pytest.mark.parametrize("eval_only", [False, True], ids=["train", "--eval_only"])
def test_a_run_directory_with_no_checkpoint_as_model_is_one_line(run, tmp_path, capsys, eval_only,
                                                                 left):
    """A run directory without its checkpoint (even one holding only the run's config.json, which
    is not a model's) as --model: one line, nothing written."""
    shutil.rmtree(run / "ckpt")
    if left == "config.json alone":
        for path in run.iterdir():
            if path.name != "config.json":
                shutil.rmtree(path) if path.is_dir() else path.unlink()
    out = tmp_path / "new"
    line = one_line(*run_in_process(capsys, "--model", str(run), *["--eval_only"] * eval_only,
                                    "--out", str(out), *TINY))
    assert line == (f"error: --model {run}: the run holds no ckpt/ "
                    "(--save 0, or stopped before its first eval)")
    assert not out.exists()


@pytest.mark.slow
def test_a_run_stopped_before_its_first_checkpoint_resumes_from_step_0(tmp_path, capsys,
                                                                       monkeypatch):
    """--steps 0, and a run that crashed at step 2 before its first checkpoint (step 3): no
    checkpoint, so --resume starts each over from step 0, said, and ends where the uninterrupted
    run ends."""
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    common = ["--eval_every", "3", *TINY]
    rows_a = brorl.train(brorl.parse_config([*common, "--steps", "3", "--out", str(a)]))
    brorl.train(brorl.parse_config([*common, "--steps", "0", "--out", str(b)]))
    rl_step = brorl.rl_step

    def crash_at_step_2(*args):
        if args[8] == 2:
            raise Crash
        return rl_step(*args)
    monkeypatch.setattr(brorl, "rl_step", crash_at_step_2)
    with pytest.raises(Crash):
        brorl.train(brorl.parse_config([*common, "--steps", "3", "--out", str(c)]))
    monkeypatch.setattr(brorl, "rl_step", rl_step)
    for run in (b, c):
        capsys.readouterr()
        rows = brorl.train(brorl.parse_config(["--resume", str(run), "--steps", "3"]))
        assert (f"--resume {run}: no checkpoint yet (stopped before its first, or --steps 0); "
                "starting it over from step 0 with its config.json") in capsys.readouterr().out
        assert strip(rows) == strip(rows_a) and same_weights(a, run)
        assert len((run / "samples.jsonl").read_text()) == len((a / "samples.jsonl").read_text())


@pytest.mark.slow
def test_a_kill_as_the_first_eval_row_appears_resumes_to_the_uninterrupted_run(tmp_path):
    """SIGKILL the moment metrics.jsonl shows step 1 evaluated (a real kill, in another process):
    the row lands after its checkpoint, so --resume continues from step 1 and ends where the
    uninterrupted run ends, row for row, time aside, and samples.jsonl byte for byte."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "3", "--eval_every", "1", *TINY]
    rows_a = brorl.train(brorl.parse_config([*common, "--out", str(a)]))
    # The other process at this one's thread count: the two runs must round alike (at 1 thread
    # against 2 they part at the 7th digit on some CPUs).
    threads = str(torch.get_num_threads())
    env = {**os.environ, "OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1"}
    p = subprocess.Popen([sys.executable, str(HERE / "brorl.py"), *common, "--out", str(b)],
                         cwd=HERE, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def evaluated_step_1() -> bool:
        try:
            lines = (b / "metrics.jsonl").read_text().splitlines()
        except OSError:
            return False
        return any(line.endswith("}") and json.loads(line)["step"] == 1 for line in lines)
    while p.poll() is None and not evaluated_step_1():
        time.sleep(0.002)
    p.kill()
    assert p.wait() == -signal.SIGKILL, "the run ended before the kill"
    rows_b = brorl.train(brorl.parse_config(["--resume", str(b)]))
    assert strip(rows_b) == strip(rows_a) and same_weights(a, b)
    assert strip(json.loads(line) for line in (b / "metrics.jsonl").read_text().splitlines()) \
        == strip(rows_a)
    assert (b / "samples.jsonl").read_bytes() == (a / "samples.jsonl").read_bytes()


@pytest.mark.slow
def test_a_kill_between_a_checkpoint_and_its_row_takes_the_row_from_the_checkpoint(tmp_path,
                                                                                   monkeypatch):
    """Stopped right after the step-2 checkpoint was saved, before its row was written: --resume
    takes the row from the checkpoint and ends where the uninterrupted run ends."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "3", "--eval_every", "2", *TINY]
    rows_a = brorl.train(brorl.parse_config([*common, "--out", str(a)]))
    save = harness.save_atomic

    def crash_after_the_save(model, tok, cfg, state, path):
        save(model, tok, cfg, state, path)
        raise Crash
    monkeypatch.setattr(harness, "save_atomic", crash_after_the_save)
    with pytest.raises(Crash):
        brorl.train(brorl.parse_config([*common, "--out", str(b)]))
    monkeypatch.setattr(harness, "save_atomic", save)
    assert [json.loads(x)["step"] for x in (b / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    rows_b = brorl.train(brorl.parse_config(["--resume", str(b)]))
    assert strip(rows_b) == strip(rows_a) and same_weights(a, b)


SETS = ["--preset", "sets", "--n_rollouts", "8", "--prompts_per_step", "2", "--eval_prompts", "8",
        "--eval_samples", "2", "--answer_prompts", "4", "--probe_prompts", "2", "--probe_samples", "4",
        "--eval_every", "1"]


@pytest.fixture(scope="module")
def sets_run(tmp_path_factory) -> Path:
    """A finished 1-step sets run whose evals saved their answer distributions."""
    run = tmp_path_factory.mktemp("sets") / "run"
    brorl.train(brorl.parse_config([*SETS, "--steps", "1", "--out", str(run)]))
    return run


def no_probe_reference(run: Path):
    path = run / "ckpt" / "trainer_state.pt"
    torch.save({**torch.load(path, weights_only=True), "q_start": None}, path)


FIRST = "answers/step-000000.pt"
LOST_REFERENCE = [  # (how the run is broken, what the one line says)
    (lambda run: (run / FIRST).unlink(), f"{FIRST} is missing; it is the first eval's answer"),
    (lambda run: cut(run / FIRST), f"{FIRST} is unreadable"),
    (lambda run: torch.save({"prompts": [], "logp": torch.zeros(1, 900)}, run / FIRST),
     f"{FIRST} is not the distribution of this run's --answer_prompts prompts"),
    (no_probe_reference, "its checkpoint's step-0 probe Q (trainer_state.pt's q_start) is missing"),
]


@pytest.mark.parametrize("breaking, needle", LOST_REFERENCE, ids=["gone", "cut", "other", "probe"])
def test_resume_refuses_a_lost_reference_of_the_first_eval(sets_run, tmp_path, capsys, breaking,
                                                           needle):
    """A measure against the first eval (the answer distributions, the probe's Q) whose reference
    is gone would compare with the current eval in silence: --resume is one line, before any
    write."""
    run = tmp_path / "run"
    shutil.copytree(sets_run, run)
    breaking(run)
    before = snapshot(run)
    line = one_line(*run_in_process(capsys, "--resume", str(run), "--steps", "2"))
    assert line.startswith(f"error: --resume {run}: ") and needle in line, line
    assert snapshot(run) == before


IN_THE_WAY = [  # (what is in the way, the one line's reason)
    (lambda run: (run / "config_history.jsonl").mkdir(),
     "a directory where a file is written: {run}/config_history.jsonl"),
    (lambda run: (run / "metrics.png").unlink() or (run / "metrics.png").mkdir(),
     "a directory where a file is written: {run}/metrics.png"),
    ("answers", "not writable: {run}/answers"),  # chattr +i, or a read-only folder
    ("samples.jsonl", "not writable: {run}/samples.jsonl"),
]


@pytest.mark.parametrize("breaking, reason", IN_THE_WAY,
                         ids=["history-dir", "plot-dir", "answers-ro", "samples-ro"])
def test_a_file_the_run_cannot_write_is_one_line_before_any_write(sets_run, tmp_path, capsys,
                                                                  monkeypatch, breaking, reason):
    """A file or folder of the run that cannot be written (a name in the way, immutable, read-only)
    is named in one line before anything is written; the run directory is left byte for byte."""
    run = tmp_path / "run"
    shutil.copytree(sets_run, run)
    if isinstance(breaking, str):
        access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p).name != breaking
                            and access(p, mode))
    else:
        breaking(run)
    before = snapshot(run)
    line = one_line(*run_in_process(capsys, "--resume", str(run), "--steps", "2"))
    assert line == (f"error: cannot write in {run} ({reason.format(run=run)}): the run did not start; "
                    "nothing was written"), line
    assert {k: v for k, v in snapshot(run).items() if k != ".lock"} == before  # (held till exit)


def test_a_file_named_as_the_answers_folder_is_one_line_before_any_write(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "answers").write_text("")
    line = one_line(*run_in_process(capsys, *SETS, "--steps", "1", "--out", str(out)))
    assert line == (f"error: cannot write in {out} (a file where a folder is written: "
                    f"{out}/answers): the run did not start; nothing was written"), line
    assert sorted(p.name for p in out.iterdir()) == [".lock", "answers"]  # (the lock: till exit)


@pytest.mark.slow
def test_a_full_disk_while_writing_answers_is_one_line_and_leaves_no_temp(sets_run, tmp_path,
                                                                          capsys, monkeypatch):
    """The disk fills while answers/step-000002.pt is written (torch's zip writer): one line naming
    the file, no temp file left, and --resume then finishes as the uninterrupted run."""
    a, run = tmp_path / "a", tmp_path / "run"
    rows_a = brorl.train(brorl.parse_config([*SETS, "--steps", "2", "--out", str(a)]))
    shutil.copytree(sets_run, run)
    save = torch.save

    def full(obj, path, *args, **kwargs):
        if str(path).endswith("step-000002.pt.tmp"):
            Path(path).write_bytes(b"PK" * 700)
            raise RuntimeError("[enforce fail at inline_container.cc:595] . unexpected pos 1472 vs 1366")
        return save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", full)
    code, err = run_in_process(capsys, "--resume", str(run), "--steps", "2")
    assert code == 2 and "Traceback" not in err
    assert last_line(err) == (f"error: no space left on {run}: answers/step-000002.pt and step 2's "
                              f"row were not written; --resume {run} continues from its last "
                              "checkpoint, or from step 0 if none")
    assert not list(run.rglob("*.tmp")) and not (run / "answers" / "step-000002.pt").exists()
    monkeypatch.setattr(torch, "save", save)
    assert strip(brorl.train(brorl.parse_config(["--resume", str(run)]))) == strip(rows_a)
    assert (run / "samples.jsonl").read_bytes() == (a / "samples.jsonl").read_bytes()


@pytest.mark.slow
def test_a_full_disk_while_appending_samples_is_one_line_and_resumes_exactly(tmp_path, capsys,
                                                                            monkeypatch):
    """The disk fills as step 2's samples are appended (before its checkpoint): one line naming
    the files, and --resume redoes step 2 from step 1's checkpoint to the uninterrupted run."""
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--steps", "3", "--eval_every", "1", *TINY]
    rows_a = brorl.train(brorl.parse_config([*common, "--out", str(a)]))
    append = samples.append

    def full(path, step, records):
        if step == 2:
            with open(path, "a") as f:
                f.write('{"step": 2, "kind": "ev')  # cut short, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device")
        append(path, step, records)
    monkeypatch.setattr(samples, "append", full)
    code, err = run_in_process(capsys, *common, "--out", str(b))
    assert code == 2 and "Traceback" not in err
    assert last_line(err) == (f"error: no space left on {b}: samples.jsonl and metrics.jsonl lack "
                              f"step 2; --resume {b} continues from its last checkpoint, or from "
                              "step 0 if none")
    monkeypatch.setattr(samples, "append", append)
    assert strip(brorl.train(brorl.parse_config(["--resume", str(b)]))) == strip(rows_a)
    assert (b / "samples.jsonl").read_bytes() == (a / "samples.jsonl").read_bytes()
    assert same_weights(a, b) and not list(b.rglob("*.tmp"))


def test_a_full_disk_while_writing_the_plot_keeps_the_row(run, capsys, monkeypatch):
    """The disk fills as metrics.png is drawn: one line naming it, the row of the step kept in
    metrics.jsonl, no temp file, and the old plot whole."""
    before = (run / "metrics.png").read_bytes()
    import matplotlib.figure

    def full(self, path, **kwargs):
        Path(path).write_bytes(b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", full)
    code, err = run_in_process(capsys, "--resume", str(run), "--steps", "4")
    assert code == 2 and "Traceback" not in err
    assert last_line(err) == (f"error: no space left on {run}: metrics.png or the dashboards miss "
                              f"step 4, whose row metrics.jsonl holds; --resume {run} continues "
                              "from its last checkpoint, or from step 0 if none")
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
    assert (run / "metrics.png").read_bytes() == before and not list(run.rglob("*.tmp"))


@pytest.mark.slow
def test_the_probe_is_said_and_recorded_as_used(tmp_path, capsys):
    out = tmp_path / "run"
    brorl.train(brorl.parse_config([*TINY, "--probe_prompts", "16", "--eval_prompts", "1",
                                    "--steps", "1", "--out", str(out)]))
    assert ("--probe_prompts 16: the eval set holds 1 prompt(s); it measures those 1 "
            "(config.json says so)") in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["probe_prompts"] == 1


@pytest.mark.slow
def test_the_answer_prompts_are_said_and_recorded_as_used(tmp_path, capsys):
    """--answer_prompts past the eval set measures the eval set: said, and config.json records the
    number measured, as each row holds."""
    out = tmp_path / "run"
    rows = brorl.train(brorl.parse_config([*SETS, "--answer_prompts", "1000", "--eval_prompts", "3",
                                           "--steps", "1", "--out", str(out)]))
    assert ("--answer_prompts 1000: the eval set holds 3 prompt(s); it measures those 3 "
            "(config.json says so)") in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["answer_prompts"] == 3
    assert len(rows[-1]["answers_log10_q_per_prompt"]) == 3


@pytest.mark.parametrize("flags", [["--rollout_budget", "64"], ["--min_rollouts", "8"],
                                   ["--max_rollouts", "64"], ["--alloc_decay", "0.5"]],
                         ids=lambda x: x[0])
def test_an_allocation_flag_without_adaptive_is_one_line(tmp_path, capsys, flags):
    """Flags read only by --alloc adaptive, typed under --alloc uniform, would change nothing: one
    line naming the flag that makes them count; a preset's values are never refused."""
    out = tmp_path / "run"
    line = one_line(*run_in_process(capsys, *TINY, *flags, "--steps", "1", "--out", str(out)))
    assert line.endswith(f"error: {flags[0]} {flags[1]}: counts only with --alloc adaptive "
                         "(this run's --alloc is uniform); drop it, or add --alloc adaptive"), line
    assert not out.exists()
    presets = {"x": dict(min_rollouts=8, alloc_decay=0.5)}
    assert config.parse_config(brorl.Config, "", ["--preset", "x"], presets).min_rollouts == 8


def test_ablate_escapes_a_comma_and_keeps_another_grids_summary(tmp_path, capsys):
    from tools import ablate
    configs = ablate.parse_grid([["lora_targets=q_proj\\,v_proj,q_proj"]])
    assert configs == [{"lora_targets": "q_proj,v_proj"}, {"lora_targets": "q_proj"}]
    labels = [ablate.config_label(c) for c in configs]
    assert labels == ["lora_targets=q_proj+v_proj", "lora_targets=q_proj"]
    stem = tmp_path / "summary"
    old = dict(command="python -m tools.ablate A", configs={"x": 1})
    stem.with_suffix(".json").write_text(json.dumps(old))
    stem.with_suffix(".md").write_text("old")
    ablate.keep_other_summary(stem, "python -m tools.ablate A")  # the same command: replaced
    assert stem.with_suffix(".md").exists() and capsys.readouterr().out == ""
    ablate.keep_other_summary(stem, "python -m tools.ablate B")
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert len(kept) == 2 and all(p.startswith("summary.") and p.count(".") == 2 for p in kept)
    said = capsys.readouterr().out
    assert "held another command's summary (1 configs, `python -m tools.ablate A`): kept as" in said


def test_math_verify_parses_each_gold_once_bounds_a_decided_call_and_never_prints_an_input(
        monkeypatch):
    import logging
    import types
    import verify
    calls = []
    fake = types.ModuleType("math_verify")
    fake.parse = lambda text, parsing_timeout=None: (calls.append((text, parsing_timeout)), text)[1]
    fake.verify = lambda gold, pred, timeout_seconds=None: calls.append(("verify", timeout_seconds))
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    verify._load_math_verify.cache_clear()
    try:
        got = verify.rewards(["\\boxed{1000000!}"] * 3, ["42"] * 3, verifier="both", workers=1)
        assert got == [0.0] * 3
        golds = [t for t, _ in calls if t == "\\boxed{42}"]
        assert len(golds) == 1  # once, not once a rollout
        assert {t for _, t in calls[1:]} == {verify.MV_DECIDED_TIMEOUT_S}  # the rules read 42
        assert verify.MV_DECIDED_TIMEOUT_S < verify.MV_TIMEOUT_S
        calls.clear()
        verify.reward("\\boxed{x+1}", "x+2", verifier="both")  # a symbolic gold keeps the default
        assert {t for _, t in calls} == {verify.MV_TIMEOUT_S}
        calls.clear()
        assert verify.reward("\\boxed{" + "9" * 2000 + "}", "x+2", verifier="both") == 0.0
        assert not calls  # an answer past MAX_ANSWER is none
    finally:
        verify._load_math_verify.cache_clear()
    record = logging.LogRecord("math_verify.parser", logging.WARNING, "", 0,
                               "Timeout during parsing: %s", ("7" * 1_000_000,), None)
    verify._shorten_log(record)
    assert len(record.getMessage()) < 300 and record.getMessage().endswith("characters)")


def test_the_fields_resume_knows_are_configs():
    """A field renamed or removed from Config leaves none of the resume policy's lists naming it."""
    from lib import resume
    fields = {f.name for f in dataclasses.fields(brorl.Config)}
    assert set(resume.FIELDS_SINCE_RESUME) | set(resume.ADDED_FIELDS) <= fields
    assert set(resume.FIXED_ON_RESUME) <= fields


# ----------------------------------------------------------------------------
# A resumed run's config.json typed as the command line types it; --train_prompts; --eval_only's
# idle flags; a model directory that is neither a model's nor a run's; a write the file system
# refuses (chattr +i)


def wrong_kinds(kind) -> list:
    """Values of another kind than a field's (JSON's true is an int to Python: "lr": true would
    train at lr 1.0)."""
    return {float: [True, "0.1", None, [1]], int: [True, "3", 2.5, None], bool: [1, "true", None],
            str: [5, True, None, 1.5]}[kind]


def test_every_field_of_config_json_of_another_kind_is_one_line(run, capsys):
    """Every field of a run's config.json, given a value of each other kind: --resume refuses it in
    one line naming the field, before any write; an integer where a float belongs is that float."""
    text = (run / "config.json").read_text()
    config_json, before, tried = json.loads(text), snapshot(run), 0
    for f in dataclasses.fields(brorl.Config):
        for value in wrong_kinds(f.type):
            (run / "config.json").write_text(json.dumps({**config_json, f.name: value}))
            with pytest.raises(SystemExit) as exit_info:
                brorl.parse_config(["--resume", str(run), "--steps", "3"])
            line = one_line(exit_info.value.code, capsys.readouterr().err)
            assert line.startswith(f"error: --resume {run}: its config.json holds "
                                   f"{f.name} = {value!r}, not "), line
            tried += 1
    fields = dataclasses.fields(brorl.Config)
    assert {f.type for f in fields} == {bool, int, float, str}  # every kind tried
    assert tried == sum(len(wrong_kinds(f.type)) for f in fields) > 250
    (run / "config.json").write_text(json.dumps({**config_json, "lr": 1, "steps": 3}))
    cfg = brorl.parse_config(["--resume", str(run)])
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and cfg.steps == 3
    (run / "config.json").write_text(text)
    assert snapshot(run) == before


# (a field of config.json out of its range, what the one line says): each kind's
OUT_OF_RANGE = [
    ("lr", -1.0, "--lr -1.0: need lr > 0"),
    ("temperature", 0.0, "--temperature 0.0: need > 0"),
    ("focal_gamma", -2, "--focal_gamma -2.0: need a finite gamma >= 0"),
    ("n_rollouts", 1, "--n_rollouts 1: need N >= 2"),
    ("eval_every", 0, "--eval_every >= 1"),
    ("alloc", "greedy", "--alloc 'greedy': choose uniform or adaptive"),
    ("loss", "", "--loss '': choose ppo, gspo, cispo or sapo"),
    ("dtype", "float16", "--dtype 'float16': choose auto, float32 or bfloat16"),
]


@pytest.mark.parametrize("name, value, needle", OUT_OF_RANGE, ids=[x[0] for x in OUT_OF_RANGE])
def test_a_field_of_config_json_out_of_range_is_one_line(run, capsys, name, value, needle):
    config_json = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config_json, name: value}))
    before = snapshot(run)
    line = one_line(*run_in_process(capsys, "--resume", str(run), "--steps", "3"))
    assert needle in line and line.endswith("comes from the run's config.json)"), line
    assert snapshot(run) == before


TRAIN_PROMPTS = ["--answer_prompts", "0", "--n_rollouts", "8", "--prompts_per_step", "2",
                 "--eval_prompts", "8", "--eval_samples", "2", "--probe_prompts", "2",
                 "--probe_samples", "8"]


def trained(argv: list) -> tuple:
    """(the training set, the exact-Q prompts) a run of argv would use."""
    cfg = brorl.parse_config(argv)
    cfg, _, train_set, eval_set, *_ = setup.setup(cfg, cfg.model, "--model")
    from lib import mass
    return train_set, mass.prompt_set(cfg, eval_set, train_set)


def test_train_prompts_are_the_training_tasks_with_or_without_eval_task():
    """--train_prompts n: the training task's n prompts, with --eval_task another task's (keys) as
    without it (there the eval set's first n); --mass_prompts under it follows trained prompts."""
    alone, _ = trained(["--preset", "sets", *TRAIN_PROMPTS, "--train_prompts", "2"])
    beside, _ = trained(["--preset", "sets", *TRAIN_PROMPTS, "--train_prompts", "2",
                         "--eval_task", "keys"])
    sets = {x["prompt"] for x in data.load_task("sets", "train")}
    assert len(alone) == len(beside) == 2 and {x["prompt"] for x in alone + beside} <= sets
    train_set, exact = trained(["--preset", "keys", *TRAIN_PROMPTS, "--train_prompts", "4",
                                "--mass_prompts", "3"])
    assert [x["prompt"] for x in exact] == [x["prompt"] for x in train_set[:3]]


@pytest.mark.parametrize("flags, needle", [
    (["--preset", "keys", "--train_prompts", "600", "--eval_prompts", "600"],
     "--train_prompts 600: --task keys's eval set holds 512 prompts"),
    (["--preset", "sets", "--train_prompts", "300", "--eval_task", "keys"],
     "--train_prompts 300: --task sets's training set holds 256 prompts"),
    (["--preset", "keys", "--train_prompts", "4", "--mass_prompts", "8"],
     "--mass_prompts 8: under --train_prompts the trained prompts' first n, so at most "
     "--train_prompts 4"),
], ids=["past the eval set", "past the training set", "mass prompts not trained"])
def test_train_prompts_past_the_set_is_one_line(tmp_path, capsys, flags, needle):
    out = tmp_path / "run"
    line = one_line(*run_in_process(capsys, *TRAIN_PROMPTS, *flags, "--steps", "1", "--out",
                                    str(out)))
    assert line == f"error: {needle}", line
    assert not out.exists()


def test_resuming_an_adaptive_run_on_another_training_set_is_one_line(tmp_path, capsys):
    """--alloc adaptive keeps its estimate by position in the training set: --train_prompts changed
    on resume is one line before any write, not a traceback after the run directory is written."""
    run = tmp_path / "run"
    brorl.train(brorl.parse_config(["--preset", "sets", *TRAIN_PROMPTS, "--alloc", "adaptive",
                                    "--train_prompts", "2", "--steps", "1", "--out", str(run)]))
    before, _ = snapshot(run), capsys.readouterr()
    line = one_line(*run_in_process(capsys, "--resume", str(run), "--train_prompts", "4",
                                    "--steps", "2"))
    assert line == (f"error: --resume {run}: its checkpoint's --alloc adaptive estimate covers 2 "
                    "training prompts, this run's training set holds 4 (--train_prompts 4): "
                    "resume with the run's own training set, or start a new run from it with "
                    "--init_from"), line
    assert snapshot(run) == before


@pytest.mark.parametrize("flags", [["--train_prompts", "2"], ["--alloc", "adaptive"],
                                   ["--time_budget", "9.5"], ["--mass_balance", "2"]],
                         ids=lambda x: x[0])
def test_a_training_flag_under_eval_only_is_one_line(tmp_path, capsys, flags):
    out = tmp_path / "eval"
    with pytest.raises(SystemExit) as exit_info:
        brorl.parse_config(["--eval_only", "--preset", "sets", *flags, "--out", str(out)])
    line = one_line(exit_info.value.code, capsys.readouterr().err)
    assert line == (f"error: {flags[0]} {flags[1]}: counts only in training, and --eval_only "
                    "trains nothing; drop it"), line
    assert not out.exists()


@pytest.mark.parametrize("eval_only", [False, True], ids=["train", "--eval_only"])
def test_a_model_dir_neither_a_models_nor_a_runs_is_one_line(finished, tmp_path, capsys,
                                                             eval_only):
    """A directory holding a run's config.json less a field (not a whole run's, not a model's) as
    --model: one line naming what it lacks, not transformers' reading of "dtype": "auto"."""
    model, out = tmp_path / "model", tmp_path / "new"
    model.mkdir()
    config_json = json.loads((finished / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({k: v for k, v in config_json.items()
                                                   if k != "n_rollouts"}))
    line = one_line(*run_in_process(capsys, "--model", str(model), *["--eval_only"] * eval_only,
                                    "--out", str(out), *TINY))
    assert line == (f"error: --model {model}: its config.json is neither a model's (it lacks "
                    "model_type) nor a whole run's (it lacks n_rollouts)"), line
    assert not out.exists()


def can_chattr(tmp: Path) -> bool:
    """Whether `chattr +i` makes a folder immutable here (root on a file system that has it)."""
    probe = tmp / "chattr-probe"
    probe.mkdir()
    try:
        made = subprocess.run(["chattr", "+i", str(probe)], capture_output=True).returncode == 0
    except FileNotFoundError:
        return False
    subprocess.run(["chattr", "-i", str(probe)], capture_output=True)
    probe.rmdir()
    return made


# (the folder made immutable after step 1's row, what step 2's one line says after "cannot write
# in <run> (")
IMMUTABLE = [
    ("answers", "Operation not permitted): answers/step-000002.pt and step 2's row were not "
                "written; --resume {run} continues from its last checkpoint, or from step 0 "
                "if none"),
    ("ckpt", None),  # os.replace of ckpt/: "cannot swap the new checkpoint in"
    (".", "Operation not permitted: {run}/ckpt.tmp): the checkpoint of step 2 was not written; "
          "ckpt/ keeps the last one (--resume continues from it)"),
]


@pytest.mark.parametrize("folder, needle", IMMUTABLE, ids=["answers", "ckpt", "run"])
def test_an_immutable_folder_mid_run_is_one_line(tmp_path, capsys, monkeypatch, folder, needle):
    """Each folder a sets run writes made immutable (chattr +i) after step 1: step 2's write there
    (torch.save raises a RuntimeError for the open it is denied, os.replace and mkdir an OSError)
    ends the run in one line naming what was not written."""
    if not can_chattr(tmp_path):
        pytest.skip("chattr +i needs root on a file system that has it "
                    "(test_a_denied_open_in_torch_save_is_one_line covers the message)")
    run = tmp_path / "run"
    log = harness.Run.log

    def log_then_freeze(self, m, *args, **kwargs):
        log(self, m, *args, **kwargs)
        if m["step"] == 1:
            subprocess.run(["chattr", "+i", str(run / folder)], check=True)
    monkeypatch.setattr(harness.Run, "log", log_then_freeze)
    try:
        code, err = run_in_process(capsys, *SETS, "--steps", "3", "--out", str(run))
    finally:
        subprocess.run(["chattr", "-i", str(run / folder)], check=True)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    line = last_line(err)
    assert line.startswith("error: "), line
    if needle:
        assert line == f"error: cannot write in {run} ({needle.format(run=run)}", line
    else:
        assert line.startswith("error: cannot swap the new checkpoint in (Operation not permitted")
    assert json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1


def test_a_denied_open_in_torch_save_is_one_line(sets_run, tmp_path, capsys, monkeypatch):
    """torch.save's zip writer raises a RuntimeError, not an OSError, for an open the file system
    denies (an immutable answers/): one line naming what was not written, no temp file left."""
    run = tmp_path / "run"
    shutil.copytree(sets_run, run)
    save = torch.save

    def denied(obj, path, *args, **kwargs):
        if str(path).endswith("step-000002.pt.tmp"):
            raise RuntimeError("[enforce fail at inline_container.cc:747] . open file failed "
                               "with strerror: Operation not permitted")
        return save(obj, path, *args, **kwargs)
    monkeypatch.setattr(torch, "save", denied)
    code, err = run_in_process(capsys, "--resume", str(run), "--steps", "2")
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert last_line(err) == (f"error: cannot write in {run} (Operation not permitted): "
                              "answers/step-000002.pt and step 2's row were not written; "
                              f"--resume {run} continues from its last checkpoint, or from step "
                              "0 if none")
    assert not list(run.rglob("*.tmp"))


# ----------------------------------------------------------------------------
# The study drivers (tools/study.py): every flag, folder and raw file checked before anything is
# made or run, a report never overwritten by a refusal, a live run never raced


def revival_raw(raw: Path, trunk: str = "trunk"):
    """The revival study's raw files, made up and whole: a trunk of 40 steps, its chunks, its
    plateau, and a report to keep."""
    from tools import revival_study
    rows = [dict(step=s, answers_q=0.5, answers_log10_q_per_prompt=[-3.0, 0.0])
            for s in range(0, 50, 10)]
    (raw / trunk).mkdir(parents=True)
    (raw / trunk / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (raw / trunk / "chunks.jsonl").write_text(json.dumps(dict(steps_to=40, cpu_s=9.0)) + "\n")
    rec = {**revival_study.plateau_test(rows, 30),
           **revival_study.branch_point(rows, dict(step=40), 30), "window": 30}
    (raw / trunk / "plateau.json").write_text(json.dumps(rec))
    (raw / "report.md").write_text("the report before\n")


def revival_without(key: str):
    def broken(raw: Path):
        revival_raw(raw)
        rec = json.loads((raw / "trunk" / "plateau.json").read_text())
        (raw / "trunk" / "plateau.json").write_text(json.dumps(
            {k: v for k, v in rec.items() if k != key}))
    return broken


def revival_with(path: str, text: str = None):
    def broken(raw: Path):
        revival_raw(raw)
        (raw / path).parent.mkdir(parents=True, exist_ok=True)
        (raw / path).unlink() if text is None else (raw / path).write_text(text)
    return broken


def foreign_trunk(tmp: Path, finished: Path):
    shutil.copytree(finished, tmp / "out" / "trunk-2")


def live_run(tmp: Path, finished: Path):
    """A brorl.py run still going in the study's first run directory (a process holding its
    lock, as a run a killed driver left does)."""
    run = tmp / "out" / "keys" / "adaptive" / "seed0"
    run.mkdir(parents=True)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys; "
                               "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
                               "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, b'4242\\n'); "
                               "print('held', flush=True); sys.stdin.read()", str(run / ".lock")],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def trunk_records_without_run(tmp: Path, finished: Path):
    (tmp / "raw" / "trunk-2").mkdir(parents=True)
    (tmp / "raw" / "trunk-2" / "chunks.jsonl").write_text('{"steps_to": 10, "cpu_s": 1.0}\n')


ARM_OF_ANOTHER_STUDY = '{"step": 0, "mass_exact_mean": 0.1}\n{"step": 1, "samples": 4}\n'

# (study, flags, what --raw holds (a function of it) or what --out holds (of tmp, the finished
# run), the one line's needle): each refused before anything is made, run or rewritten
STUDY_INPUTS = [
    ("revival_study", ["--window", "20"], None,
     "--window 20: the plateau rule fits a line to the evaluations of the last --window steps, one "
     "every 10: it needs >= 30 (3 of them)"),
    ("revival_study", ["--prompts", "2", "--only", "trunk"], ("out", foreign_trunk),
     "{tmp}/out/trunk-2: holds a run of other flags (--train_prompts 0, not 2): not this "
     "study's trunk-2; give another --out, or delete it"),
    ("revival_study", ["--prompts", "2", "--only", "trunk"], ("out", trunk_records_without_run),
     "{tmp}/raw/trunk-2/chunks.jsonl records trunk-2 to step 10, but its run {tmp}/out/trunk-2 "
     "holds no checkpoint and {tmp}/out/trunk-2-branch none of that step: they disagree"),
    ("revival_study", ["--report"], revival_with("trunk/plateau.json", '{"step": 4'),
     "{tmp}/raw/trunk/plateau.json: unreadable (Expecting ',' delimiter)"),
    ("revival_study", ["--report"], revival_without("slope_per_100"),
     "{tmp}/raw/trunk/plateau.json: not this study's record (it lacks slope_per_100)"),
    ("revival_study", ["--report"], revival_with("arms/prorl/seed0.jsonl", ARM_OF_ANOTHER_STUDY),
     "{tmp}/raw/arms/prorl/seed0.jsonl: not a run of this study (IndexError"),
    ("revival_study", ["--report"], revival_with("trunk/metrics.jsonl"),
     "{tmp}/raw/trunk/metrics.jsonl is missing: the trunk's raw files are incomplete"),
    ("revival_study", ["--out", "{tmp}/file"], None, "--out {tmp}/file: cannot make it"),
    ("theorem1_study", ["--only", "iso", "iso"], None, "--only iso iso: iso twice"),
    ("theorem1_study", ["--report"], raw_file(ARM_OF_ANOTHER_STUDY, "nalone/N=16,B=8"),
     "nalone/N=16,B=8/seed0.jsonl: not a run of this study (IndexError"),
    ("theorem1_study", ["--out", "{tmp}/file"], None, "--out {tmp}/file: cannot make it"),
    ("allocation_study", ["--arms", "N=512", "N=512"], None, "--arms N=512 N=512: N=512 twice"),
    ("allocation_study", ["--speed", "2", "--report"], None,
     "--speed 2 with --report: --speed measures its own three arms on --tasks and writes "
     "nothing (no runs, no raw files, no report); drop it"),
    ("allocation_study", ["--speed", "2", "--arms", "N=16"], None, "--speed 2 with --arms"),
    ("allocation_study", ["--out", "{tmp}/file"], None, "--out {tmp}/file: cannot make it"),
    ("allocation_study", ["--tasks", "keys", "--arms", "adaptive", "--seeds", "0"],
     ("out", live_run), "{tmp}/out/keys/adaptive/seed0: a brorl.py run (pid 4242) still holds it"),
]


@pytest.mark.parametrize("name, flags, holds, needle", STUDY_INPUTS,
                         ids=[f"{x[0]} {' '.join(x[1])} {x[3][:30]}" for x in STUDY_INPUTS])
def test_a_study_refuses_bad_input_before_making_running_or_rewriting_anything(
        tmp_path, capsys, monkeypatch, finished, name, flags, holds, needle):
    """--window without 3 evaluations, --out holding another run (or records its run cannot
    meet), raw files cut short, lacking a key or another study's, --arms twice, --speed with the
    study's flags, --out a file, a run still going: one line, exit 2; --raw not made, the report as
    it was, no run started."""
    import importlib
    from tools import study as skeleton
    main = importlib.import_module(f"tools.{name}").main
    monkeypatch.setattr(skeleton, "run_to_raw", lambda *a: pytest.fail("a run started"))
    monkeypatch.setattr(skeleton.ChunkedRun, "advance", lambda *a: pytest.fail("a run started"))
    raw = tmp_path / "raw"
    (tmp_path / "file").write_text("")
    holder = None
    if callable(holds):
        holds(raw)
    elif holds:
        holder = holds[1](tmp_path, finished)
    before, raw_made = snapshot(tmp_path), raw.exists()
    try:
        with pytest.raises(SystemExit) as exit_info:
            main([*["--raw", str(raw), "--out", str(tmp_path / "out")] * ("--speed" not in flags),
                  *[f.format(tmp=tmp_path) for f in flags]])
    finally:
        if holder:
            holder.stdin.close()
            holder.wait()
    line = one_line(exit_info.value.code, capsys.readouterr().err)
    assert needle.format(tmp=tmp_path) in line, line
    assert {k: v for k, v in snapshot(tmp_path).items() if not k.endswith(".lock")} == {
        k: v for k, v in before.items() if not k.endswith(".lock")}
    assert raw.exists() == raw_made and not (tmp_path / "out").exists() or holds


def test_a_study_whose_run_failed_exits_1_naming_it(tmp_path, capsys, monkeypatch):
    """allocation_study with a run that fails: exit 1, the run named; no report over the rest."""
    from tools import allocation_study
    from tools import study as skeleton
    monkeypatch.setattr(skeleton, "run_to_raw", lambda job: 3)
    with pytest.raises(SystemExit) as exit_info:
        allocation_study.main(["--tasks", "keys", "--arms", "N=512", "--seeds", "0", "--raw",
                               str(tmp_path / "raw"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and err.strip().splitlines()[-1] == (
        "error: 1 run(s) failed (rerun the command to retry them): keys N=512 seed 0: failed "
        f"(exit 3), {tmp_path}/out/keys/N=512/seed0.log")
    assert not (tmp_path / "raw" / "report.md").exists()


def test_a_second_driver_on_one_out_is_one_line(tmp_path, capsys):
    from tools import study as skeleton
    out = tmp_path / "out"
    out.mkdir()
    with skeleton.DriverLock(out):
        holder = subprocess.run([sys.executable, "-c", "import sys; from tools import study; "
                                 "from pathlib import Path; study.DriverLock(Path(sys.argv[1]))"
                                 ".__enter__()", str(out)], cwd=HERE, capture_output=True,
                                text=True)
    line = one_line(holder.returncode, holder.stderr)
    assert line == (f"error: --out {out}: another study driver (pid {os.getpid()}) is using it; "
                    "wait for it to end (or stop it), or give another --out"), line
