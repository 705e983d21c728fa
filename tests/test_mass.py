"""The exact correct mass (lib/mass.py): against the model's full logits, against enumeration of every
response on a tiny vocabulary, and against the sampler's rate of the exact answer (binomial error)."""

import itertools
import json
import math

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

import data
from lib import mass
from lib.policy import load_policy
from sampler import generate


@pytest.fixture(scope="module")
def arith():
    model, tok = load_policy(str(data.EMBEDDED_MODEL), torch.device("cpu"))
    return model.eval(), tok


def full_logits_log_mass(model, tok, examples, temperature):
    """The oracle: every position's logits, tempered, log-softmax in float64, the answer's tokens gathered."""
    out = []
    for x in examples:
        p = tok(x["prompt"])["input_ids"]
        a = tok(x["answer"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([p + a])).logits[0, len(p) - 1: -1].double()  # (len(a), V)
        out.append(torch.log_softmax(logits / temperature, -1).gather(1, torch.tensor(a)[:, None]).sum().item())
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_exact_mass_equals_the_full_logits(arith, temperature):
    """Prompts of different lengths and answers of 3 and 4 digits in one batch: padding on both sides."""
    model, tok = arith
    examples = data.load_task("arith", "test", n=5, digits=3) + data.load_task("arith", "test", n=3, digits=2)
    examples.append(dict(prompt="999+999=", answer="1998", task="arith"))
    got = mass.exact_log_mass(model, tok, examples, data.the_gold, temperature)
    want = full_logits_log_mass(model, tok, examples, temperature)
    assert torch.allclose(got, want, atol=1e-4, rtol=0), (got, want)  # float32 per token, ~5 tokens


def tiny_vocabulary_model(V=4, seed=0):
    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
                         tie_word_embeddings=False, eos_token_id=V - 1, pad_token_id=0)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # logits far from uniform: a wrong position or temperature moves the sums
        model.lm_head.weight.mul_(30)
    model.config._attn_implementation = "brorl"
    return model


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_exact_mass_sums_to_one_over_every_response(temperature):
    """Every response of length L over a vocabulary of 4 (4^3 = 64): the chain rule makes their masses sum to
    1; and the mass of stopping within L tokens (every EOS-ended response, with no EOS before its end) plus
    the mass of the responses that run past L without EOS is 1 as well, for prompts of two lengths at once."""
    V, L, eos = 4, 3, 3
    model = tiny_vocabulary_model(V)
    for prompt in ([0, 1], [2, 1, 0, 1]):
        every = [list(s) for s in itertools.product(range(V), repeat=L)]
        q = mass.sequence_log_mass(model, [prompt] * len(every), every, temperature).exp()
        assert abs(q.sum().item() - 1) < 1e-5, q.sum()
        stopped = [list(s) + [eos] for k in range(L) for s in itertools.product(range(V - 1), repeat=k)]  # 1 + 3 + 9
        running = [list(s) for s in itertools.product(range(V - 1), repeat=L)]  # 27: no EOS in L tokens
        total = mass.sequence_log_mass(model, [prompt] * (len(stopped) + len(running)), stopped + running,
                                       temperature).exp().sum().item()
        assert abs(total - 1) < 1e-5, total
        assert q.max() > 0.3  # peaked: a uniform model would make the sums hold trivially


