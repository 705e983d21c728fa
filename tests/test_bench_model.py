"""tools/bench.py --model and TRL's side of it (tools/bench_trl.py, tools/bench_trl.sh): a real
model's folder and its task's prompts reach both trainers, in the model's chat template; on a tiny
random Llama with a chat template (2 layers, the embedded tokenizer), toy sizes, TRL not run."""

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoTokenizer

import data
import sampler
from tools import bench, bench_trl

ROOT = Path(__file__).resolve().parent.parent
CHAT = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny random Llama whose tokenizer has a chat template, saved to a folder."""
    path = tmp_path_factory.mktemp("llama")
    tok = AutoTokenizer.from_pretrained(data.EMBEDDED_MODEL)
    tok.chat_template = CHAT
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=256,
                                   eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                   bos_token_id=None)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def bench_output(*argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bench.main([*argv, "--threads", str(torch.get_num_threads())])
    return out.getvalue()


def test_the_sampler_and_the_step_time_the_models_own_prompt_at_each_n(llama, monkeypatch):
    given = []  # the prompts both samplers were given
    for name in ("run_ours", "run_generate"):
        monkeypatch.setattr(bench, name, lambda m, ids, *a, f=getattr(bench, name):
                            given.append(list(ids)) or f(m, ids, *a))
    # the sampler at N = 2 and 4; the step (a process each) at the last, kept short
    out = bench_output("--model", str(llama), "--part", "sampler", "--tiny", "--repeats", "1",
                       "--ns", "2,4", "--new", "3")
    out += bench_output("--model", str(llama), "--part", "step", "--tiny", "--repeats", "1",
                        "--steps", "1", "--ns", "4", "--new", "3")
    tok = AutoTokenizer.from_pretrained(llama)
    first = data.load_task("arith", "train", n=2, seed=0)[0]["prompt"]
    length = len(sampler.encode_prompt(tok, first))  # in the chat template
    assert length > len(tok(first)["input_ids"]) + 5, "the template adds its role markers"
    assert given == [sampler.encode_prompt(tok, first)] * 4  # 2 N values x (brorl, generate)
    for n in (2, 4):  # a sampler row for each N, at the model's prompt and --new
        assert any(ln.split()[:3] == [str(n), str(length), "3"] for ln in out.splitlines()), out
    assert any(ln.split()[:2] == ["brorl", "4"] for ln in out.splitlines()), out  # a step row
    assert "2 prompts x N, 3 new tokens" in out


def test_save_with_a_model_writes_its_prompts_and_folder_for_trl(llama, tmp_path):
    bench_output("--save", str(tmp_path / "w"), "--model", str(llama), "--task", "arith")
    saved = json.loads((tmp_path / "w" / "prompts.json").read_text())
    assert [p["prompt"] for p in saved] == [
        e["prompt"] for e in data.load_task("arith", "train", n=2, seed=0)]
    assert (tmp_path / "w" / "model_dir").read_text().strip() == str(llama)
    assert not (tmp_path / "w" / "config.json").exists()  # no bench model written beside them


@pytest.mark.parametrize("argv", [["--ns", "64"], ["--new", "8"], ["--task", "arith2"],
                                  ["--model", "x", "--ns", "64,a"], ["--model", "x", "--ns", "0"]])
def test_model_flags_are_refused_with_one_line(argv, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and argv[-2] in err, err


def test_bench_trl_reads_the_prompts_beside_the_model_or_the_given_file(tmp_path, capsys):
    (tmp_path / "prompts.json").write_text(json.dumps([{"prompt": "1+2=", "answer": "3"}]))
    other = tmp_path / "other.json"
    other.write_text(json.dumps([{"prompt": "What is 1 + 2?", "answer": "3"}]))
    assert bench_trl.parse_args(["--model_dir", str(tmp_path)]).prompts == tmp_path / "prompts.json"
    args = bench_trl.parse_args(["--model_dir", "/a/model", "--prompts", str(other), "--n", "64"])
    assert (args.prompts, args.n) == (other, 64)
    # as TRL takes them: a conversation where the model has a chat template, else the text
    assert bench_trl.load_prompts(other, chat=True) == [[{"role": "user",
                                                          "content": "What is 1 + 2?"}]]
    assert bench_trl.load_prompts(other, chat=False) == ["What is 1 + 2?"]
    with pytest.raises(SystemExit) as e:
        bench_trl.parse_args(["--model_dir", "/a/model"])  # no prompts.json there
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--prompts" in err, err


def fake_trl_venv(path: Path) -> Path:
    """A venv whose python prints what it was given as bench_trl.py's RESULT line: what
    bench_trl.sh would hand TRL."""
    (path / "bin").mkdir(parents=True)
    py = path / "bin" / "python"
    py.write_text('#!/usr/bin/env bash\necho "RESULT $*"\n')
    py.chmod(0o755)
    return path


def run_sh(*args, venv):
    env = dict(os.environ, TRL_VENV=str(venv), PYTHON=sys.executable)
    return subprocess.run(["bash", "tools/bench_trl.sh", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True)


def test_bench_trl_sh_hands_trl_the_models_folder_and_its_prompts(llama, tmp_path):
    done = run_sh("--model", str(llama), "--task", "arith", "64", "--new", "16",
                  venv=fake_trl_venv(tmp_path / "venv"))
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1].split()
    assert line[0] == "RESULT" and line[line.index("--model_dir") + 1] == str(llama), line
    assert line[line.index("--prompts") + 1].endswith("prompts.json")
    assert line[line.index("--n") + 1:] == ["64", "--new", "16"], line


def test_bench_trl_sh_refuses_a_task_without_a_model_before_any_write(tmp_path):
    done = run_sh("--task", "arith", "64", venv=tmp_path / "venv")
    assert done.returncode == 2 and "--task arith: only with --model" in done.stderr
    assert not (tmp_path / "venv").exists()  # the TRL venv not made


def test_the_steps_n_values_must_be_the_samplers(llama, capsys):
    """--step_ns times the step at some N of --ns (the sampler at all): another N is refused in one
    line, before any part runs."""
    with pytest.raises(SystemExit) as e:
        bench_output("--model", str(llama), "--part", "all", "--tiny", "--ns", "2,4",
                     "--step_ns", "8")
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1 and "--step_ns 8" in err, err
    assert "2,4" in err, err
