"""Every command that README.md and docs/running.md show in a code block runs as written: each is
run here in a dry form on the CPU, so that a copied command never silently does something else.

The dry form of each program:
  python brorl.py ARGS        parsed and checked as a run would be (brorl.parse_config); with
                              --eval_only, the prompts it would score counted from the data it names
                              (a hub dataset replaced by assets/math_sample.jsonl, the same schema:
                              nothing is downloaded), and, with a shipped model, run with tiny
                              overrides appended
  torchrun ... brorl.py ARGS  the same parse; B a multiple of the processes
  python -m tools.ablate ...  the sweep's --dry_run: every run's flags checked, nothing run
  bash X                      the script exists and parses (bash -n)
  pip install ...             what it installs is requirements.txt, or its torch pin
  python -m pytest -q         the command CI (.ci/run) runs, as written
A command with none of these forms fails: a new one needs its dry form here.
"""

import dataclasses
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import brorl
from lib import setup

ROOT = Path(__file__).resolve().parent.parent
DOCS = ("README.md", "docs/running.md")
BASH_BLOCK = re.compile(r"^```bash\n(.*?)^```", flags=re.M | re.S)
SAMPLE = "assets/math_sample.jsonl"  # 16 rows in the math schema, shipped: the stand-in for a hub set


def fenced_commands(md: str) -> list:
    """The commands of a document's bash blocks: continuations joined, comments dropped, `a && b` split."""
    out = []
    for block in BASH_BLOCK.findall(md):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.split(r"\s#\s|^#", line, maxsplit=1)[0].strip()
            out += [c.strip() for c in line.split(" && ") if c.strip()]
    return out


def all_commands() -> list:
    return [(doc, cmd) for doc in DOCS for cmd in fenced_commands((ROOT / doc).read_text())]


def local_source(task: str) -> str:
    """A dataset task on its local stand-in: a hub id becomes the shipped sample (math schema)."""
    if ":" not in task:
        return task
    schema, source = task.split(":", 1)
    return task if (ROOT / source).is_file() else f"math:{SAMPLE}"


def scored_prompts(cfg) -> tuple:
    """(prompts an --eval_only run scores, rows of the benchmark it names), as setup.setup draws them."""
    cfg = dataclasses.replace(cfg, task=local_source(cfg.task), eval_task=local_source(cfg.eval_task))
    bench = cfg.eval_task or cfg.task
    held_out = (setup.load_data(cfg, "--eval_task", cfg.eval_task, "all", cfg.eval_seed) if cfg.eval_task
                else setup.load_data(cfg, "--task", cfg.task, "test", cfg.eval_seed))
    rows = setup.load_data(cfg, "--task", bench, "all", cfg.eval_seed)
    return min(cfg.eval_prompts, len(held_out)), len(rows)


def dry_brorl(args: list, tmp_path: Path):
    cfg = brorl.parse_config(args)
    if not cfg.eval_only:
        return
    if ":" in (cfg.eval_task or cfg.task):  # a benchmark: every row of it, up to --eval_prompts
        scored, rows = scored_prompts(cfg)
        assert scored == min(cfg.eval_prompts, rows), (
            f"scores {scored} of the benchmark's {rows} rows, not --eval_prompts {cfg.eval_prompts}: "
            f"a benchmark is --eval_task (all its rows); --task holds out only its ~10% test split")
    if Path(cfg.model).is_dir():  # a shipped model: run it, tiny
        tiny = ["--eval_prompts", "2", "--eval_samples", "2", "--out", str(tmp_path / "eval")]
        tiny += ["--mass_prompts", "4"] if cfg.mass_prompts else []
        brorl.eval_only(brorl.parse_config(args + tiny))
        assert (tmp_path / "eval" / "eval.json").is_file()


