"""The recipe at real scale: the sampler/trainer drift and the TIS weight it gives, exact sampling
over a 152k vocabulary, the paper's verifier, the smaller rules of a step (mini-batch sizes, top_p),
and --preset paper planned offline. Each test asserts against a reference: a float64 brute force, an
exact expectation, a closed form. (Token whitening, dual-clip, truncated importance sampling and the
groups a step asks for without dynamic sampling are the algorithm's: test_brorl.py.)"""

import copy
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F

import brorl
from lib import checks, logprobs, plan, setup, step
import data
import sampler
import verify
from test_brorl import PROMPTS, random_lm, run_in_process  # noqa: F401  (random_lm is a fixture)


# ----------------------------------------------------------------------------
# sampler/trainer drift and the TIS weight


def _batch(model, tok, n=6, seed=5):
    ro = sampler.generate(model, tok, PROMPTS[:3], n, 8, 1.0, 1.0, 4096, torch.Generator().manual_seed(seed))
    return step.pack_groups([ro.group(g) for g in range(3)])


def _update(model, batch, **cfg_kw):
    m = copy.deepcopy(model).train()
    cfg = brorl.Config(**{"n_minibatches": 1, "micro_batch": 7, **cfg_kw})
    adv = torch.randn(len(batch.resp), generator=torch.Generator().manual_seed(6))
    return brorl.update_policy(m, None, torch.optim.SGD(m.parameters(), lr=0.0), batch, adv, cfg,
                               torch.Generator().manual_seed(0))


def test_drift_and_tis_weight_are_one_in_float32(random_lm):
    model, tok = random_lm
    batch = _batch(model, tok)
    info = _update(model, batch, old_logp="recompute")  # a trainer forward, in float32: the same numbers
    assert 0 <= info["drift_max"] < 1e-5 and info["drift_mean"] <= info["drift_max"]
    with torch.no_grad():
        old = logprobs.response_logprobs(model, batch, torch.arange(len(batch.resp)), 1.0)  # (R, T)
    w = brorl.tis_weight(old, batch.sampler_logp, 2.0)[batch.resp_mask]
    assert (w - 1).abs().max() < 1e-5
    assert _update(model, batch, old_logp="sampler")["drift_max"] == 0.0  # the sampler's: 0 by construction


def test_drift_is_logged_under_bf16_autocast(random_lm):
    """bf16: the sampler's decode and the trainer's forward round differently, and the log says so."""
    model, tok = random_lm
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the sampler in bf16, as rl_step runs it
        batch = _batch(model, tok)
    info = _update(model, batch, dtype="bfloat16")  # --dtype bfloat16: the update autocasts its own forwards
    assert info["drift_max"] > 1e-3 and 0 < info["drift_mean"] < info["drift_max"]


# ----------------------------------------------------------------------------
# exact sampling over a real vocabulary


def peaked_logits(V=151_936, seed=0):
    """A peaked distribution over Qwen's vocabulary: the top token ~0.997, the rest a long tail."""
    g = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(V, generator=g)  # (V,)
    logits[123] = torch.logsumexp(logits, 0) + math.log(0.997 / 0.003)
    return logits


def test_sampler_gives_every_token_its_probability_over_152k_tokens():
    logits = peaked_logits()[None]  # (1, V)
    p = F.softmax(logits.double(), -1)[0]  # (V,) the policy, in float64
    assert p[123] > 0.99 and (p > 0).all()
    cdf = sampler.sampling_cdf(logits, 1.0, 1.0)[0]  # (V,)
    widths = torch.diff(cdf, prepend=cdf.new_zeros(1)) / cdf[-1]  # the sampler's effective distribution
    assert (widths > 0).all()  # every token can be drawn (float32 sums: 127k of them could not)
    assert (widths - p).abs().sum() < 1e-6  # L1 at rounding level (float32 sums: 1.4e-3)
    # and pick_tokens draws from exactly these intervals: u at an interval's middle picks its token
    tail = torch.randperm(len(p), generator=torch.Generator().manual_seed(1))[:64]  # (64,) tail tokens
    mid = ((cdf[tail] - widths[tail] * cdf[-1] / 2) / cdf[-1])  # (64,)
    assert torch.equal(sampler.pick_tokens(logits.expand(64, -1), 1.0, 1.0, mid), tail)


