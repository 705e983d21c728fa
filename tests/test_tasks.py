"""The table of tasks (data.TASKS: a task is one entry), real datasets by schema (data.load_task),
prompts as a model sees them, --eval_only, the evaluation's own random stream, and the verifier on
the families real model outputs use."""

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest

import brorl
import data
import sampler
from lib import answers, checks, mass, setup
import verify

GSM8K = [  # GSM8K's own schema: a worked answer ending in "#### <number>"
    {"question": "Ann has 3,000 pens and buys 4,029 more. How many pens?", "answer": "3000+4029=<<3000+4029=7029>>7029\n#### 7,029"},
    {"question": "A 5 m rope is cut in half. How long is a piece?", "answer": "5/2=2.5\n#### 2.5"},
    {"question": "It was 4 degrees, then fell 9. What is it now?", "answer": "4-9=-5\n####-5"},
    {"question": "What is 12 * 11?", "answer": "#### 132"},
]
MATH = [  # MATH / MATH-500: answer, or only a solution whose last box is the gold
    {"problem": "Compute $\\frac{1}{2}+\\frac{1}{3}$.", "answer": "\\frac{5}{6}"},
    {"problem": "Solve $x^2=9$, $x>0$.", "solution": "So $x=\\boxed{3}$ (not \\boxed{-3})."},
    {"problem": "Find $(p,q)$.", "solution": "We get $\\boxed{\\left(1, \\{2\\}\\right)}$.", "answer": None},
    {"problem": "AIME-style: how many?", "answer": 204},  # integer answers, as AIME sets store them
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ----------------------------------------------------------------------------
# the table of tasks: a task added in one place, read by every part that reads a task


def doubling_task(calls=None, **fields):
    """A made-up task, built here alone: "a+a=" for a in 100..399, the gold 2a, scored by the
    integer rule; a in 100, 110, ... held out. `calls` collects the splits its loader is asked."""
    def load(source, split, n, seed, digits):
        if calls is not None:
            calls.append(split)
        rows = [dict(prompt=f"{a}+{a}=", answer=str(2 * a), task="arith")
                for a in range(100, 400) if split == "all" or (a % 10 == 0) == (split == "test")]
        return rows if n is None else rows[:n]
    return data.Task(load, "arith", **fields)


def refusal(capsys, argv) -> str:
    """The one line brorl's command line refuses argv with (exit status 2)."""
    with pytest.raises(SystemExit) as e:
        brorl.parse_config(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and "\n" not in err, err
    return err


def test_a_task_absent_from_the_table_is_refused_in_one_line(capsys):
    choices = "choose arith, keys, sets, gsm8k:<source> or math:<source>"
    for argv in (["--task", "doubling"], ["--eval_task", "doubling"]):
        assert refusal(capsys, argv).startswith(f"error: {argv[0]} doubling: unknown task "
                                                f"'doubling': {choices}")
    for name in ("arith:x.jsonl", "math:", "gsm8k", "Arith"):  # a source only where one is read
        assert f"--task {name}: unknown task" in refusal(capsys, ["--task", name])
    with pytest.raises(ValueError, match="unknown task 'doubling'"):
        data.load_task("doubling", "train")


def test_every_reader_of_a_task_reads_its_entry(monkeypatch, capsys):
    """One entry registered, nothing else: the loader, the help, the checks, the verifier's rule,
    the exact Q's right answers and the answer space are the entry's; a field left out (None,
    False) is refused or skipped where it is read, naming the tasks that have it."""
    space = [str(v) for v in range(200, 800, 2)]
    monkeypatch.setitem(data.TASKS, "doubling", doubling_task(
        train_is_eval=True, right_answers=data.the_gold, answer_space=lambda: space))
    assert data.load_task("doubling", "test", n=2) == [
        dict(prompt="100+100=", answer="200", task="arith"),
        dict(prompt="110+110=", answer="220", task="arith")]
    assert "or doubling" in data.task_names() and brorl.parse_config(["--task", "doubling"])
    cfg = brorl.Config(task="doubling", train_prompts=2, answer_prompts=2, eval_prompts=4)
    assert checks.check_config(cfg) == "" and setup.pick_verifier(cfg) == "rules"
    assert answers.space("doubling") == space
    evals = data.load_task("doubling", "test")
    assert mass.prompt_set(cfg, evals) == evals
    # The same name without those fields: each reader says which tasks have what it needs.
    monkeypatch.setitem(data.TASKS, "doubling", doubling_task())
    assert checks.check_config(cfg) == (
        "--train_prompts 2: needs a task whose training set is its eval set (keys, sets), "
        "not --task doubling")
    assert checks.check_config(brorl.Config(task="doubling", answer_prompts=2)).startswith(
        "--answer_prompts 2: the whole answer distribution needs --task sets (")
    assert answers.space("doubling") == [] and mass.prompt_set(cfg, evals) == []


@pytest.mark.slow
def test_a_task_added_in_one_place_trains(tmp_path, monkeypatch, capsys):
    """A made-up task is refused before it is in the table; added (one entry, here alone), a run
    trains on its prompts, is evaluated on its held-out ones and logs their exact Q."""
    argv = ["--task", "doubling", "--steps", "2", "--eval_every", "2", "--sample_groups", "1",
            "--out", str(tmp_path), *TINY]
    assert "--task doubling: unknown task" in refusal(capsys, argv)
    calls = []
    monkeypatch.setitem(data.TASKS, "doubling", doubling_task(calls, right_answers=data.the_gold))
    rows = brorl.train(brorl.parse_config(argv))
    assert [r["step"] for r in rows] == [0, 1, 2] and sorted(set(calls)) == ["test", "train"]
    assert json.loads((tmp_path / "config.json").read_text())["task"] == "doubling"
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    prompts = {x["prompt"]: x["answer"] for x in data.load_task("doubling", "all")}
    trained, evaluated = ({x["prompt"] for x in samples if x["kind"] == kind}
                          for kind in ("train", "eval"))
    held_out = {x["prompt"] for x in data.load_task("doubling", "test")}
    assert trained and trained <= set(prompts) - held_out and evaluated and evaluated <= held_out
    assert all(prompts[x["prompt"]] == x["answer"] for x in samples if x["kind"] == "eval")
    # The exact Q of the eval prompts, from the entry's right answers.
    assert set(rows[0]["mass_exact_prompts"]) == evaluated and rows[2]["mass_exact_mean"] > 0


def branches_on_a_task_name(path: Path) -> list:
    """(line, code) of each comparison in path with a task's name (==, !=, in, a tuple of names)
    and each startswith/endswith of one: a branch on a task that its entry should hold."""
    names = set(data.TASKS)

    def named(node) -> bool:
        elts = node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set)) else [node]
        return any(isinstance(e, ast.Constant) and isinstance(e.value, str)
                   and e.value.split(":")[0] in names for e in elts)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare) and any(map(named, [node.left, *node.comparators])):
            found.append((node.lineno, ast.unparse(node)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("startswith", "endswith") and any(map(named, node.args))):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_no_task_name_is_branched_on_outside_the_table():
    """No code but the tests compares a value with a task's name: what a task changes is a field
    of its entry (data.TASKS), read where it counts. verify.py is apart: its comparisons are of its
    own rules (verify.TASKS: arith, sets, math), which an entry names as its `rule`."""
    root = Path(__file__).resolve().parents[1]
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard",
                             "*.py"], cwd=root, capture_output=True, text=True, check=True)
    files = [f for f in listed.stdout.split() if (root / f).is_file()
             and not f.startswith("tests/") and f not in ("test_brorl.py", "verify.py")]
    assert "data.py" in files and "lib/mass.py" in files
    found = [(f, *hit) for f in files for hit in branches_on_a_task_name(root / f)]
    assert found == []
    assert branches_on_a_task_name(root / "verify.py")  # the check sees a branch where one is