def dry_run(cmd: str, tmp_path: Path):
    """Run one command's dry form; an AssertionError (or SystemExit from a parser) if it would fail."""
    words = shlex.split(cmd)
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):  # an environment prefix
        words = words[1:]
    if any("<" in w or "[" in w or "HOST" in w for w in words):  # a placeholder: parsed by hand only
        return
    prog, args = words[0], words[1:]
    if prog in ("python", "python3") and args[:1] == ["brorl.py"]:
        return dry_brorl(args[1:], tmp_path)
    if prog == "torchrun":
        script = next(i for i, w in enumerate(args) if w.endswith(".py"))
        assert args[script] == "brorl.py"
        cfg = brorl.parse_config(args[script + 1:])
        procs = next(int(w.split("=")[1]) for w in args[:script] if w.startswith("--nproc_per_node="))
        assert cfg.prompts_per_step % procs == 0, (cfg.prompts_per_step, procs)
        return
    if prog in ("python", "python3") and args[:2] == ["-m", "tools.ablate"]:
        from tools import ablate
        return ablate.main([*args[2:], "--dry_run"])
    if prog in ("python", "python3") and args[:2] == ["-m", "venv"]:
        return
    if prog == "." and args == [".venv/bin/activate"]:
        return
    if prog == "bash":
        assert (ROOT / args[0]).is_file(), args[0]
        subprocess.run(["bash", "-n", str(ROOT / args[0])], check=True)
        return
    if prog == "pip" and args[:2] == ["install", "-r"]:
        assert (ROOT / args[2]).is_file()
        return
    if prog == "pip" and args[0] == "install" and args[1].startswith("torch=="):
        pins = (ROOT / "requirements.txt").read_text()
        assert re.search(rf"^{re.escape(args[1])}$", pins, flags=re.M), f"{args[1]}: not the pin"
        return
    if prog == "python" and args == ["-m", "pytest", "-q"]:
        assert re.search(r"^[^#\n]*python -m pytest -q$", (ROOT / ".ci/run").read_text(), flags=re.M)
        return
    raise AssertionError(f"no dry form for `{cmd}` (tests/test_readme_commands.py)")


def test_the_docs_show_commands():
    cmds = [c for _, c in all_commands()]
    assert "python brorl.py" in cmds and "python -m pytest -q" in cmds  # the README's two commands
    assert any("--eval_only" in c for c in cmds) and any(c.startswith("torchrun") for c in cmds)


@pytest.mark.parametrize("doc,cmd", all_commands(), ids=lambda x: x[:60] if isinstance(x, str) else x)
def test_command_runs_as_written(doc, cmd, tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # commands run from the repository root
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    dry_run(cmd, tmp_path)


def test_a_benchmark_given_as_task_is_caught(tmp_path, monkeypatch):
    """The check fails on a benchmark passed as --task: it would score only the rows that hash into
    the test split (3 of the sample's 16), not --eval_prompts of them."""
    monkeypatch.chdir(ROOT)
    old = ("python brorl.py --eval_only --model deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B "
           "--task math:HuggingFaceH4/MATH-500@test --eval_prompts 500 --eval_samples 16 "
           "--max_new_tokens 32768")
    with pytest.raises(AssertionError, match="a benchmark is --eval_task"):
        dry_run(old, tmp_path)
    dry_run(old.replace("--task", "--eval_task"), tmp_path)


def test_no_command_without_a_dry_form(tmp_path):
    with pytest.raises(AssertionError, match="no dry form"):
        dry_run("make everything", tmp_path)


@pytest.mark.slow
def test_the_two_commands_in_order_in_one_tree(tmp_path):
    """The README's first command's job, then its second command, in one checkout: a clone of the
    repository (with the work tree's changes) trains `python brorl.py` at a small size (its run
    folder under `runs/`, where the default --out puts it), then runs `python -m pytest -q` there:
    0 failed. The fast suite must not read what a run leaves beside the code (tests/test_docs.py
    once read `runs/` as a repository folder)."""
    tree = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", "--local", str(ROOT), str(tree)], check=True)
    # and the work tree's own state over it: what is committed here plus what is not yet
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, check=True).stdout.decode()
    for name in filter(None, listed.split("\0")):
        if (ROOT / name).is_file():  # a file deleted in the work tree is listed but gone
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    small = ["--steps", "2", "--eval_every", "2", "--n_rollouts", "16", "--eval_prompts", "4",
             "--eval_samples", "4", "--probe_prompts", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, "brorl.py", *small], cwd=tree, env=env, check=True,
                   capture_output=True)
    assert [p.name for p in (tree / "runs").iterdir()], "the first command made no run folder"
    suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"],
                           cwd=tree, env=env, capture_output=True, text=True)
    tail = suite.stdout[-3000:]
    assert suite.returncode == 0 and " failed" not in tail, tail
