"""Every common decoder-only family trains: Llama, Mistral, Qwen2, Qwen3, Phi-3, OLMo 2, Gemma 2 and
Gemma 3 (text-only), each as a tiny random model (2 layers, the embedded tiny-arith tokenizer's 258
tokens). Against transformers' own eager attention with no cache (the reference): the sampler's
greedy tokens are generate()'s, and the sampler's and the update's log-probs are a plain forward's.
Mistral and Gemma get a sliding window of 4 (prompts and responses run past it), Gemma 2 soft-caps
its attention scores and its logits, small caps so that each matters. Then two training steps
each; a run saved and resumed (Gemma 2; Phi-3 with LoRA on its fused projections); and a family
that cannot be served, or a config.json that transformers refuses, refused with one line."""

import json
import math
import shutil
from types import SimpleNamespace

import pytest
import torch
import transformers
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import brorl
import data
import sampler
from lib import logprobs, plan, planner, policy, step
from test_brorl import run_in_process

# The families, each a config class and what sets it apart from the common shape. Gemma keeps its
# tied embeddings (its default), the others get a separate head.
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", dict(sliding_window=4)),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    "gemma2": ("Gemma2Config", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                    attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                    tie_word_embeddings=True)),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                        layer_types=["sliding_attention", "full_attention"],
                                        tie_word_embeddings=True)),
}
# Different lengths (1 to 9 tokens, the prefix padded to 16): with 12 new tokens every sequence
# runs past a window of 4.
PROMPTS = ["123+45=", "9+1=", "77+123+1=", "5"]
MAX_NEW = 12
# The sampler's and the update's log-probs against the reference forward's, in fp32: the same
# arithmetic summed in other orders (the cascade's split softmax, SDPA, the fused log-prob), a few
# float32 spacings of log-probs of up to ~14 (9.5e-7 at 8) through 2 layers: seen up to 6.4e-6.
ATOL = 2e-5


def build(family: str, path, **overrides):
    """A tiny random model of `family` with the embedded tokenizer, saved to `path`. Initialised
    loudly (a near-uniform model would hide a wrong mask), and EOS made the argmax wherever "1"
    would be, so that greedy lengths vary."""
    tok = AutoTokenizer.from_pretrained(data.EMBEDDED_MODEL)
    name, extra = FAMILIES[family]
    torch.manual_seed(0)
    cfg = getattr(transformers, name)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        initializer_range=0.3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        bos_token_id=None, **{"tie_word_embeddings": False, **extra, **overrides})
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head[tok.eos_token_id] = 1.5 * head[tok.convert_tokens_to_ids("1")]
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, path, the policy as brorl loads it, tokenizer, the reference: the same weights on
    transformers' eager attention)."""
    path = build(request.param, tmp_path_factory.mktemp(request.param))
    model, tok = policy.load_policy(str(path), torch.device("cpu"))
    ref = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    return request.param, path, model.eval(), tok, ref.eval()


def reference_logprobs(ref, prompt_ids, tokens, temperature):
    """log_softmax(logits / T) of the reference's plain forward (no cache) over prompt + response,
    at the response's tokens: (T,)."""
    ids = torch.tensor([prompt_ids + tokens])  # (1, P + T)
    with torch.no_grad():
        logits = ref(ids).logits[0, len(prompt_ids) - 1: -1]  # (T, V): each predicts the next
    return torch.log_softmax(logits.double() / temperature, -1).gather(
        1, torch.tensor(tokens)[:, None])[:, 0]