# ----------------------------------------------------------------------------
# schemas and sources


def test_gsm8k_gold_is_the_final_number_alone(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    rows = data.load_task(f"gsm8k:{path}", "all")
    assert [r["answer"] for r in rows] == ["7029", "2.5", "-5", "132"]
    assert rows[0]["prompt"] == GSM8K[0]["question"] + " " + data.MATH_SUFFIX and rows[0]["task"] == "math"
    train, test = data.load_task(f"gsm8k:{path}", "train"), data.load_task(f"gsm8k:{path}", "test")
    assert sorted(map(str, train + test)) == sorted(map(str, rows))  # the hash split partitions the rows


def test_math_gold_from_answer_or_the_solutions_last_box(tmp_path):
    rows = data.load_task(f"math:{write_jsonl(tmp_path / 'math.jsonl', MATH)}", "all")
    assert [r["answer"] for r in rows] == ["\\frac{5}{6}", "-3", "\\left(1, \\{2\\}\\right)", "204"]
    assert all(r["prompt"].endswith(" " + data.MATH_SUFFIX) for r in rows)
    # the gold reads as the verifier reads a model's answer: the same last box
    for row, ex in zip(MATH, rows):
        if row.get("solution"):
            assert verify.extract_answer(row["solution"]) == ex["answer"]


def test_deepscaler_sample_and_json_array(tmp_path):
    rows = data.load_task(f"math:{data.MATH_SAMPLE}", "all")  # DeepScaleR's schema is the math schema
    assert len(rows) == 16
    path = tmp_path / "rows.json"
    path.write_text(json.dumps(GSM8K))
    assert [r["answer"] for r in data.load_task(f"gsm8k:{path}", "all")] == ["7029", "2.5", "-5", "132"]


def test_parquet_through_datasets(tmp_path):
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed (requirements.txt has it)")
    path = tmp_path / "math.parquet"
    datasets.Dataset.from_list([{"problem": f"What is {i}+{i}?", "answer": str(2 * i), "level": i % 3}
                                for i in range(7)]).to_parquet(str(path))
    rows = data.load_task(f"math:{path}", "all")
    assert [r["answer"] for r in rows] == [str(2 * i) for i in range(7)]
    assert rows[3]["prompt"] == f"What is 3+3? {data.MATH_SUFFIX}"


def test_hub_source_spec_is_parsed(monkeypatch):
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed (requirements.txt has it)")
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append((a, k)) or [{"problem": "p", "answer": "1"}])
    data.load_task("math:HuggingFaceH4/MATH-500@test", "all")
    data.load_task("math:org/set:cfg", "all")
    data.load_task("math:openai/gsm8k:main@test", "all")
    assert calls == [(("HuggingFaceH4/MATH-500", None), {"split": "test"}), (("org/set", "cfg"), {"split": "train"}),
                     (("openai/gsm8k", "main"), {"split": "test"})]


