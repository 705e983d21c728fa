"""
study.py: the skeleton every study driver stands on (tools/theorem1_study.py, allocation_study.py,
revival_study.py, breadth_study.py). A study is arms x seeds of runs, each a `python brorl.py` in a
subprocess on one thread, run seed by seed (every arm's seed 0, then seed 1, ...: a study cut short
is balanced), `jobs` at a time, each run's metrics.jsonl copied to its raw file
<raw>/<group>/<arm>/seed<S>.jsonl when it ends; or one run continued chunk by chunk (ChunkedRun).
Its report and figure are written from the raw files alone, after every one was read and measured.

A study is resumable as a run is. Whatever killed it (the driver, a run, both), the same command
goes on from what is on disk and ends as the uninterrupted study would (clock fields aside), or
refuses with one line naming what disagrees: a run whose raw file is missing is run again from
scratch; a chunk its driver did not record is rolled back and redone. A run a dead driver left
running is found by its run directory's lock (lib/rundir.py) and never raced, and one driver at a
time holds a study's --out. Every flag, folder and raw file is checked before anything is made or
run; a report is never overwritten by a refusal.
"""

import fcntl
import json
import math
import os
import resource
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from lib.errors import fail
from lib.rundir import surviving_checkpoint
from lib.rundir import metrics_row, write_atomic

HERE = Path(__file__).resolve().parent.parent  # the repository root
BRORL = HERE / "brorl.py"


def thread_env(threads: int) -> dict:
    """This process's environment, with a run's torch threads set (torch reads them at import);
    0: as is."""
    env = dict(os.environ)
    if threads > 0:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    return env


# ----------------------------------------------------------------------------
# Flags and folders, checked before anything is made


def check_seeds(seeds: list):
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        fail(f"--seeds {' '.join(map(str, seeds))}: need distinct seeds >= 0")


def check_distinct(flag: str, values: list):
    """A list flag (--arms, --tasks, --only) naming a value twice would run one run directory
    twice, racing itself: one line."""
    if twice := sorted({v for v in values if values.count(v) > 1}):
        fail(f"{flag} {' '.join(map(str, values))}: {twice[0]} twice")


def finite_positive(flag: str, value: float):
    """A study's budget or cap: a finite number above 0, else one line."""
    if not (math.isfinite(value) and value > 0):
        fail(f"{flag} {value}: need a finite number > 0")


def check_folder(flag: str, path: Path, files=()):
    """A folder the study writes (made later, by make_folders) and the files it rewrites there:
    one that could not be made or written is one line, before anything is made."""
    if path.exists() and not path.is_dir():
        fail(f"{flag} {path}: cannot make it (a file is in the way)")
    parent = next(p for p in (path, *path.parents) if p.exists())
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        fail(f"{flag} {path}: cannot make it ({parent} is not a writable folder)")
    for p in (path / f for f in files):
        if p.exists() and (not os.access(p, os.W_OK) or p.is_dir()):
            fail(f"{flag} {path}: {p} is not a writable file")


def make_folders(*paths: Path):
    for path in paths:
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            fail(f"{path}: cannot make it ({e.strerror})")


# ----------------------------------------------------------------------------
# Locks: the driver's on its --out, and a run's (brorl.py's <run>/.lock), probed