def test_greedy_tokens_are_generates(family):
    """Greedy, 2 rollouts a prompt: each is the reference's generate(), token for token."""
    name, _, model, tok, ref = family
    ro = sampler.generate(model, tok, PROMPTS, 2, MAX_NEW, 0.0, 1.0, 4096, [1, 2, 3, 4])
    lengths = set()
    for b, prompt in enumerate(PROMPTS):
        ids = torch.tensor([tok(prompt)["input_ids"]])
        out = ref.generate(ids, max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=0,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        want = out[0, ids.shape[1]:].tolist()  # (<= MAX_NEW,), EOS included
        for row in (2 * b, 2 * b + 1):
            assert ro.tokens[row][ro.mask[row]].tolist() == want, (name, prompt)
        lengths.add(len(want))
    assert max(lengths) == MAX_NEW  # past the window of 4, prompt and response alike


def test_sampler_and_update_logprobs_are_a_plain_forwards(family):
    """Sampled at T = 1.3 (5 rollouts a prompt): each response's log-probs from the sampler (cascade
    decode), and from the update's forward (lib/logprobs.py: prompts once, left-padded), equal the
    reference's plain forward's at those tokens."""
    name, _, model, tok, ref = family
    ro = sampler.generate(model, tok, PROMPTS, 5, MAX_NEW, 1.3, 1.0, 4096, [5, 6, 7, 8])
    batch = step.pack_groups([ro.group(g) for g in range(len(PROMPTS))])
    with torch.no_grad():
        update = logprobs.response_logprobs(model, batch, torch.arange(len(ro.texts)), 1.3)
    for row in range(len(ro.texts)):
        n = int(ro.mask[row].sum())
        want = reference_logprobs(ref, ro.prompt_ids[row // 5], ro.tokens[row, :n].tolist(), 1.3)
        torch.testing.assert_close(ro.logp[row, :n].double(), want, atol=ATOL, rtol=0,
                                   msg=f"{name}: the sampler's log-probs, row {row}")
        torch.testing.assert_close(update[row, :n].double(), want, atol=ATOL, rtol=0,
                                   msg=f"{name}: the update's log-probs, row {row}")
    assert ro.mask.sum(1).max() == MAX_NEW


SMALL = ["--n_rollouts", "16", "--prompts_per_step", "2", "--eval_prompts", "2",
         "--eval_samples", "2", "--probe_prompts", "2", "--probe_samples", "16",
         "--max_new_tokens", "8", "--max_rows", "256"]


def every_other(rollouts, answers, task, verifier="rules", tok=None, lenient=False):
    """A stand-in for lib/step.score: a random model never answers right, so every other rollout is
    rewarded, and every group has signal (the lenient reading, asked by evaluations, the same)."""
    r = (torch.arange(len(rollouts.tokens)) % 2).float()  # (B*N,); step.score's shapes:
    r = r.view(-1, rollouts.n) if isinstance(rollouts.n, int) else r  # (B, N) for one n
    return (r, r.clone()) if lenient else r


@pytest.mark.slow
def test_two_training_steps(family, tmp_path, monkeypatch):
    """python brorl.py --model DIR --steps 2, in this process, with every other rollout rewarded:
    each step updates the weights through the family's whole forward and backward."""
    name, path, *_ = family
    monkeypatch.setattr(step, "score", every_other)
    rows = brorl.train(brorl.parse_config([
        "--model", str(path), "--steps", "2", "--eval_every", "2", "--out", str(tmp_path / "run"),
        *SMALL]))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:  # the two steps: every number finite, an update made
        bad = {k: v for k, v in r.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad and r["grad_norm"] > 0, (name, bad, r)


@pytest.mark.slow
@pytest.mark.parametrize("name, flags", [
    ("gemma2", []),  # tied embeddings, soft-capped logits
    ("phi3", ["--lora_rank", "4", "--lora_targets", "qkv_proj,o_proj,gate_up_proj,down_proj"]),
])
def test_a_run_saves_and_resumes_exactly(tmp_path, monkeypatch, name, flags):
    """2 steps in one go == 1 step, saved, then --resume to 2: the checkpoint (a full model, or
    Phi-3's fused projections' LoRA adapter) holds everything the run continues from."""
    path = build(name, tmp_path / "model")
    monkeypatch.setattr(step, "score", every_other)
    common = ["--model", str(path), "--eval_every", "1", *SMALL, *flags]
    rows_a = brorl.train(brorl.parse_config(["--steps", "2", "--out", str(tmp_path / "a"),
                                             *common]))
    brorl.train(brorl.parse_config(["--steps", "1", "--out", str(tmp_path / "b"), *common]))
    rows_b = brorl.train(brorl.parse_config(["--resume", str(tmp_path / "b"), "--steps", "2"]))
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time")
                       and k != "tokens_per_s"}
    assert [strip(r) for r in rows_b] == [strip(r) for r in rows_a] and len(rows_a) == 3
    if flags:  # the planner counts the fused projections' adapter as saved
        from safetensors.torch import load_file
        saved = load_file(tmp_path / "a" / "ckpt" / "adapter_model.safetensors")
        cfg = SimpleNamespace(lora_rank=4, lora_targets=flags[-1])
        assert planner.lora_param_count(AutoConfig.from_pretrained(path), cfg) == sum(
            w.numel() for w in saved.values())


@pytest.mark.parametrize("family_name, overrides, needle", [
    ("gemma3", dict(use_bidirectional_attention=True), "bidirectional attention"),
    ("qwen2", dict(layer_types=["full_attention", "chunked_attention"]), "chunked_attention"),
])
def test_a_family_it_cannot_serve_is_refused_with_one_line(tmp_path, capsys, family_name,
                                                           overrides, needle):
    path = build(family_name, tmp_path / "model", **overrides)
    capsys.readouterr()  # the model's save may draw a progress bar: not the run's output
    code, err = run_in_process(capsys, "--model", str(path), "--steps", "1",
                               "--out", str(tmp_path / "run"))
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert str(path) in lines[0] and family_name in lines[0] and needle in lines[0]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("edit, reason", [
    (dict(layer_types=["full_attention"]),
     "`num_hidden_layers` (3) must be equal to the number of `layer_types` (1)"),
    (dict(num_attention_heads="four"),
     "Field 'num_attention_heads' expected int, got str (value: 'four')"),
])
def test_a_config_transformers_refuses_is_one_line(tmp_path, capsys, edit, reason):
    """A config.json that transformers' own validation refuses (huggingface_hub's
    StrictDataclassError, neither an OSError nor a ValueError): a run, and --plan, stop with one
    line naming the model and the field, before --out is made."""
    path = tmp_path / "model"
    shutil.copytree(data.EMBEDDED_MODEL, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, **edit}))
    line = f"error: --model {path}: its config.json is refused by transformers ({reason})"
    code, err = run_in_process(capsys, "--model", str(path), "--steps", "1",
                               "--out", str(tmp_path / "run"))
    assert code == 2 and err.strip().splitlines() == [line], err[-2000:]
    assert not (tmp_path / "run").exists()
    with pytest.raises(SystemExit) as e:
        plan.plan(brorl.parse_config(["--model", str(path), "--plan"]))
    assert e.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [line]
