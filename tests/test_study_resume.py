"""A study driver is resumable as the trainer is (tools/study.py): the revival study's trunk, a
chunked run, killed with real signals (SIGKILL) at three instants (mid-chunk, between chunks,
during the plateau check), the driver alone, its brorl.py child alone, or both; the same command
then ends with the raw files, chunk records, branch checkpoint and plateau decision of the
uninterrupted study (clock fields aside). A child a dead driver left running is found by its run
directory's lock and never raced. Tiny: the sets task's first 2 prompts, chunks of 10 steps, the
plateau rule's bound widened so that the plateau is declared at step 30."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fcntl

import pytest
import torch
from safetensors.torch import load_file

from tools import study

HERE = Path(__file__).resolve().parent.parent
FLAGS = ["--prompts", "2", "--only", "trunk", "--chunk", "10", "--max_steps", "40",
         "--window", "30"]
# The driver, in a process of its own (a real SIGKILL ends it alone): the plateau rule's bound
# widened to 1e3 per 100 steps, so that the tiny trunk plateaus at step 30 (its window's 3 evals).
DRIVER = ("import sys; from tools import revival_study as r; r.SLOPE_BOUND = 1e3; "
          "r.main(sys.argv[1:])")
is_clock = lambda k: k.startswith("time_") or k == "tokens_per_s"


def start(out: Path, raw: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", DRIVER, *FLAGS, "--out", str(out), "--raw",
                             str(raw)], cwd=HERE, env=study.thread_env(1), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(out: Path, raw: Path) -> str:
    """The same command, run to its end: its output."""
    p = start(out, raw)
    text = p.communicate(timeout=900)[0]
    assert p.returncode == 0, text[-3000:]
    return text


def result(out: Path, raw: Path) -> dict:
    """What an uninterrupted study must equal, clock fields aside: the raw metrics, the chunks'
    steps, the plateau's record, the branch checkpoint's weights and step, the run's rows."""
    rows = lambda path: [{k: v for k, v in json.loads(line).items() if not is_clock(k)}
                         for line in path.read_text().splitlines()]
    branch = out / "trunk-2-branch" / "ckpt"
    return dict(raw=rows(raw / "trunk-2" / "metrics.jsonl"),
                chunks=[r["steps_to"] for r in rows(raw / "trunk-2" / "chunks.jsonl")],
                plateau=json.loads((raw / "trunk-2" / "plateau.json").read_text()),
                weights={k: v.tolist() for k, v in load_file(branch / "model.safetensors").items()},
                branch_step=study.ChunkedRun.checkpoint_step(out / "trunk-2-branch"),
                run=rows(out / "trunk-2" / "metrics.jsonl"))


def test_a_rerun_brings_the_run_back_to_its_last_recorded_chunk(tmp_path, capsys):
    """What a rerun decides from the files a killed study left, without a run: a chunk that ended
    unrecorded (the run at step 20, chunks.jsonl at 10) is rolled back to the copy of step 10; a
    record that neither the run nor a copy meets is one line; a run directory whose lock a live
    process holds is refused in one line naming its pid, and free once that process lets go."""
    def checkpoint(path: Path, step: int):
        (path / "ckpt").mkdir(parents=True)
        torch.save({"step": step}, path / "ckpt" / "trainer_state.pt")

    def chunked(run_dir: Path, records: list) -> study.ChunkedRun:
        (tmp_path / "chunks.jsonl").write_text("".join(
            json.dumps(dict(steps_to=s, cpu_s=1.0)) + "\n" for s in records))
        return study.ChunkedRun("trunk-2", run_dir, [], 10, 40, tmp_path / "chunks.jsonl",
                                lambda step: tmp_path / f"copy-{step}", tmp_path / "log")

    run_dir = tmp_path / "run"
    checkpoint(run_dir, 20)
    (run_dir / "metrics.jsonl").write_text("")
    checkpoint(tmp_path / "copy-10", 10)
    assert chunked(run_dir, [10]).done() == 10
    assert study.ChunkedRun.checkpoint_step(run_dir) == 10
    assert sorted(p.name for p in run_dir.iterdir()) == ["ckpt", "metrics.jsonl"]
    assert "rolled back to step 10" in capsys.readouterr().out
    with pytest.raises(SystemExit) as stop:  # recorded to 30: no copy of step 30 to go back to
        chunked(run_dir, [10, 30]).done()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.count("\n") == 1 and "is at step 10" in err, err
    # A live run holds its lock (brorl.py flocks <run>/.lock, its pid inside, for its life).
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
    os.write(fd, b"4242\n")
    fcntl.flock(fd, fcntl.LOCK_EX)
    with pytest.raises(SystemExit) as stop:
        chunked(run_dir, [10]).done()
    err = capsys.readouterr().err
    assert stop.value.code == 2 and "a brorl.py run (pid 4242) still holds it" in err, err
    os.close(fd)  # the process ends: the file stays, the lock is gone
    assert study.lock_holder(run_dir) == "" and chunked(run_dir, [10]).done() == 10