@pytest.mark.slow
def test_exact_mass_matches_the_sampled_rate(arith):
    """The sampler's share of rollouts that are exactly the gold answer (then EOS) is Q, within binomial
    error: 4,096 samples a prompt, |rate - Q| < 4.5 standard errors for each of 6 prompts."""
    model, tok = arith
    examples = data.load_task("arith", "test", n=6, digits=3, seed=3)
    q = mass.exact_log_mass(model, tok, examples, data.the_gold, 1.0).exp()  # (6,)
    n = 4096
    seeds = [12345 + i for i in range(len(examples))]
    ro = generate(model, tok, [x["prompt"] for x in examples], n, 6, 1.0, 1.0, 4096, seeds)
    exact = torch.tensor([t == examples[i // n]["answer"] and not tr for i, (t, tr) in
                          enumerate(zip(ro.texts, ro.truncated.tolist()))]).view(-1, n).double()  # (6, n)
    rate = exact.mean(1)
    se = (q * (1 - q) / n).sqrt()
    assert ((rate - q).abs() < 4.5 * se + 1e-9).all(), (rate, q)
    assert (q > 0.01).all() and (q < 0.9).all()  # rates where the test has power


def test_zones_and_metrics():
    log_q = torch.tensor([0.0, -math.log(16), -math.log(16) - 1e-9, -math.log(512), -math.log(512) - 1e-9, -50.0], dtype=torch.float64)
    assert mass.zone_counts(log_q, 16, 512) == dict(high=2, gate=2, low=2)  # 1/16 is high, 1/512 is gate
    below = lambda x: math.nextafter(x, -math.inf)
    assert [mass.zone(x, 16, 512) for x in (-math.log10(16), below(-math.log10(16)), -math.log10(512),
                                            below(-math.log10(512)))] == ["high", "gate", "gate", "low"]  # exact bounds


def test_prompt_set():
    """The eval set, or --mass_prompts training problems drawn by --eval_seed alone (not --seed: runs of every
    seed pair prompt by prompt); nothing where a prompt has no canonical answer."""
    from types import SimpleNamespace as NS
    cfg = lambda **kw: NS(**{**dict(task="arith", eval_task="", mass_prompts=0, train_prompts=0,
                                    eval_seed=0, digits=3), **kw})
    evals = data.load_task("arith", "test", n=4)
    assert mass.prompt_set(cfg(), evals) == evals
    got = mass.prompt_set(cfg(mass_prompts=50), evals)
    assert len(got) == 50 and all(data.split_of(x["prompt"]) == "train" for x in got)
    assert got == mass.prompt_set(cfg(mass_prompts=50), evals) != mass.prompt_set(cfg(mass_prompts=50, eval_seed=1), evals)
    assert len(mass.prompt_set(cfg(task="keys", mass_prompts=2000), evals)) == 512  # all of them
    assert mass.prompt_set(cfg(task="math:x.jsonl"), evals) == []
    math_rows = [dict(prompt="p", answer="\\frac{1}{2}", task="math")]
    assert mass.prompt_set(cfg(eval_task="math:x.jsonl"), math_rows) == []  # the eval set's task has none
    assert len(mass.prompt_set(cfg(eval_task="math:x.jsonl", mass_prompts=5), math_rows)) == 5  # arith's own
    assert mass.prompt_set(cfg(task="math:x.jsonl", eval_task="arith"), evals) == []  # as before: --task's too
    with pytest.raises(SystemExit):  # more than a 1-digit split holds: one line
        mass.prompt_set(cfg(mass_prompts=1000, digits=1), evals)


def test_keys_task():
    rows = data.load_task("keys", "train")
    assert len(rows) == 512 and rows == data.load_task("keys", "test")  # train = eval, by design
    assert len({r["prompt"] for r in rows}) == 512
    for r in rows:
        assert len({r["answer"], *r["decoys"]}) == 5 and all(len(v) == 3 for v in [r["answer"], *r["decoys"]])
        assert 2e-4 <= r["p_right"] <= 0.2


@pytest.mark.slow
def test_a_keys_run_logs_every_prompts_exact_mass(tmp_path):
    """--preset keys: the shipped keys model on its own task; at every eval, the exact Q of its eval prompts
    (here 24 of the 512), its zones summing to them, and the train set is the eval set (train = eval)."""
    import brorl
    cfg = brorl.parse_config(["--preset", "keys", "--steps", "2", "--eval_every", "2", "--n_rollouts", "16",
                              "--prompts_per_step", "2", "--eval_prompts", "24", "--eval_samples", "4",
                              "--probe_prompts", "2", "--probe_samples", "8", "--save", "0", "--out", str(tmp_path / "k")])
    rows = brorl.train(cfg)
    evals = [r for r in rows if "mass_exact_log10" in r]
    assert [r["step"] for r in evals] == [0, 2]
    for r in evals:
        assert len(r["mass_exact_log10"]) == 24
        assert r["mass_exact_high"] + r["mass_exact_gate"] + r["mass_exact_low"] == 24
        assert r["mass_exact_mean"] == pytest.approx(sum(10 ** x for x in r["mass_exact_log10"]) / 24, rel=1e-3)
    spread = json.loads((data.EMBEDDED_MODEL_KEYS / "warmstart.json").read_text())["spread"]
    assert spread["gate"] >= 30  # the shipped warm start is in the regime the study tests