def lock_holder(run_dir: Path, name: str = ".lock") -> str:
    """The pid written in the lock file run_dir/name (brorl.py's <run>/.lock, flocked for a run's
    life; a driver's <out>/.study.lock) if a live process holds it, or '': a shared probe of the
    flock, let go at once; the file a dead process left is free."""
    try:
        fd = os.open(run_dir / name, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return ""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return ""
    except BlockingIOError:
        return os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
    finally:
        os.close(fd)


# What brorl.py writes in a run directory: a study removes a directory holding nothing else.
RUN_DIR_FILES = {".lock", "config.json", "config_history.jsonl", "metrics.jsonl", "metrics.png",
                 "samples.jsonl", "ckpt", "ckpt.old", "ckpt.tmp", "ckpt.restore", "answers"}


def check_run_dirs(run_dirs: list):
    """Each run directory a study would start over: no live run in it (refuse_live_runs), and
    nothing in it but what brorl.py writes (a folder of someone else's files is never removed)."""
    refuse_live_runs(run_dirs)
    for run_dir in run_dirs:
        if run_dir.is_dir() and (other := sorted(p.name for p in run_dir.iterdir()
                                                 if p.name not in RUN_DIR_FILES
                                                 and not p.name.endswith(".tmp"))):
            fail(f"{run_dir}: holds {other[0]}, not a brorl run's file: not this study's run "
                 "directory; give another --out, or delete it")
        elif run_dir.exists() and not run_dir.is_dir():
            fail(f"{run_dir}: a file where this study's run directory goes; give another --out")


def refuse_live_runs(run_dirs: list):
    """A run directory a live process holds (a run a killed driver started, still going): one
    line, before anything is touched; the study goes on when it has ended."""
    for run_dir in run_dirs:
        if pid := lock_holder(run_dir):
            fail(f"{run_dir}: a brorl.py run (pid {pid}) still holds it (started by a study driver "
                 "that was stopped?): wait for it to end, or stop it, then run this command again")


class DriverLock:
    """`with DriverLock(out):` <out>/.study.lock flocked around a driver's work: a second driver on
    the same --out is refused. Every process the driver starts (run_child) holds the lock with it,
    from before it runs: a driver killed while a run it started goes on leaves --out locked until
    that run ends, never free in the instant before the run has taken its own run directory's lock.
    The kernel drops the lock when the last of them ends, however it ends."""
    held: tuple = ()  # the lock files' descriptors this process holds, passed to its children

    def __init__(self, out: Path):
        self.out = out

    def __enter__(self):
        self.fd = os.open(self.out / ".study.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            who = (f"another study driver (pid {holder})" if pid_alive(holder) else
                   f"a run that a stopped study driver (pid {holder}) started")
            fail(f"--out {self.out}: {who} is using it; wait for it to end (or stop it), or give "
                 "another --out")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        DriverLock.held = (*DriverLock.held, self.fd)
        return self

    def __exit__(self, *_):
        DriverLock.held = tuple(fd for fd in DriverLock.held if fd != self.fd)
        os.close(self.fd)


def pid_alive(pid: str) -> bool:
    """Whether a process of that pid (a number as text) lives; False for anything else."""
    try:
        os.kill(int(pid), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:  # It lives, as another user's process.
        pass
    return True


def run_child(argv: list, log, cwd=None, env=None) -> int:
    """argv run in env (default: this one's, on one thread), its output to the open file log; its
    exit status. It holds the driver's lock (DriverLock) for its life."""
    return subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                          env=thread_env(1) if env is None else env,
                          pass_fds=DriverLock.held).returncode


# ----------------------------------------------------------------------------
# Runs to raw files: arms x seeds


@dataclass
class Job:
    """One run of a study: its name in the lines the driver prints, brorl.py's flags, its run
    directory, its raw file and its log."""
    name: str
    argv: list
    run_dir: Path
    raw_file: Path
    log: Path


def pending(jobs: list) -> list:
    """The jobs whose raw file is missing, after the checks that no two share a run directory or a
    raw file and that no run directory is held by a live run."""
    for attr in ("run_dir", "raw_file"):
        paths = [getattr(j, attr) for j in jobs]
        if twice := next((p for p in paths if paths.count(p) > 1), None):
            fail(f"two runs of this study would share {twice}")
    todo = [j for j in jobs if not j.raw_file.is_file()]
    check_run_dirs([j.run_dir for j in todo])
    return todo


def run_to_raw(job: Job) -> int:
    """`python brorl.py argv` on one thread in a fresh run directory (a killed run's leftovers
    removed: its run starts over, as an uninterrupted study's did), its output to the log; when it
    exits 0, its metrics.jsonl, argv added to the first row, written whole to the raw file. Returns
    its exit status (1, touching nothing, if a live process holds the run directory)."""
    if lock_holder(job.run_dir):
        return 1
    shutil.rmtree(job.run_dir, ignore_errors=True)
    job.run_dir.parent.mkdir(parents=True, exist_ok=True)
    job.log.parent.mkdir(parents=True, exist_ok=True)
    with open(job.log, "w") as log:
        code = run_child([sys.executable, str(BRORL), *job.argv], log)
    if code == 0:
        job.raw_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(job.raw_file, raw_text(read_rows(job.run_dir), job.argv))
    return code


def in_parallel(one, items: list, parallel: int) -> list:
    """one(item) for every item, `parallel` at a time, in order; the lines one returned for those
    that failed (it returns "" for one that did not)."""
    import concurrent.futures
    with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
        return [line for line in pool.map(one, items) if line]


def run_logged(name: str, argv: list, log: Path, cwd=None) -> str:
    """argv run as run_child runs it, its output appended to log, a line printed as it starts and
    one as it ends; "" or its failure's line (naming the log)."""
    print(f"{name}: {' '.join(argv[1:])}", flush=True)
    with open(log, "a") as f:
        code = run_child(argv, f, cwd=cwd)
    line = f"{name}: " + ("done" if code == 0 else f"failed (exit {code}), {log}")
    print(line, flush=True)
    return "" if code == 0 else line


def run_jobs(jobs: list, parallel: int) -> list:
    """Every job whose raw file is missing, `parallel` at a time, in order; each one's line printed
    as it ends. Returns the lines of those that failed."""
    todo = pending(jobs)

    def one(job: Job) -> str:
        print(f"{job.name}: python brorl.py {' '.join(job.argv)}", flush=True)
        code = run_to_raw(job)
        line = f"{job.name}: " + ("done" if code == 0 else f"failed (exit {code}), {job.log}")
        print(line, flush=True)
        return "" if code == 0 else line

    return in_parallel(one, todo, parallel)


def exit_if_failed(failed: list):
    """A study whose run failed exits 1, naming each (its raw file is missing: a rerun retries)."""
    if failed:
        print(f"error: {len(failed)} run(s) failed (rerun the command to retry them): "
              + "; ".join(failed), file=sys.stderr)
        sys.exit(1)


def read_rows(run_dir: Path) -> list:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
            if line.strip()]