@pytest.mark.parametrize("schema, rows, match", [
    ("gsm8k", GSM8K[:2] + [{"question": "q", "answer": "no final line"}], r"row 3: 'answer' must end in '#### <number>'"),
    ("gsm8k", GSM8K[:1] + [{"question": "q", "answer": "#### twelve"}], r"row 2: 'answer' must end in '#### <number>'"),
    ("gsm8k", [{"problem": "p", "answer": "#### 1"}], r"row 1: missing key 'question'"),
    ("math", MATH[:1] + [{"problem": "p", "solution": "no box here"}], r"row 2: no 'answer', and its 'solution' has no closed"),
    ("math", [{"problem": "p", "solution": "\\boxed{unclosed"}], r"row 1: no 'answer'"),
    ("math", [{"problem": "p", "answer": True}], r"row 1: 'answer' must be a non-empty string, got True"),
    ("math", [{"problem": "  ", "answer": "1"}], r"row 1: 'problem' must be a non-empty string"),
    ("math", [["p", "1"]], r"row 1: expected a JSON object"),
])
def test_bad_rows_name_the_file_and_row(tmp_path, schema, rows, match):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + match):
        data.load_task(f"{schema}:{path}", "train")


def test_a_file_that_is_not_utf8_names_the_line(tmp_path):
    path = tmp_path / "latin1.jsonl"
    lines = [json.dumps(r) for r in MATH[:2]] + ['{"problem": "caf\u00e9?", "answer": "1"}']
    path.write_bytes("\n".join(lines[:2]).encode() + b"\n" + lines[2].encode("latin-1") + b"\n")
    with pytest.raises(ValueError, match=re.escape(str(path)) + r": line 3 is not UTF-8"):
        data.load_task(f"math:{path}", "all")