def test_sampler_never_draws_a_zero_probability_token():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    logits[:, 0] = logits[:, -1] = -math.inf  # p = 0 at both ends
    u = torch.tensor([0.0, 1e-300, 1 - 2 ** -53, 0.5], dtype=torch.float64)  # (4,) the extremes of [0, 1)
    toks = sampler.pick_tokens(logits, 1.0, 1.0, u)
    assert toks[0] == 1 and toks[1] == 1 and toks[2] == 48
    assert torch.equal(sampler.pick_tokens(logits, 0.0, 1.0, None), logits.argmax(-1))  # greedy: no u


def test_sampler_frequencies_match_the_policy():
    """A chi-square check on 200k draws of one row's distribution: pick_tokens is a sampler of p."""
    logits = torch.randn(1, 40, generator=torch.Generator().manual_seed(4)) * 1.5
    p = F.softmax(logits.double() / 0.7, -1)[0]
    u = torch.rand(200_000, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    counts = torch.bincount(sampler.pick_tokens(logits.expand(len(u), -1), 0.7, 1.0, u), minlength=40).double()
    chi2 = ((counts - len(u) * p) ** 2 / (len(u) * p)).sum().item()
    assert chi2 < 39 + 5 * math.sqrt(2 * 39)  # 39 degrees of freedom, 5 sigma


# ----------------------------------------------------------------------------
# the verifier: rules, math_verify or both, and the think block the prompt opened


@pytest.fixture
def fake_math_verify(monkeypatch):
    """A stand-in for math-verify: it says yes to answers spelled 'half' for a gold 1/2, no otherwise."""
    fake = types.ModuleType("math_verify")
    fake.parse = lambda text, parsing_timeout=None: text
    fake.verify = lambda gold, pred, timeout_seconds=None: "half" in pred and "1/2" in gold
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    verify._load_math_verify.cache_clear()
    yield
    verify._load_math_verify.cache_clear()


@pytest.fixture
def no_math_verify(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    verify._load_math_verify.cache_clear()
    yield
    verify._load_math_verify.cache_clear()


def test_math_verify_alone_and_both(fake_math_verify):
    assert verify.reward("\\boxed{half}", "1/2", verifier="math_verify") == 1.0
    assert verify.reward("\\boxed{0.5}", "1/2", verifier="math_verify") == 0.0  # the rules are not asked
    assert verify.reward("\\boxed{0.5}", "1/2", verifier="both") == 1.0
    assert verify.reward("\\boxed{half}", "1/2", verifier="both") == 1.0


def test_the_real_math_verify_accepts_what_the_rules_cannot():
    pytest.importorskip("math_verify")  # pinned in requirements.txt: the paper's second opinion
    assert verify.reward("\\boxed{3+2x}", "2x+3", verifier="rules") == 0.0  # no symbolic algebra in the rules
    assert verify.rewards(["\\boxed{3+2x}", "\\boxed{2x+4}"], ["2x+3"] * 2, verifier="both", workers=1) == [1.0, 0.0]
    assert verify.reward("<think>\\boxed{3+2x}", "2x+3", verifier="both") == 0.0  # the same extraction rules


def test_verifier_flag_defaults_to_the_papers_when_installed(fake_math_verify):
    math_task = f"math:{data.MATH_SAMPLE}"
    assert setup.pick_verifier(brorl.Config(task=math_task)) == "both"
    assert setup.pick_verifier(brorl.Config(task=math_task, verifier="math_verify")) == "math_verify"
    assert setup.pick_verifier(brorl.Config(task="arith", verifier="both")) == "rules"  # arith: its own rule


def test_verifier_flag_without_math_verify(no_math_verify, tmp_path, capsys):
    math_task = f"math:{data.MATH_SAMPLE}"
    assert setup.pick_verifier(brorl.Config(task=math_task)) == "rules"
    out = tmp_path / "run"
    code, err = run_in_process(capsys, "--task", math_task, "--verifier", "both", "--out", str(out))
    assert code == 2 and err.strip() == "error: --verifier both: needs the math-verify package (pip install math-verify)"
    assert not out.exists()


R1_TEMPLATE = ("{% for m in messages %}<|User|>{{ m['content'] }}{% endfor %}"
               "{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}")


def test_completion_is_scored_with_the_think_its_prompt_opened():
    tok = data.build_tokenizer()
    texts = ["so the answer is \\boxed{5}",  # still thinking: no answer yet
             "so 5.\n</think>\nThe answer is \\boxed{5}", "</think>\\boxed{4}"]

    def rollouts(tok):
        ids = sampler.encode_prompt(tok, "What is 2+3?")
        R = len(texts)
        zeros = torch.zeros(R, 2)
        return sampler.Rollouts([ids], zeros.long(), zeros.bool(), zeros, zeros, torch.zeros(R, dtype=torch.bool), texts, R)

    assert step.score(rollouts(tok), ["5"], "math", "rules", tok).tolist() == [[1.0, 1.0, 0.0]]  # no think opened
    tok.chat_template = R1_TEMPLATE  # the prompt ends inside "<think>\n"
    assert tok.decode(sampler.encode_prompt(tok, "x")).endswith("<think>\n")
    assert step.score(rollouts(tok), ["5"], "math", "rules", tok).tolist() == [[0.0, 1.0, 0.0]]


def test_score_reads_the_same_responses_leniently_too():
    """step.score(lenient=True): the rules' rewards as without it, and of the same texts the lenient
    verdicts (verify.lenient_rewards); a truncated response scores 0 in both."""
    tok = data.build_tokenizer()
    texts = ["57", "The sum is 57.", "58", "57", "so 57"]
    R = len(texts)
    zeros = torch.zeros(R, 2)
    truncated = torch.tensor([False, False, False, True, True])
    ro = sampler.Rollouts([sampler.encode_prompt(tok, "12+45=")], zeros.long(), zeros.bool(), zeros,
                          zeros, truncated, texts, R)
    rules, lenient = step.score(ro, ["57"], "arith", "rules", tok, lenient=True)
    assert torch.equal(rules, step.score(ro, ["57"], "arith", "rules", tok))
    assert rules.tolist() == [[1.0, 0.0, 0.0, 0.0, 0.0]]
    assert lenient.tolist() == [[1.0, 1.0, 0.0, 0.0, 0.0]]


@pytest.mark.slow
def test_evaluation_scores_each_response_twice(monkeypatch):
    """brorl.evaluate on the tiny embedded model: the rules' figures and the lenient ones of the
    same responses, lenient >= rules problem by problem; with every last number counted right, the
    lenient figures are the untruncated share, and the rules' figures are unchanged (no sampling
    or scoring of the rules depends on the second reading)."""
    cfg = brorl.parse_config(["--eval_prompts", "16", "--eval_samples", "4"])
    cfg, device, _, eval_set, model, tok, _ = setup.setup(cfg, cfg.model, "--model",
                                                          with_train_set=False)

    def evaluate():
        with torch.no_grad():
            return brorl.evaluate(model.eval(), tok, eval_set, cfg,
                                  setup.eval_generator(device, cfg.seed, 0))

    m = evaluate()
    rules_keys = ["eval_pass@1", "eval_greedy_pass@1", "eval_pass@4", "eval_correct",
                  "eval_resp_len", "eval_truncated"]
    assert len(m["eval_lenient_correct"]) == len(m["eval_correct"]) == 16
    assert all(x >= c for x, c in zip(m["eval_lenient_correct"], m["eval_correct"]))
    assert m["eval_lenient_pass@1"] == pytest.approx(sum(m["eval_lenient_correct"]) / 64, abs=1e-6)
    assert m["eval_greedy_lenient_pass@1"] >= m["eval_greedy_pass@1"]
    assert 0 < m["eval_pass@1"] < 1  # a model that gets some right and some wrong
    monkeypatch.setattr(verify, "_number_right", lambda *a: True)
    every = evaluate()
    assert [every[k] for k in rules_keys] == [m[k] for k in rules_keys]
    assert every["eval_lenient_pass@1"] == pytest.approx(1 - m["eval_truncated"], abs=1e-6)
    assert every["eval_greedy_lenient_pass@1"] == 1.0 and m["eval_greedy_pass@1"] < 1.0


# ----------------------------------------------------------------------------
# the smaller rules of a step


@pytest.mark.parametrize("n_minibatches, sizes", [(4, [3, 3, 2, 2]), (3, [4, 3, 3]), (12, [1] * 10)])
def test_minibatches_split_evenly(random_lm, monkeypatch, n_minibatches, sizes):
    model, tok = random_lm
    ro = sampler.generate(model, tok, PROMPTS[:2], 5, 6, 1.0, 1.0, 4096, torch.Generator().manual_seed(9))
    batch = step.pack_groups([ro.group(g) for g in range(2)])  # R = 10 rows
    seen, weights = [], brorl.loss_weights
    monkeypatch.setattr(brorl, "loss_weights", lambda mask, agg, *a: (seen.append(len(mask)), weights(mask, agg, *a))[1])
    _update(model, batch, n_minibatches=n_minibatches)
    assert seen == sizes  # fewer rows than mini-batches: one row each


def test_training_refuses_top_p_below_one():
    assert checks.check_config(brorl.Config()) == ""
    assert checks.check_config(brorl.Config(top_p=0.95)).startswith("--top_p 0.95: training needs top_p = 1")


# ----------------------------------------------------------------------------
# --preset paper: the paper's continuation, planned offline


def paper_shaped_model(tmp_path, **extra):
    """A config-only model directory with the paper's model's shapes (Qwen2-1.5B: DeepSeek-R1-Distill-
    Qwen-1.5B and the ProRL v2 checkpoint made from it) and the embedded tokenizer: what --plan reads."""
    import json
    import shutil
    config = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=1536,
                  intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                  max_position_embeddings=131072, tie_word_embeddings=False, **extra)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data.EMBEDDED_MODEL / name, tmp_path / name)
    return tmp_path