def clock_free(row: dict) -> dict:
    """A metrics row without its clock fields (what another run of the same flags may differ in)."""
    return {k: v for k, v in row.items() if not k.startswith("time_") and k != "tokens_per_s"}


def raw_text(rows: list, argv: list) -> str:
    """A raw file's text: a run's rows, its flags added to the first (step 0) row."""
    return "".join(json.dumps({**r, "argv": argv} if r["step"] == 0 else r) + "\n" for r in rows)


# ----------------------------------------------------------------------------
# Raw files, read back


def read_raw(raw: Path, groups=None) -> dict:
    """A study's raw files <raw>/<group>/<arm>/seed<S>.jsonl as {group: {arm: {S: rows}}}, the
    groups named in `groups` (all if None). A file that is not a whole run's rows (unreadable,
    empty, a line cut short, not from step 0) stops with one line naming it: read before any run,
    so that a study never counts it as done, nor reports on it."""
    out = {}
    for path in sorted(raw.glob("*/*/seed*.jsonl")):
        if groups is None or path.parent.parent.name in groups:
            out.setdefault(path.parent.parent.name, {}).setdefault(path.parent.name, {})[
                raw_seed(path)] = raw_rows(path)
    return out


def nothing_to_report(raw: Path, layout: str):
    """A --report over a --raw that holds none of this study's files (missing, empty, another
    study's): one line naming the files it looks for, before anything is written, so that a
    report of nothing never replaces one."""
    fail(f"--raw {raw}: no raw files of this study to report on ({layout}); run it first")