@pytest.mark.parametrize("task, split, match", [
    ("gsm8k:", "train", "unknown task"), ("mmlu:x.jsonl", "train", "unknown task"),
    ("arith", "all", "no split 'all'"), ("math:/no/such.jsonl", "train", "no such file"),
    (f"math:{data.MATH_SAMPLE}", "validation", "split"),
])
def test_load_task_errors(task, split, match):
    with pytest.raises(ValueError, match=match):
        data.load_task(task, split)


# ----------------------------------------------------------------------------
# prompts as the model sees them

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_prompt_text_with_and_without_a_chat_template():
    tok = data.build_tokenizer()  # the embedded byte-level tokenizer: one token per character
    prompt = data.load_task(f"math:{data.MATH_SAMPLE}", "all")[0]["prompt"]
    ids = sampler.encode_prompt(tok, prompt)
    assert tok.decode(ids) == prompt  # no template: the problem and ProRL's suffix, nothing else
    with pytest.raises(ValueError, match="chat template"):
        sampler.encode_prompt(tok, prompt, system_prompt="Be brief.")
    tok.chat_template = CHATML
    text = tok.decode(sampler.encode_prompt(tok, prompt, system_prompt="Be brief."))
    assert text == (f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{prompt}<|im_end|>\n"
                    "<|im_start|>assistant\n")
    assert tok.decode(sampler.encode_prompt(tok, prompt)).startswith("<|im_start|>user\n")


# ----------------------------------------------------------------------------
# end to end on the CPU: a gsm8k run, --eval_only, the evaluation's own random stream

TINY = ["--n_rollouts", "8", "--prompts_per_step", "2", "--max_rounds", "2", "--eval_prompts", "3",
        "--eval_samples", "6", "--probe_prompts", "2", "--max_new_tokens", "6", "--max_rows", "64",
        "--long_prompts", "allow"]  # a math prompt is past the embedded model's 64 positions


@pytest.fixture(scope="module")
def gsm8k_file(tmp_path_factory):
    rows = [{"question": f"{a}+{b}=", "answer": f"#### {a + b:,}"} for a in range(480, 520) for b in (511, 620)]
    return write_jsonl(tmp_path_factory.mktemp("gsm8k") / "gsm8k.jsonl", rows)


