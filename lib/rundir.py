"""
rundir.py: a run's directory, <out>/: which directory holds a run (a new run there is refused) and
which checkpoint of it --resume continues from (what --resume takes from its config.json is
lib/resume.py's); made and locked for the run's life (a second run there is refused, a crashed
one's lock reclaimed), and the files written into it whole or not at all: config.json,
config_history.jsonl (what a --resume changed), metrics.jsonl (one row per step). A full disk or a
refused write stops the run with one line naming the file and saying what is kept.
"""

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import json
import os
import re
import shutil
import time
from pathlib import Path

from tqdm import tqdm

from lib import distributed
from lib.errors import fail


class RunLock:
    """<out>/.lock, flock()ed for a run's life: a second process on the same --out is refused. The
    kernel drops the lock when its process ends, however it ends; the file then left behind (a kill,
    a crash) names a process that is gone, and the next run there reclaims it with a line. A run
    that finishes, or exits on an error, removes the file. `held`: the locks this process holds, by
    directory (one process may start several runs: tests; a run that ended on an exception never
    released its own)."""
    held = {}

    def __init__(self, out: Path, say):
        self.path = out.resolve() / ".lock"  # (one directory, however spelled)
        if self.path in RunLock.held:  # an earlier run of this process that never finished
            RunLock.held.pop(self.path).release()
        while True:
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(self.fd, 64).decode(errors="replace").strip() or "?"
                os.close(self.fd)
                fail(f"--out {out}: another run (pid {holder}) is using it; "
                     "wait for it to end, or give another --out")
            if self.same_file():
                break
            os.close(self.fd)  # its holder removed the file as we locked it: lock the new one
        self.previous = os.read(self.fd, 64).decode(errors="replace").strip()  # a gone holder's pid
        self.say, self.out = say, out
        RunLock.held[self.path] = self

    def same_file(self) -> bool:
        try:
            return os.fstat(self.fd).st_ino == os.stat(self.path).st_ino
        except FileNotFoundError:
            return False

    def take(self):
        """Write this process's pid into the lock (after the checks: a refused run changes
        nothing)."""
        if self.previous:
            self.say(f"--out {self.out}: reclaimed the lock of pid {self.previous}, which is gone "
                     f"(a run killed or crashed)")
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"{os.getpid()}\n".encode(), 0)
        self.previous = ""

    def release(self):
        """Remove the lock file (unless it held a gone run's pid that we never replaced) and
        unlock."""
        if self.fd is None:
            return
        if not self.previous and self.same_file():
            self.path.unlink(missing_ok=True)
        os.close(self.fd)
        self.fd = None
        RunLock.held.pop(self.path, None)


@atexit.register
def release_locks():
    """A run that exits on an error (fail(), Ctrl-C) leaves no lock file behind."""
    for lock in list(RunLock.held.values()):
        lock.release()


def make_run_dir(cfg, resume_from=None, fresh=True) -> tuple:
    """(--out, its RunLock): made and locked by rank 0 (every rank gets its name; the default one
    holds rank 0's time). Under the lock, checked again: a new run (`fresh`) needs a directory that
    holds no run, a --resume the checkpoint it loaded from (`resume_from`), which is put back in
    place as ckpt/ if a crash inside its save left it as ckpt.tmp or ckpt.old."""
    if not distributed.is_main():
        return Path(distributed.broadcast(None)), None
    out = Path(cfg.out or f"runs/{cfg.task.split(':')[0]}-{time.strftime('%Y%m%d-%H%M%S')}")
    say = tqdm.write
    try:
        out.mkdir(parents=True, exist_ok=True)
        lock = RunLock(out, say)
    except OSError as e:
        fail(f"--out {out}: cannot write there ({e.strerror})")
    # A run may have ended there since parse_config looked.
    if fresh and not resume_from and (held := held_run(out)):
        lock.release()
        fail(held_line(out, held))
    if resume_from:
        if surviving_checkpoint(out) != resume_from:
            lock.release()
            fail(f"--resume {out}: its checkpoint changed while it was loading (another run?); "
                 "run the command again")
        put_back_checkpoint(out, resume_from, say)
    lock.take()
    return Path(distributed.broadcast(str(out))), lock