def raw_to_report(raw: Path, layout: str, groups=None) -> dict:
    """read_raw's {group: {arm: {S: rows}}} for a --report; none of this study's: one line."""
    data = read_raw(raw, groups)
    if not any(data.values()):
        nothing_to_report(raw, layout)
    return data


def raw_seed(path: Path) -> int:
    """The seed a raw file's name holds, or one line."""
    if not path.stem[4:].isdigit():
        fail(f"{path}: not a raw file's name (seed<S>.jsonl, S a number)")
    return int(path.stem[4:])


def raw_rows(path: Path) -> list:
    """A raw file's rows, or one line naming what is wrong with it."""
    redo = "delete it and the study runs that run again"
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{path}: cannot read it ({getattr(e, 'strerror', None) or e})")
    rows = [metrics_row(line) for line in lines if line.strip()]
    if not rows:
        fail(f"{path}: empty, not a run's rows; {redo}")
    if None in rows:
        fail(f"{path}: line {rows.index(None) + 1} is not a metrics row (cut short?); {redo}")
    if rows[0]["step"] != 0:
        fail(f"{path}: starts at step {rows[0]['step']}, not 0 (not a whole run); {redo}")
    return rows


def read_json(path: Path, keys=()) -> dict:
    """A JSON object a study wrote (a plateau's record), with `keys` ("a.b": b in the object a);
    else one line naming it."""
    try:
        obj = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        fail(f"{path}: unreadable ({getattr(e, 'msg', None) or e}); delete it and the study "
             "writes it again")

    def has(key):
        found = obj
        for part in key.split("."):
            if not isinstance(found, dict) or part not in found:
                return False
            found = found[part]
        return True
    missing = [k for k in keys if not has(k)] if isinstance(obj, dict) else ["an object"]
    if missing:
        fail(f"{path}: not this study's record (it lacks {missing[0]}); delete it and the study "
             "writes it again")
    return obj


def check_trunk_raw(folder: Path, flags: list, keys=()):
    """A trunk's raw files already in `folder`: its metrics.jsonl this trunk's (the flags its first
    row names) and readable, its plateau.json a whole record with `keys`; else one line."""
    if (folder / "metrics.jsonl").is_file():
        rows = raw_rows(folder / "metrics.jsonl")
        if rows[0].get("argv") != flags:
            fail(f"{folder / 'metrics.jsonl'}: another trunk's rows (its flags "
                 f"{rows[0].get('argv')}, not {flags}); give another --raw")
    if (folder / "plateau.json").is_file():
        read_json(folder / "plateau.json", keys)


def read_jsonl(path: Path, keys=()) -> list:
    """A JSON-lines file a study wrote (a chunked run's records), each line an object with `keys`;
    else one line naming the file and the line."""
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        fail(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})")
    out = []
    for i, line in enumerate(lines, 1):
        try:
            obj = json.loads(line)
        except ValueError:
            obj = None
        if not isinstance(obj, dict) or any(not isinstance(obj.get(k), (int, float))
                                            or isinstance(obj.get(k), bool) for k in keys):
            fail(f"{path}: line {i} is not a record of this study ({', '.join(keys)}): "
                 f"{line[:60]!r}")
        out.append(obj)
    return out


def chunk_records(path: Path) -> list:
    """A chunked run's records (chunks.jsonl: each chunk's steps_to and cpu_s), their steps
    increasing; else one line naming the file."""
    recs = read_jsonl(path, ("steps_to", "cpu_s"))
    steps = [r["steps_to"] for r in recs]
    if any(b <= a for a, b in zip([0, *steps], steps)):
        fail(f"{path}: its chunks' steps {steps} do not increase; not a record of this run")
    return recs