def test_a_run_a_driver_started_holds_the_driver_lock_to_its_end(tmp_path, capsys):
    """A process a driver starts (study.run_child) holds <out>/.study.lock from before it runs:
    once the driver has let go (as a killed one does), a second driver is refused in one line
    until that process ends, then goes on. Without it, a rerun started in the instant between a
    killed driver's spawn and its child's own run lock would race the child."""
    import threading
    out, started, release = tmp_path / "out", tmp_path / "started", tmp_path / "release"
    out.mkdir()
    child = ("import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch()\n"
             "while not pathlib.Path(sys.argv[2]).exists(): time.sleep(0.01)")
    codes = []
    with study.DriverLock(out), open(tmp_path / "log", "w") as log:
        run = threading.Thread(target=lambda: codes.append(study.run_child(
            [sys.executable, "-c", child, str(started), str(release)], log)))
        run.start()
        wait_for(started.exists)
    try:
        assert study.lock_holder(out, ".study.lock") == str(os.getpid())
        with pytest.raises(SystemExit) as stop:
            study.DriverLock(out).__enter__()
        err = capsys.readouterr().err
        assert stop.value.code == 2 and err.count("\n") == 1 and "is using it" in err, err
    finally:
        release.touch()
        run.join()
    assert codes == [0] and study.lock_holder(out, ".study.lock") == ""
    with study.DriverLock(out):
        pass


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    finish(tmp / "out", tmp / "raw")
    got = result(tmp / "out", tmp / "raw")
    assert got["chunks"] == [10, 20, 30] and got["plateau"]["step"] == 30
    assert got["branch_step"] == 30 and [r["step"] for r in got["raw"]][-1] == 30
    return got


def wait_for(test, seconds: float = 600):
    end = time.monotonic() + seconds
    while not test():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def child_pid(out: Path) -> int:
    return int(study.lock_holder(out / "trunk-2") or 0)


def at_step(out: Path, step: int) -> bool:
    """The run's metrics.jsonl shows `step`, and its brorl.py still holds the run."""
    path = out / "trunk-2" / "metrics.jsonl"
    return (path.is_file() and f'"step": {step},' in path.read_text() and child_pid(out) > 0)


def read_until(driver: subprocess.Popen, needle: str):
    """The driver's output line by line until one holds needle (the instant to kill at)."""
    for line in driver.stdout:
        if needle in line:
            return
    pytest.fail(f"the driver ended before {needle!r}")


# (how the study is killed): which process, at which instant
KILLS = ["driver mid-chunk", "child mid-chunk", "both mid-chunk", "driver between chunks",
         "driver during the plateau check"]


def rerun_now(out: Path, raw: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", DRIVER, *FLAGS, "--out", str(out), "--raw",
                           str(raw)], cwd=HERE, env=study.thread_env(1), capture_output=True,
                          text=True)


@pytest.mark.slow
@pytest.mark.parametrize("kill", KILLS)
def test_a_killed_study_reruns_to_the_uninterrupted_one(tmp_path, uninterrupted, kill):
    out, raw = tmp_path / "out", tmp_path / "raw"
    driver = start(out, raw)
    if "mid-chunk" in kill:  # step 12: inside the chunk 10 -> 20
        wait_for(lambda: at_step(out, 12))
        child = child_pid(out)
        for pid in [driver.pid] * ("child" not in kill) + [child] * ("driver" not in kill):
            os.kill(pid, signal.SIGKILL)
    elif kill == "driver between chunks":  # the chunk to 20 recorded, its copy being made
        read_until(driver, "chunk to step 20 recorded")
        os.kill(driver.pid, signal.SIGKILL)
    else:  # the rule being tested at step 20, before the next chunk starts
        read_until(driver, "trunk-2 step 20: mean exact Q")
        os.kill(driver.pid, signal.SIGKILL)
    text = driver.communicate(timeout=900)[0]
    if kill == "child mid-chunk":  # the driver sees its chunk fail: exit 1, one line
        assert driver.returncode == 1 and "its chunk to step 20 failed (exit -9)" in text, text
    if kill == "driver mid-chunk":
        # Its child goes on alone (held still here, so that it is surely alive): a rerun finds
        # it by the run's lock and refuses in one line, touching nothing; then it ends its chunk,
        # unrecorded, and the rerun rolls the run back to the recorded chunk's copy and redoes it.
        os.kill(child, signal.SIGSTOP)
        p = rerun_now(out, raw)
        os.kill(child, signal.SIGCONT)
        assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
        assert f"a brorl.py run (pid {child}) still holds it" in p.stderr, p.stderr
        wait_for(lambda: not child_pid(out))
        assert study.ChunkedRun.checkpoint_step(out / "trunk-2") == 20
        assert [json.loads(x)["steps_to"] for x in
                (raw / "trunk-2" / "chunks.jsonl").read_text().splitlines()] == [10]
    wait_for(lambda: not study.lock_holder(out, ".study.lock"))  # a child the driver left
    rerun = finish(out, raw)
    if kill == "driver mid-chunk":
        assert "holds an unrecorded chunk; rolled back to step 10" in rerun, rerun
    assert result(out, raw) == uninterrupted