def put_back_checkpoint(out: Path, ckpt: Path, say):
    """ckpt.tmp or ckpt.old (surviving_checkpoint's choice, after a crash between the save's two
    renames) renamed to ckpt/, the other removed: what the save would have done."""
    if ckpt.name == "ckpt":
        return
    os.replace(ckpt, out / "ckpt")
    for other in ("ckpt.tmp", "ckpt.old"):
        shutil.rmtree(out / other, ignore_errors=True)
    say(f"--resume {out}: no ckpt/ (a crash inside its save); took the whole {ckpt.name}/ as ckpt/")


# ----------------------------------------------------------------------------
# Which directory holds a run, and which of its checkpoints --resume continues from


# The files by which a directory holds a run: a new run there would truncate its metrics and replace
# its checkpoint (a plain directory, or one holding only a sweep's log.txt, is not a run)
RUN_FILES = ("config.json", "metrics.jsonl", "ckpt", "ckpt.old", "ckpt.tmp")


def held_run(out: Path) -> list:
    """The run files that `out` holds (RUN_FILES), [] for a new or empty directory."""
    return [name for name in RUN_FILES if (out / name).exists()]


def held_line(out: Path, held: list) -> str:
    """Why a new run is refused on `out`, which holds a run: continue it with --resume, or (a run
    evaluated after step 0 whose checkpoint is gone, or never saved: --save 0) start it over."""
    if surviving_checkpoint(out) is None and (step := evaluated_step(out)):
        return (f"--out {out} holds a run ({', '.join(held)}) with no checkpoint to continue "
                f"(--save 0, or deleted; step {step} was evaluated): give another --out, or "
                "delete that directory to start it over")
    return (f"--out {out} holds a run ({', '.join(held)}): continue it with --resume {out}, or "
            "give another --out (delete that directory to start it over)")


def surviving_checkpoint(run: Path):
    """The checkpoint --resume continues from: run/ckpt; else what a crash inside its save left
    (checkpoint.save_atomic writes ckpt.tmp, its trainer_state.pt last, then renames ckpt ->
    ckpt.old and ckpt.tmp -> ckpt): ckpt.tmp if whole (the newer), else ckpt.old. None if there is
    none."""
    whole = lambda d: (d / "trainer_state.pt").is_file()
    if (run / "ckpt").is_dir():
        return run / "ckpt" if whole(run / "ckpt") else None
    return next((d for d in (run / "ckpt.tmp", run / "ckpt.old") if whole(d)), None)


def evaluated_step(run: Path) -> int:
    """The last step after 0 that a run's metrics.jsonl shows evaluated (a checkpoint was due then),
    or 0: a run stopped before its first checkpoint, which --resume starts over from step 0."""
    try:
        lines = (run / "metrics.jsonl").read_text(errors="replace").splitlines()
    except OSError:
        return 0
    steps = [0]
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:  # a line cut short: read_metrics judges it later
            continue
        if isinstance(row, dict) and "eval_pass@1" in row and isinstance(row.get("step"), int):
            steps.append(row["step"])
    return max(steps)


# ----------------------------------------------------------------------------
# Files written whole: config.json, config_history.jsonl, metrics.jsonl


def write_atomic(path: Path, text: str):
    """path holding text, whole or not at all (a crash leaves the old file, never half of the
    new; a failed write leaves no temp file)."""
    replace_atomic(path, lambda tmp: tmp.write_text(text))