def measured(path, measure, *args):
    """measure(*args) of one raw file's rows, or one line naming the file: a file of another study
    (or edited) lacks what this study measures."""
    try:
        return measure(*args)
    except (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError) as e:
        fail(f"{path}: not a run of this study ({type(e).__name__}: {str(e)[:80]}); delete it "
             "and the study runs that run again")


# ----------------------------------------------------------------------------
# The report: every output written whole, after all of them were made


def write_outputs(folder: Path, writers: dict):
    """Each file folder/<name> written by writers[name](tmp path) into a temp file first, then all
    renamed into place: a refusal or a crash while making any leaves every old file as it was."""
    tmps = {name: folder / f".{name}.tmp{Path(name).suffix}" for name in writers}
    try:
        for name, write in writers.items():
            write(tmps[name])
        for name, tmp in tmps.items():
            os.replace(tmp, folder / name)
    finally:
        for tmp in tmps.values():
            tmp.unlink(missing_ok=True)


def text_writer(text: str):
    return lambda path: path.write_text(text)


# ----------------------------------------------------------------------------
# A run continued chunk by chunk


class ChunkedRun:
    """One brorl.py run (flags) continued chunk by chunk in run_dir, each chunk a --resume to
    min(last + chunk, max_steps): its evaluations (--eval_every, and each chunk's end) fall where
    an uninterrupted chunked run's do. The driver's own files beside it:
      records   chunks.jsonl: a line per chunk that ended with exit 0 (steps_to; cpu_s, the chunk
                process's CPU seconds), written as it ended: the commit of that chunk
      copy(s)   the run's checkpoint (and config.json) at a recorded chunk's end, copied whole and
                then renamed: where the run is rolled back to, and what a branch starts from
    Before each chunk the run directory is brought to the last recorded chunk: a chunk killed, or
    one that ended after its driver was killed (unrecorded: its CPU seconds unknown), is rolled
    back to the copy and redone, bit for bit (--resume is exact). A run directory a live process
    holds is refused, never raced; one holding another run's config, or records that disagree
    with it, is one line."""

    def __init__(self, name: str, run_dir: Path, flags: list, chunk: int, max_steps: int,
                 records: Path, copy, log: Path, keep_copies: bool = False):
        self.name, self.run_dir, self.flags, self.chunk = name, run_dir, flags, chunk
        self.max_steps, self.records_file, self.copy, self.log = max_steps, records, copy, log
        # copy(step): where the checkpoint at a recorded step is copied; keep_copies: every
        # recorded chunk's copy is kept (else the last alone)
        self.keep_copies = keep_copies

    def records(self) -> list:
        return chunk_records(self.records_file) if self.records_file.is_file() else []

    def check(self) -> int:
        """The step of the last recorded chunk (0 if none), after the checks that nothing else
        holds or held the run directory: no live run, no other run's config, no records that its
        checkpoint and copy cannot meet."""
        check_run_dirs([self.run_dir])
        self.check_config()
        recs = self.records()
        done = recs[-1]["steps_to"] if recs else 0
        at = self.checkpoint_step(self.run_dir)
        if done and at != done and (self.checkpoint_step(self.copy(done)) != done
                                    or not (self.run_dir / "metrics.jsonl").is_file()):
            fail(f"{self.records_file} records {self.name} to step {done}, but its run "
                 f"{self.run_dir} " + (f"is at step {at}" if at is not None else
                                       "holds no checkpoint") + f" and {self.copy(done)} none "
                 "of that step: they disagree (delete both to start it over)")
        return done

    def done(self) -> int:
        """The step of the last recorded chunk (0 if none), the run directory brought to it and its
        copy made: what a rerun continues from."""
        done = self.check()
        if done == 0:  # a first chunk cut short (or none): started over
            shutil.rmtree(self.run_dir, ignore_errors=True)
            return 0
        if self.checkpoint_step(self.run_dir) != done:
            self.roll_back(done)
        self.make_copy(done)
        return done

    def check_config(self):
        """run_dir/config.json, if there is one, names this run's flags: else it is another run."""
        path = self.run_dir / "config.json"
        if not path.is_file():
            return
        import brorl
        want = brorl.parse_config([*self.flags, "--plan"])
        try:
            have = json.loads(path.read_text())
        except (OSError, ValueError):
            have = None
        # (the probe's and the answers' counts are recorded as measured: at most the eval set)
        named = [f.lstrip("-") for f in self.flags if f.startswith("--")
                 and f not in ("--preset", "--probe_prompts", "--answer_prompts")]
        if not isinstance(have, dict) or (off := [k for k in named
                                                 if have.get(k) != getattr(want, k)]):
            what = (f"--{off[0]} {have.get(off[0])!r}, not {getattr(want, off[0])!r}"
                    if isinstance(have, dict) else "an unreadable config.json")
            fail(f"{self.run_dir}: holds a run of other flags ({what}): not this study's "
                 f"{self.name}; give another --out, or delete it")

    @staticmethod
    def checkpoint_step(path: Path):
        """The step of the checkpoint that path (a run directory or a copy) holds, or None."""
        ckpt = surviving_checkpoint(path)
        try:
            return torch.load(ckpt / "trainer_state.pt", map_location="cpu",
                              weights_only=True)["step"] if ckpt else None
        except Exception:  # a copy cut short: no checkpoint
            return None

    def roll_back(self, step: int):
        """The run directory's checkpoint replaced by the copy of `step`'s (its rows and samples
        after that step are dropped by the --resume that follows)."""
        print(f"{self.name}: {self.run_dir} holds an unrecorded chunk; rolled back to step {step} "
              f"({self.copy(step)}) to redo it", flush=True)
        for leftover in ("ckpt.tmp", "ckpt.old", "ckpt.restore"):
            shutil.rmtree(self.run_dir / leftover, ignore_errors=True)
        shutil.copytree(self.copy(step) / "ckpt", self.run_dir / "ckpt.restore")
        shutil.rmtree(self.run_dir / "ckpt", ignore_errors=True)
        os.replace(self.run_dir / "ckpt.restore", self.run_dir / "ckpt")

    def make_copy(self, step: int):
        """The run's checkpoint at `step` copied to copy(step), whole (a temp folder, renamed),
        unless it is there."""
        copy = self.copy(step)
        if self.checkpoint_step(copy) != step:
            tmp = copy.with_name(copy.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(self.run_dir / "ckpt", tmp / "ckpt")
            shutil.copy(self.run_dir / "config.json", tmp / "config.json")
            shutil.rmtree(copy, ignore_errors=True)
            os.replace(tmp, copy)

    def rows(self, upto: int) -> list:
        """The run's metrics rows up to step `upto`."""
        return [r for r in read_rows(self.run_dir) if r["step"] <= upto]

    def advance(self, done: int) -> int:
        """The next chunk from `done` (the run directory at it), run and recorded. Returns its
        end."""
        target = min(done + self.chunk, self.max_steps)
        argv = (["--resume", str(self.run_dir), "--steps", str(target)] if done else
                [*self.flags, "--steps", str(target), "--out", str(self.run_dir)])
        print(f"{self.name}: python brorl.py {' '.join(argv)}", flush=True)
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "a") as f:
            code = run_child([sys.executable, str(BRORL), *argv], f)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if code != 0:  # (a run's failure, not a bad input: exit status 1)
            sys.exit(f"error: {self.name}: its chunk to step {target} failed (exit {code}): "
                     f"{self.log}; rerun the command to redo it")
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        recs = [*self.records(), dict(steps_to=target, cpu_s=round(cpu, 2))]
        self.records_file.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(self.records_file, "".join(json.dumps(r) + "\n" for r in recs))
        print(f"{self.name}: chunk to step {target} recorded ({cpu:.0f} CPU s)", flush=True)
        if not self.keep_copies and done and self.copy(done) != self.copy(target):
            shutil.rmtree(self.copy(done), ignore_errors=True)
        self.make_copy(target)
        return target