@pytest.mark.slow
def test_gsm8k_run_then_eval_only_of_its_checkpoint(tmp_path, gsm8k_file):
    run, ev = tmp_path / "run", tmp_path / "eval"
    rows = brorl.train(brorl.parse_config(["--task", f"gsm8k:{gsm8k_file}", "--steps", "2", "--eval_every", "2",
                                           "--out", str(run), *TINY]))
    assert [r["step"] for r in rows] == [0, 1, 2] and (run / "ckpt" / "model.safetensors").exists()
    before = (run / "ckpt" / "model.safetensors").read_bytes()
    p = subprocess.run([sys.executable, "brorl.py", "--eval_only", "--model", str(run), "--task", f"gsm8k:{gsm8k_file}",
                        "--out", str(ev), *TINY], cwd=Path(brorl.__file__).parent, capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads((ev / "eval.json").read_text())
    b = report["benchmarks"][f"gsm8k:{gsm8k_file}"]
    assert b["prompts"] == 3 and b["samples"] == 6 and list(b["pass@k"]) == ["1", "2", "4", "6"]
    assert 0 <= b["truncation_rate"] <= 1 and 0 < b["mean_response_tokens"] <= 6
    # nothing written but eval.json: the model is untouched
    assert (run / "ckpt" / "model.safetensors").read_bytes() == before and sorted(os.listdir(ev)) == ["eval.json"]
    assert "pass@1" in p.stdout and f"gsm8k:{gsm8k_file}" in p.stdout  # the table


def test_eval_only_equals_the_runs_step0_evaluation(tmp_path, gsm8k_file):
    """One evaluate function, one random-stream recipe: --eval_only of the starting model gives
    exactly the metrics a training run logs at step 0 with the same seed and settings."""
    common = ["--task", f"gsm8k:{gsm8k_file}", "--eval_task", f"gsm8k:{gsm8k_file}", "--seed", "3", "--eval_overlap", "1", *TINY]
    rows = brorl.train(brorl.parse_config([*common, "--steps", "0", "--out", str(tmp_path / "run"), "--save", "false"]))
    report = brorl.eval_only(brorl.parse_config([*common, "--eval_only", "--out", str(tmp_path / "eval")]))
    b = report["benchmarks"][f"gsm8k:{gsm8k_file}"]
    step0 = rows[0]
    assert b["pass@k"] == {k: step0[f"eval_pass@{k}"] for k in b["pass@k"]}
    assert (b["greedy_pass@1"], b["mean_response_tokens"], b["truncation_rate"]) == (
        step0["eval_greedy_pass@1"], step0["eval_resp_len"], step0["eval_truncated"])


@pytest.mark.slow
def test_training_does_not_depend_on_eval_every(tmp_path):
    """Evaluation and the probe draw from their own stream: evaluating at every step or only at the
    end leaves the training trajectory and the final evaluation unchanged."""
    common = ["--steps", "3", "--n_rollouts", "8", "--eval_prompts", "2", "--eval_samples", "4",
              "--probe_prompts", "1", "--max_rounds", "2", "--save", "false", "--max_rows", "64"]
    every = brorl.train(brorl.parse_config([*common, "--eval_every", "1", "--out", str(tmp_path / "a")]))
    once = brorl.train(brorl.parse_config([*common, "--eval_every", "3", "--out", str(tmp_path / "b")]))
    drop = lambda r: {k: v for k, v in r.items() if not k.startswith("time") and k != "tokens_per_s"}
    assert [drop(once[i]) for i in (1, 2)] == [{k: v for k, v in drop(every[i]).items()
                                                if not k.startswith(("eval_", "mass"))} for i in (1, 2)]
    assert drop(once[3]) == drop(every[3]) and drop(once[0]) == drop(every[0])


def test_system_prompt_without_a_chat_template_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit):
        brorl.train(brorl.parse_config(["--system_prompt", "Be brief.", "--out", str(tmp_path / "r"), *TINY]))
    assert "--system_prompt: the tokenizer of" in capsys.readouterr().err and not (tmp_path / "r").exists()


# ----------------------------------------------------------------------------
# the verifier on the families real model outputs use


@pytest.mark.parametrize("pred, gold", [
    # thousands separators with \! or a space after the comma, and a braced comma with a space
    ("32,\\! 349", "32349"), ("32,\\!349", "32349"), ("1,\\!000,\\! 000", "1000000"), ("14 {, }916", "14916"),
    ("\\$32,\\! 349", "32,349"),
    # percent as a word
    ("28 pct", "28"), ("28 percentage", "28\\%"), ("28\\text{ pct}", "28"),
    # inline and display math delimiters
    ("\\(5\\)", "5"), ("\\[ \\frac{1}{2} \\]", "0.5"), ("\\(\\sqrt{2}\\)", "\\sqrt2"), ("\\[(1, 2)\\]", "(1,2)"),
    # a label on the left
    ("(p, q) = (2, 3)", "(2, 3)"), ("f(x) = 2x+1", "2x+1"), ("a_1 = 4", "4"), ("m\\angle ABC = 30", "30"),
    ("p+q = 7", "7"), ("x' = 3", "3"), ("x = 5", "5"),
])
def test_verifier_families_match(pred, gold):
    assert verify.is_equiv(pred, gold) and verify.is_equiv(gold, pred)