def replace_atomic(path: Path, write):
    """path replaced whole by what write(tmp) writes into a temp file beside it, renamed over it: a
    crash leaves the old file, a failed write (a full disk, Ctrl-C) removes the temp file."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        if not tmp.is_dir():
            tmp.unlink(missing_ok=True)
        raise


def check_writable(out: Path, files=(), folders=()):
    """Each of a run's files and folders under out that exists must be of its kind and writable,
    each folder made if missing: else an OSError naming it (writes_are_one_line makes it a line),
    raised before the run writes anything."""
    for name in (*files, *folders):
        path = out / name
        if name in files and path.is_dir():
            raise IsADirectoryError(errno.EISDIR, "a directory where a file is written", str(path))
        if name in folders and path.exists() and not path.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "a file where a folder is written", str(path))
        if name in folders:
            path.mkdir(exist_ok=True)
        if path.exists() and not os.access(path, os.W_OK):  # chattr +i too, even for root
            raise PermissionError(errno.EACCES, "not writable", str(path))


def record_changes(out: Path, step: int, cfg):
    """A resumed run's config against the one it ran with (its config.json, which this segment's
    then replaces): each field changed, or absent before (a field newer than the run), appended as a
    line of <out>/config_history.jsonl, {"step": the checkpoint's step, "was": ..., "now": ...,
    "absent": [...]}: the directory keeps what ran when. Nothing changed: nothing written."""
    try:
        before = json.loads((out / "config.json").read_text())
    except (OSError, ValueError):  # (parse_config read it whole; a file gone since: all is new)
        before = {}
    now = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("resume", "out")}
    changed = [k for k, v in now.items() if k not in before or before[k] != v]
    if not changed:
        return
    entry = dict(step=step, was={k: before[k] for k in changed if k in before},
                 now={k: now[k] for k in changed}, absent=[k for k in changed if k not in before])
    with writes_are_one_line(out, "config_history.jsonl was not written; nothing else changed"):
        with open(out / "config_history.jsonl", "a") as f:
            f.write(json.dumps(entry) + "\n")


def open_metrics(out: Path, rows: list):
    """metrics.jsonl holding exactly `rows` (a resumed run's rows, whole or not at all), open to
    append."""
    write_atomic(out / "metrics.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return open(out / "metrics.jsonl", "a")


def read_metrics(out: Path, upto: int, say) -> list:
    """The rows of a run's metrics.jsonl up to step `upto` (rows logged after a checkpoint are
    redone). A last line cut short (the disk filled, the process was killed as it wrote) is dropped
    with a line; any other unreadable line stops with one line naming it."""
    path = out / "metrics.jsonl"
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        fail(f"--resume {out}: cannot read {path} ({e.strerror})")
    rows = [metrics_row(line) for line in lines]
    if lines and rows[-1] is None:
        say(f"--resume {out}: dropped the last line of {path}, "
            f"cut short ({len(lines[-1])} characters)")
        rows.pop()
    if None in rows:
        fail(f"--resume {out}: {path} line {rows.index(None) + 1} is not a metrics row "
             f"({lines[rows.index(None)][:60]!r})")
    return [r for r in rows if r["step"] <= upto]


def metrics_row(line: str):
    """One line of metrics.jsonl as its row, or None if it is not one."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) and isinstance(row.get("step"), int) else None


# ----------------------------------------------------------------------------
# A write that fails: a full disk, a refused permission, said in one line


# How the writers that wrap a failed open or write in their own error word it: safetensors'
# ("IoError", "I/O error: Permission denied (os error 13)") and torch.save's zip writer, a
# RuntimeError ("open file failed with strerror: Operation not permitted").
WRAPPED_IO_ERRORS = ("IoError", "I/O error", "open file failed")


def is_io_error(e: Exception) -> bool:
    """A failure to write a file, however it surfaces: an OSError (permission, read-only, a full
    disk, a name in the way), or the message of a writer that wraps one (WRAPPED_IO_ERRORS)."""
    return (isinstance(e, OSError) or is_disk_full(e)
            or any(s in str(e) for s in WRAPPED_IO_ERRORS))


def is_disk_full(e: Exception) -> bool:
    """The ways a full disk surfaces: ENOSPC, torch's zip writer ("unexpected pos", "file write
    failed"), safetensors' ("StorageFull")."""
    text = str(e)
    return (isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)) or any(
        s in text for s in ("No space left", "StorageFull", "unexpected pos", "file write failed"))


@contextlib.contextmanager
def writes_are_one_line(where: Path, what: str):
    """A write into `where` that fails (a full disk, a refused permission, a read-only file, a name
    in the way) stops the run with one line naming the file and saying what is kept."""
    try:
        yield
    except Exception as e:
        if not is_io_error(e):
            raise
        if is_disk_full(e):  # (the file, where the error names it)
            named = f" ({e.filename})" if isinstance(e, OSError) and e.filename else ""
            fail(f"no space left on {where}{named}: {what}")
        fail(f"cannot write in {where} ({one_line_reason(e)}): {what}")


def one_line_reason(e: Exception) -> str:
    """An error's reason, short: its strerror and the file it names, else a wrapped one's
    (torch's "... with strerror: <reason>", safetensors' "I/O error: <reason> (os error n)"), else
    its first line."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror + (f": {e.filename}" if e.filename else "")
    first = (str(e).splitlines() or [type(e).__name__])[0]
    if wrapped := re.search(r"(?:with strerror|I/O error): (.+?)(?: \(os error \d+\))?"
                            r"(?: at path \"(.*)\")?$", first):
        return (wrapped.group(1) + (f": {wrapped.group(2)}" if wrapped.group(2) else ""))[:160]
    return first[:160]