def test_paper_preset_is_the_papers_continuation():
    cfg = brorl.parse_config(["--preset", "paper"])
    assert cfg.model == "nvidia/Nemotron-Research-Reasoning-Qwen-1.5B"  # ProRL v2's checkpoint (its repository)
    assert cfg.task == "math:agentica-org/DeepScaleR-Preview-Dataset"
    assert (cfg.n_rollouts, cfg.prompts_per_step, cfg.max_new_tokens) == (512, 128, 16384)
    assert (cfg.eval_max_new_tokens, cfg.eval_samples) == (32768, 16)  # 32k, 16 samples (T 0.6, top_p 0.95: evaluate)
    assert cfg.lr == pytest.approx(1e-6 * (65536 / 8192) ** 0.5)  # ProRL v2's rate x sqrt(samples per step ratio)
    assert (cfg.n_minibatches, cfg.kl_coef, cfg.adv_norm, cfg.clip_low, cfg.clip_high) == (4, 1e-4, "batch", 0.2, 0.28)
    assert 0 < cfg.ref_reset_every < cfg.steps  # the reference is reset during the run
    assert cfg.grad_ckpt
    assert brorl.parse_config(["--preset", "paper", "--max_new_tokens", "8192"]).max_new_tokens == 8192  # flags win


def test_model_revision_is_split_from_a_hub_id(tmp_path):
    from lib.policy import split_revision
    assert split_revision("nvidia/Nemotron-Research-Reasoning-Qwen-1.5B@v2") == ("nvidia/Nemotron-Research-Reasoning-Qwen-1.5B", "v2")
    assert split_revision("org/name") == ("org/name", None)
    local = tmp_path / "a@b"
    local.mkdir()
    assert split_revision(str(local)) == (str(local), None)  # an existing path is a path