@pytest.mark.parametrize("pred, gold", [
    ("1, 234", "1234"),  # a comma and a space, no \!: a list
    ("32,\\! 34", "3234"),  # not three digits after the separator: not a number
    ("28 pct", "0.28"),  # units are dropped, never converted
    ("2x = 6", "6"), ("2x = 6", "3"),  # a digit on the left: an equation, not a label
    ("x = 1 = y", "1"),  # two '=': no label to drop
    ("-x = 5", "5"),  # a label never starts with a sign: -x = 5 means x = -5
    ("\\(5\\)", "\\(6\\)"),
])
def test_verifier_families_do_not_overmatch(pred, gold):
    assert not verify.is_equiv(pred, gold)


@pytest.mark.parametrize("completion, gold, expected", [
    ("So $x = \\boxed{2}$, $y = \\boxed{3}$.", "2, 3", 1.0),  # an answer split over boxes
    ("The roots are \\boxed{3} and \\boxed{-5}.", "-5, 3", 1.0),  # a bare list is a set
    ("\\(\\boxed{1}\\), \\(\\boxed{2}\\)", "\\{1, 2\\}", 1.0),
    ("The roots are \\boxed{3} and \\boxed{-5}.", "-5", 0.0),  # two answers never equal one
    ("\\boxed{3} or \\boxed{5}", "5", 1.0),  # a hedge is not one answer: the last box decides
    ("\\boxed{4}. Wait, that is wrong: \\boxed{5}", "5", 1.0),
    ("\\boxed{3} \\boxed{3}", "3", 1.0),  # the same box twice is one answer
    ("So \\[\\boxed{\\frac{1}{2}}\\]", "1/2", 1.0),
    ("The answer is \\(28\\) pct.", "28", 1.0),
    ("x = \\boxed{2}, y = \\boxed{3}", "(2, 3)", 0.0),  # a list is a set, the gold a tuple
    (" ".join(f"\\boxed{{{i}}}" for i in range(200)), "199", 0.0),  # every candidate boxed
])
def test_several_boxes_policy(completion, gold, expected):
    assert verify.reward(completion, gold) == expected


def test_verifier_stays_total_on_the_new_families():
    ugly = ["\\boxed{" * 50 + "," * 500, ",\\!" * 2000, "{, }" * 2000, "\\(" * 3000, "(p,q)=" * 300,
            "\\boxed{1}, " * 5000 + "\\boxed{2}", "x = \\boxed{" + "y = \\boxed{" * 100, "a=" + "(" * 900]
    for text in ugly:
        assert verify.reward(text, "1") in (0.0, 1.0) and verify.is_equiv(text, text[:500]) in (True, False)


def test_without_datasets_a_parquet_file_or_hub_dataset_says_what_to_install(monkeypatch, tmp_path, capsys):
    """The optional datasets package reads .parquet files and hub datasets: without it, one line naming it and
    the install command (the run stops there), not a ModuleNotFoundError."""
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: `import datasets` raises ImportError
    path = tmp_path / "math.parquet"
    path.write_bytes(b"PAR1")
    for source in (str(path), "HuggingFaceH4/MATH-500@test"):
        with pytest.raises(ValueError, match=r"needs the datasets package: pip install datasets") as e:
            data.load_task(f"math:{source}", "all")
        assert str(e.value).startswith(source) and "\n" not in str(e.value)
    with pytest.raises(SystemExit):
        setup.load_data(brorl.Config(), "--task", f"math:{path}", "train", 0)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --task math:{path}: ") and "pip install datasets" in err and "\n" not in err
