"""Tests for brorl: each asserts against a reference (a recompute, a closed form, brute force).
Everything runs on a CPU in a few minutes: `python -m pytest -q test_brorl.py`."""

import json
import math
import os
import subprocess
import sys
from itertools import combinations
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest
import torch

import brorl
import data

HERE = Path(__file__).parent


# ----------------------------------------------------------------------------
# brorl.py: fixtures


@pytest.fixture(scope="module")
def random_lm(tmp_path_factory):
    """A tiny random Qwen2 with the embedded tokenizer, initialised loudly enough that greedy
    decoding varies from prompt to prompt (a near-uniform model would hide sampler bugs)."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
    tok = data.build_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      initializer_range=0.3, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                      tie_word_embeddings=False)
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # make EOS the argmax wherever digit "1" would win: greedy lengths vary
        head = model.lm_head.weight
        head[tok.eos_token_id] = 1.5 * head[tok.convert_tokens_to_ids("1")]
    path = tmp_path_factory.mktemp("random_lm")
    model.save_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="brorl").eval()
    return model, tok


PROMPTS = ["123+45=", "9+1=", "77+123+1=", "5"]  # different lengths: exercises the padding


def greedy_recompute(model, tok, prompt, max_new):
    """Greedy decoding the slow way: the whole sequence re-run without any cache, every step."""
    ids = tok(prompt)["input_ids"]
    start = len(ids)
    for _ in range(max_new):
        nxt = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        ids.append(nxt)
        if nxt == tok.eos_token_id:
            break
    return ids[start:]


# ----------------------------------------------------------------------------
# brorl.py: the sampler


def test_shared_prefix_greedy_equals_full_recompute(random_lm):
    model, tok = random_lm
    gen = torch.Generator().manual_seed(0)
    ro = brorl.generate(model, tok, PROMPTS, 3, 8, 0.0, 1.0, 4096, gen)
    lengths = set()
    for b, prompt in enumerate(PROMPTS):
        want = greedy_recompute(model, tok, prompt, 8)
        for row in range(b * 3, b * 3 + 3):  # all N greedy rollouts of a prompt are identical
            got = ro.tokens[row][ro.mask[row]].tolist()
            assert got == want, (prompt, got, want)
        lengths.add(len(want))
    assert len(lengths) > 1  # some stop at EOS early, some do not: both paths covered


def test_chunked_decoding_equals_one_chunk(random_lm):
    model, tok = random_lm
    a = brorl.generate(model, tok, PROMPTS, 2, 6, 0.0, 1.0, 4096, torch.Generator())
    b = brorl.generate(model, tok, PROMPTS, 2, 6, 0.0, 1.0, 2, torch.Generator())  # one prompt per chunk
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.mask, b.mask)


def test_sampler_logprobs_equal_training_forward(random_lm):
    model, tok = random_lm
    gen = torch.Generator().manual_seed(1)
    ro = brorl.generate(model, tok, PROMPTS, 5, 8, 1.3, 1.0, 4096, gen)
    batch = brorl.pack_groups([(ro, g, None) for g in range(len(PROMPTS))])
    with torch.no_grad():
        logp = brorl.response_logprobs(model, batch, torch.arange(len(ro.texts)), 1.3)
    assert logp.shape == ro.logp[:, : logp.shape[1]].shape
    torch.testing.assert_close(logp, ro.logp[:, : logp.shape[1]], atol=2e-5, rtol=0)
    assert (logp[batch["resp_mask"]] < 0).all() and (logp[~batch["resp_mask"]] == 0).all()


def test_top_p_samples_only_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    toks = brorl.pick_tokens(logits, 1.0, 0.7, torch.Generator().manual_seed(0))
    counts = torch.bincount(toks, minlength=4).float() / 4000
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 reaches 0.7: tokens 2, 3 are cut
    assert abs(counts[0] - 0.5 / 0.8) < 0.03  # renormalised within the nucleus


# ----------------------------------------------------------------------------
# brorl.py: advantages, loss, normaliser


@pytest.mark.parametrize("norm", ["batch", "group"])
def test_all_equal_groups_get_exactly_zero_advantage(norm):
    g = torch.Generator().manual_seed(0)
    r = (torch.rand(6, 16, generator=g) < 0.4).float()
    r[1], r[4] = 1.0, 0.0  # an all-right and an all-wrong group
    adv = brorl.compute_advantages(r, norm)
    assert torch.isfinite(adv).all()
    assert (adv[1] == 0).all() and (adv[4] == 0).all()
    assert (adv[0] != 0).any()
    only_equal = brorl.compute_advantages(torch.ones(3, 4), norm)  # no signal anywhere: no NaN
    assert torch.equal(only_equal, torch.zeros(3, 4))


def test_advantage_formulas():
    r = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0]])
    centred = r - r.mean(1, keepdim=True)
    torch.testing.assert_close(brorl.compute_advantages(r, "batch"),
                               (centred - centred.mean()) / (centred.std() + 1e-6))
    torch.testing.assert_close(brorl.compute_advantages(r, "group"), centred / (r.std(1, keepdim=True) + 1e-6))


def test_ppo_clip_zeroes_gradient_outside_the_trust_region():
    old = torch.zeros(4, 1)
    # ratios 1.5 (above 1+0.28), 0.5 (below 1-0.2), 1.1 and 0.9 (inside)
    logp = torch.log(torch.tensor([[1.5], [0.5], [1.1], [0.9]])).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, ratio = brorl.ppo_token_loss(logp, old, adv, 0.2, 0.28)
    loss.sum().backward()
    assert logp.grad[0] == 0 and logp.grad[1] == 0  # clipped: no gradient
    torch.testing.assert_close(logp.grad[2:, 0], -adv[2:] * ratio[2:, 0].detach())  # d(-r A)/dlogp = -r A
    # on the other side of the bound the clip must NOT bind: positive adv, ratio below 1-eps
    logp2 = torch.log(torch.tensor([[0.5]])).requires_grad_()
    brorl.ppo_token_loss(logp2, torch.zeros(1, 1), torch.tensor([1.0]), 0.2, 0.28)[0].sum().backward()
    assert logp2.grad.item() == pytest.approx(-0.5)


def test_k2_kl_matches_formula_and_clamps():
    lp, ref = torch.tensor([-1.0, -30.0]), torch.tensor([-2.0, -1.0])
    torch.testing.assert_close(brorl.kl_k2(lp, ref), torch.tensor([0.5, 0.5 * 100]))


@pytest.mark.parametrize("agg", ["token", "sequence"])
def test_loss_weights_sum_to_one_and_ignore_padding(agg):
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    w = brorl.loss_weights(mask, agg)
    assert w.sum().item() == pytest.approx(1.0) and (w[~mask] == 0).all()
    if agg == "token":
        assert torch.allclose(w[mask], torch.full_like(w[mask], 1 / 6))
    else:
        assert w[1, 0].item() == pytest.approx(1 / 3)


def _one_update(model, batch, adv, micro_batch, kl_coef=0.0):
    """Parameters after one SGD step (lr 1) of update_policy: equal params <=> equal gradients.
    In float64, so that what is compared is the normaliser, not fp32 summation order."""
    m = type(model).from_pretrained(model.name_or_path, attn_implementation="brorl").double().train()
    cfg = brorl.Config(micro_batch=micro_batch, n_minibatches=1, grad_clip=1e9, kl_coef=kl_coef)
    ref = type(model).from_pretrained(model.name_or_path, attn_implementation="brorl").double() if kl_coef else None
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    before = [p.detach().clone() for p in m.parameters()]
    info = brorl.update_policy(m, ref, opt, batch, adv, cfg, torch.Generator().manual_seed(0))
    return [b - p.detach() for b, p in zip(before, m.parameters())], info


def test_micro_batching_changes_memory_not_the_gradient(random_lm):
    model, tok = random_lm
    ro = brorl.generate(model, tok, PROMPTS[:3], 6, 8, 1.0, 1.0, 4096, torch.Generator().manual_seed(3))
    batch = brorl.pack_groups([(ro, g, None) for g in range(3)])
    adv = torch.randn(18, generator=torch.Generator().manual_seed(4))
    full, info = _one_update(model, batch, adv, micro_batch=18, kl_coef=0.1)
    for mb in (1, 5):
        part, _ = _one_update(model, batch, adv, micro_batch=mb, kl_coef=0.1)
        for a, b in zip(full, part):
            assert (a - b).norm() <= 1e-6 * a.norm() + 1e-12
    assert info["max_ratio_dev"] < 1e-5  # one engine: first mini-batch ratio is exactly 1


# ----------------------------------------------------------------------------
# brorl.py: dynamic sampling, pass@k


def test_dynamic_sampling_keeps_b_informative_groups(random_lm, monkeypatch):
    model, tok = random_lm
    calls = iter([torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]),  # round 1: 1 of 3 informative
                  torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])])
    monkeypatch.setattr(brorl, "score", lambda ro, answers, task: next(calls))
    cfg = brorl.Config(n_rollouts=2, prompts_per_step=3, max_new_tokens=2, max_rounds=5)
    train = [dict(prompt=f"{i}+1=", answer=str(i + 1), task="arith") for i in range(50)]
    rng = __import__("random").Random(0)
    want = iter([3, 6])  # prompts asked for: ceil(3 / 1.0) = 3, then at this step's rate ceil(2 / (1/3)) = 6
    orig = brorl.generate
    def spy(model, tok, prompts, *a, **k):
        assert len(prompts) == next(want)
        return orig(model, tok, prompts, *a, **k)
    monkeypatch.setattr(brorl, "generate", spy)
    kept, stats = brorl.sample_step_groups(model, tok, cfg, train, rng, torch.Generator(), keep_est=1.0)
    assert stats["groups_generated"] == 9 and stats["rounds"] == 2
    assert stats["groups_survived"] == 4  # keep_rate counts survivors before truncation: 4 / 9
    assert stats["groups_kept"] == 3 and len(kept) == 3  # the 4th survivor is dropped: exactly B
    assert all(r.min() != r.max() for _, _, r in kept)


def test_dynamic_sampling_gives_up_after_max_rounds(random_lm, monkeypatch):
    model, tok = random_lm
    monkeypatch.setattr(brorl, "score", lambda ro, answers, task: torch.zeros(len(ro.prompt_ids), ro.n))
    cfg = brorl.Config(n_rollouts=2, prompts_per_step=2, max_new_tokens=2, max_rounds=3)
    train = [dict(prompt=f"{i}+1=", answer=str(i + 1), task="arith") for i in range(50)]
    kept, stats = brorl.sample_step_groups(model, tok, cfg, train, __import__("random").Random(0),
                                           torch.Generator(), keep_est=0.5)
    assert kept == [] and stats["rounds"] == 3 and stats["groups_kept"] == 0


def test_pass_at_k_unbiased_estimator_matches_enumeration():
    for n, c in [(5, 0), (5, 2), (6, 6), (8, 3)]:
        for k in range(1, n + 1):
            subsets = list(combinations([1] * c + [0] * (n - c), k))
            brute = sum(any(s) for s in subsets) / len(subsets)
            assert brorl.pass_at_k(n, c, k) == pytest.approx(brute, abs=1e-12)


# ----------------------------------------------------------------------------
# brorl.py: the command line and a short run end to end


def run_cli(*args, cwd=HERE):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(HERE / "brorl.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


SMALL = ["--n_rollouts", "32", "--prompts_per_step", "2", "--eval_prompts", "4", "--eval_samples", "4",
         "--probe_prompts", "2", "--max_rows", "256"]


def test_two_step_run_writes_metrics_plot_and_checkpoint(tmp_path):
    out = tmp_path / "run"
    p = run_cli("--steps", "2", "--eval_every", "1", "--kl_coef", "1e-4", "--ref_reset_every", "1",
                "--out", str(out), *SMALL)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    need = {"step", "reward_mean", "keep_rate", "zero_adv_frac", "pass@1", "pass@N", "kl", "clip_frac",
            "entropy", "resp_len", "tokens_per_s", "time_rollout", "time_update", "eval_pass@1", "eval_pass@k",
            "mass_mean", "mass_rose", "mass_fell", "mass_worst_drop", "max_ratio_dev"}
    assert need <= set(rows[2]), need - set(rows[2])
    assert all(r["max_ratio_dev"] < 1e-5 for r in rows[1:] if r["groups_kept"])
    saved = json.loads((out / "config.json").read_text())
    assert saved["n_rollouts"] == 32 and saved["steps"] == 2
    assert (out / "metrics.png").stat().st_size > 10_000
    assert (out / "ckpt" / "config.json").exists() and not (out / "ckpt.tmp").exists()


@pytest.mark.parametrize("args, needle", [
    (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
    (["--n_rollouts", "1"], "--n_rollouts 1: need N >= 2"),
    (["--model", "./does/not/exist"], "--model ./does/not/exist: no such directory"),
    (["--adv_norm", "median"], "--adv_norm 'median'"),
    (["--preset", "nope"], "--preset 'nope': unknown"),
    (["--task", "math:/nonexistent.jsonl"], "--task math:/nonexistent.jsonl"),
])
def test_bad_flags_fail_with_one_clear_line_and_write_nothing(tmp_path, args, needle):
    out = tmp_path / "run"
    p = run_cli(*args, "--out", str(out), "--steps", "1")
    assert p.returncode != 0
    assert needle in p.stderr, p.stderr[-1500:]
    assert "Traceback" not in p.stderr
    assert not out.exists()


def test_unwritable_out_fails_cleanly(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the run directory's parent should be
    p = run_cli("--out", str(blocker / "run"), "--steps", "1", *SMALL)
    assert p.returncode != 0 and f"--out {blocker / 'run'}" in p.stderr and "Traceback" not in p.stderr


def test_help_documents_every_flag():
    p = run_cli("--help")
    assert p.returncode == 0
    for f in brorl.dataclasses.fields(brorl.Config):
        assert f"--{f.name}" in p.stdout
    assert set(brorl.field_help()) == {f.name for f in brorl.dataclasses.fields(brorl.Config)}