def test_paper_plan_runs_offline_from_a_config_only_model(tmp_path, capsys):
    model = paper_shaped_model(tmp_path)
    plan.plan(brorl.parse_config(["--preset", "paper", "--model", str(model), "--task", "math:assets/math_sample.jsonl",
                                     "--memory_gb", "72", "--dtype", "bfloat16", "--plan"]))
    out = capsys.readouterr().out
    assert "memory plan per rank (1 process(es)" in out and "time per step on one H100" in out  # one GPU
    assert "memory plan per rank (8 process(es)" in out and "time per step on 8 x one H100" in out  # per rank on 8
    assert out.count("update peak (estimate)") == 2


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_planner_models_the_log_prob_path_that_runs_per_rank(tmp_path, softcap):
    """At K = 8 (FSDP) the update's log-probs come from hidden states (distributed.in_forward), so the
    plan holds no (rows, T, V) logits; a head the log-prob kernel cannot take (soft-capping) holds them."""
    from transformers import AutoConfig
    from lib import planner
    mc = AutoConfig.from_pretrained(paper_shaped_model(tmp_path, **({"final_logit_softcapping": softcap} if softcap else {})))
    cfg = brorl.parse_config(["--preset", "paper", "--dtype", "bfloat16", "--micro_batch", "4"])
    logits = dict(planner.plan(mc, cfg, 200, world_size=8)["update"])
    key = next(k for k in logits if k.startswith("logits and their gradient"))
    whole = 4 * cfg.max_new_tokens * mc.vocab_size * 2  # one bf16 copy of a 4-row micro-batch's logits
    assert (logits[key] < whole / 4) if softcap is None else (logits[key] > whole)  # plain: a chunk + the (V, H) gradients
