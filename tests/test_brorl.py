"""Every test of the project, one section per file: brorl.py, data.py, kernels.py, verify.py,
massbalance.py. Each asserts against a reference (a recompute without cache, float64, a closed
form, brute force). Everything runs on a CPU: `python -m pytest -q test_brorl.py`."""

import json
import math
import os
import random
import re
import subprocess
import sys
import threading
import time
import types
import warnings
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may come from a hub: tests use what we ship
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tools import bench_kernels  # noqa: E402
import brorl  # noqa: E402
import data  # noqa: E402
import kernels  # noqa: E402
from tools import massbalance as mb  # noqa: E402
import sampler  # noqa: E402
import verify  # noqa: E402
from kernels import token_logprobs, token_logprobs_ref  # noqa: E402
from verify import extract_answer, is_equiv, reward, rewards  # noqa: E402

HERE = Path(__file__).resolve().parent.parent  # the repository root


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


def test_shared_prefix_greedy_equals_full_recompute(random_lm, monkeypatch):
    model, tok = random_lm
    gen = torch.Generator().manual_seed(0)
    drops, keep = [], sampler.SharedPrefixCache.keep
    monkeypatch.setattr(sampler.SharedPrefixCache, "keep", lambda self, rows: drops.append(len(rows)) or keep(self, rows))
    ro = brorl.generate(model, tok, PROMPTS, 3, 8, 0.0, 1.0, 4096, gen)
    assert drops  # finished rows were dropped mid-decode, and the survivors still decode exactly
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
    # N > max_rows: a group's rows are split into parts of 2, 2, 1, each re-prefilling its prompt
    c = brorl.generate(model, tok, PROMPTS, 5, 6, 0.0, 1.0, 2, torch.Generator())
    assert torch.equal(c.tokens, a.tokens.view(len(PROMPTS), 2, -1)[:, :1].expand(-1, 5, -1).reshape(-1, 6))
    torch.testing.assert_close(c.logp.view(len(PROMPTS), 5, -1), a.logp.view(len(PROMPTS), 2, -1)[:, :1].expand(-1, 5, -1))


def test_sampler_logprobs_equal_training_forward(random_lm, monkeypatch):
    model, tok = random_lm
    gen = torch.Generator().manual_seed(1)
    left, keep = [], sampler.SharedPrefixCache.keep  # rows left per prompt after each drop
    monkeypatch.setattr(sampler.SharedPrefixCache, "keep", lambda self, rows: keep(self, rows) or left.append(
        torch.bincount(self.row_group, minlength=self.B).tolist()))
    ro = brorl.generate(model, tok, PROMPTS, 5, 8, 1.3, 1.0, 4096, gen)
    assert any(len(set(c)) > 1 for c in left)  # prompts left with unequal rows: the packed grid was used
    batch = brorl.pack_groups([(ro, g, None) for g in range(len(PROMPTS))])
    with torch.no_grad():
        logp, ent = brorl.response_logprobs(model, batch, torch.arange(len(ro.texts)), 1.3, with_entropy=True)
    assert logp.shape == ro.logp[:, : logp.shape[1]].shape
    torch.testing.assert_close(logp, ro.logp[:, : logp.shape[1]], atol=2e-5, rtol=0)
    torch.testing.assert_close(ent, ro.entropy[:, : ent.shape[1]], atol=2e-5, rtol=0)  # the entropy metric too
    assert (ent[batch["resp_mask"]] > 0).all() and (ent[~batch["resp_mask"]] == 0).all()
    assert (logp[batch["resp_mask"]] < 0).all() and (logp[~batch["resp_mask"]] == 0).all()


def test_every_attention_row_has_a_key(random_lm):
    """No query row of any mask the sampler (prefill, decode) or the update builds allows no key: CUDA
    SDPA kernels have returned NaN for such rows (a CPU returns 0). Prompts of unequal lengths, so
    that the update's prompt pass is left-padded. Every call's mask is captured at the attention."""
    from transformers import AttentionInterface
    model, tok = random_lm
    seen = []

    def capture(module, query, key, value, attention_mask, **kw):
        seen.append((attention_mask, key.shape[-2]))
        return sampler.cascade_attention(module, query, key, value, attention_mask, **kw)
    AttentionInterface.register("brorl", capture)
    try:
        ro = brorl.generate(model, tok, PROMPTS, 4, 8, 1.3, 1.0, 4096, torch.Generator().manual_seed(2))
        n_sampler = len(seen)
        batch = brorl.pack_groups([(ro, g, None) for g in range(len(PROMPTS))])
        assert not batch["prompt_mask"].all()  # left-padding is there
        logp = brorl.response_logprobs(model, batch, torch.arange(len(ro.texts)), 1.3)
        logp.sum().backward()
    finally:
        AttentionInterface.register("brorl", sampler.cascade_attention)
    assert 0 < n_sampler < len(seen)
    kinds = set()
    for mask, n_keys in seen:
        if isinstance(mask, sampler.SharedPrefixCache):  # decode: the prompt's keys, then the row's own
            assert n_keys >= 1  # the row's own current token: never masked
            kinds.add("decode")
        elif mask is None:  # plain causal (a prompt alone): every row sees itself
            kinds.add("causal")
        else:
            mask = mask[..., :n_keys]  # (b, 1, q, k), as SDPA slices it
            allowed = mask if mask.dtype == torch.bool else mask > -math.inf
            assert allowed.any(-1).all(), "a query row with no allowed key"
            kinds.add("mask")
    assert kinds == {"decode", "causal", "mask"}
    assert torch.isfinite(logp).all() and model.lm_head.weight.grad is not None
    model.zero_grad(set_to_none=True)


def test_top_p_samples_only_from_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])).expand(4000, 4)
    u = torch.rand(len(logits), generator=torch.Generator().manual_seed(0), dtype=torch.float64)  # (R,)
    toks = sampler.pick_tokens(logits, 1.0, 0.7, u)
    counts = torch.bincount(toks, minlength=4).float() / 4000
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 reaches 0.7: tokens 2, 3 are cut
    assert abs(counts[0] - 0.5 / 0.8) < 0.03  # renormalised within the nucleus


# ----------------------------------------------------------------------------
# brorl.py: advantages, loss, normaliser


@pytest.mark.parametrize("norm", ["batch", "response", "group"])
def test_all_equal_groups_are_whitened_with_the_rest_as_verl(norm):
    """With --dynamic_sampling 0 a group with no signal stays in the batch: centred to 0, then whitened
    with the rest (verl's REINFORCE++-baseline), so it gets -mean/std, one value for all its rows;
    under group (GRPO) 0 / (0 + 1e-6) = 0."""
    g = torch.Generator().manual_seed(0)
    r = (torch.rand(6, 16, generator=g) < 0.4).float()
    r[1], r[4] = 1.0, 0.0  # an all-right and an all-wrong group
    # right answers short, wrong ones long: the token mean of the centred values is negative
    lengths = torch.where(r > 0, torch.randint(5, 20, r.shape, generator=g), torch.randint(30, 50, r.shape, generator=g))
    adv = brorl.compute_advantages(r, norm, lengths)
    assert torch.isfinite(adv).all()
    assert (adv[0] != 0).any()
    if norm == "group":
        assert (adv[1] == 0).all() and (adv[4] == 0).all()
    else:
        w = (lengths if norm == "batch" else torch.ones_like(r)).double()  # each response's weight
        x = (r - r.mean(1, keepdim=True)).double()  # (G, N) centred
        mean = (w * x).sum() / w.sum()
        std = (((w * (x - mean) ** 2).sum() / (w.sum() - 1)) + 1e-8).sqrt()  # unbiased, as verl
        for i in (1, 4):
            torch.testing.assert_close(adv[i], torch.full((16,), (-mean / std).item()), rtol=1e-5, atol=1e-6)
        if norm == "batch":  # over tokens the centred mean is not 0 (per response it is: adv 0 there)
            assert adv[1, 0] > 0.1
            # the zero token-sum holds with the no-signal groups in it
            assert abs((adv.double() * lengths).sum() / lengths.sum()) < 1e-6
    only_equal = brorl.compute_advantages(torch.ones(3, 4), norm, lengths[:3, :4])  # no signal anywhere: no NaN
    assert torch.equal(only_equal, torch.zeros(3, 4))


def test_advantage_formulas():
    r = torch.tensor([[1.0, 0, 0, 0], [1, 1, 0, 0]])
    centred = r - r.mean(1, keepdim=True)
    torch.testing.assert_close(brorl.compute_advantages(r, "response"),
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


def _one_update(model, batch, adv, micro_batch, kl_coef=0.0, old_logp="recompute"):
    """Parameters after one SGD step (lr 1) of update_policy: equal params <=> equal gradients.
    In float64, so that what is compared is the normaliser, not fp32 summation order."""
    m = type(model).from_pretrained(model.name_or_path, attn_implementation="brorl").double().train()
    cfg = brorl.Config(micro_batch=micro_batch, n_minibatches=1, grad_clip=1e9, kl_coef=kl_coef, old_logp=old_logp)
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


def test_sampler_logp_as_old_policy_gives_the_recompute_update(random_lm):
    """--old_logp sampler (auto's choice in float32) skips a forward over every row; the update and
    the entropy metric must be the recompute's, up to the rounding between the two forwards."""
    model, tok = random_lm
    ro = brorl.generate(model, tok, PROMPTS[:3], 6, 8, 1.0, 1.0, 4096, torch.Generator().manual_seed(5))
    batch = brorl.pack_groups([(ro, g, None) for g in range(3)])
    adv = torch.randn(18, generator=torch.Generator().manual_seed(6))
    recomputed, info_r = _one_update(model, batch, adv, micro_batch=7, old_logp="recompute")
    reused, info_s = _one_update(model, batch, adv, micro_batch=7, old_logp="sampler")
    for a, b in zip(recomputed, reused):
        assert (a - b).norm() <= 1e-5 * a.norm() + 1e-12
    assert info_s["entropy"] == pytest.approx(info_r["entropy"], rel=1e-5)
    assert 0 < info_s["max_ratio_dev"] < 2e-5  # float64 trainer vs float32 sampler: rounding (as above)


def test_training_gradient_is_bitwise_reproducible(random_lm):
    """Same seed, same gradient, to the bit: a shuffled micro-batch gathers its prompts' keys/values
    per row, and that gather's backward must sum the N rows' gradients in a fixed order (x[idx]'s
    backward on a CPU does not: runs drifted apart from their first step)."""
    model, tok = random_lm
    ro = brorl.generate(model, tok, PROMPTS[:2], 256, 6, 1.0, 1.0, 4096, torch.Generator().manual_seed(7))
    batch = brorl.pack_groups([(ro, g, None) for g in range(2)])
    rows = torch.randperm(512, generator=torch.Generator().manual_seed(8))[:384]  # both prompts, shuffled

    def grads():
        model.zero_grad(set_to_none=True)
        brorl.response_logprobs(model, batch, rows, 1.0).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])

    first = grads()
    assert all(torch.equal(first, grads()) for _ in range(3))
    model.zero_grad(set_to_none=True)


def test_old_logp_auto_recomputes_unless_the_forward_is_float32():
    fp32, bf16 = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2).bfloat16()
    assert brorl.uses_sampler_logp(brorl.Config(), fp32)  # float32: the sampler's log-probs
    assert not brorl.uses_sampler_logp(brorl.Config(), bf16)  # bf16 weights: a trainer forward
    assert not brorl.uses_sampler_logp(brorl.Config(dtype="bfloat16"), fp32)  # bf16 autocast: a trainer forward
    assert brorl.uses_sampler_logp(brorl.Config(dtype="bfloat16", old_logp="sampler"), fp32)
    assert not brorl.uses_sampler_logp(brorl.Config(old_logp="recompute"), fp32)


# ----------------------------------------------------------------------------
# brorl.py: dynamic sampling


def test_dynamic_sampling_keeps_b_informative_groups(random_lm, monkeypatch):
    model, tok = random_lm
    calls = iter([torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0]]),  # round 1: 1 of 3 informative
                  torch.tensor([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0]])])
    monkeypatch.setattr(brorl, "score", lambda ro, answers, *a: next(calls))
    cfg = brorl.Config(n_rollouts=2, prompts_per_step=3, max_new_tokens=2, max_rounds=5)
    train = [dict(prompt=f"{i}+1=", answer=str(i + 1), task="arith") for i in range(50)]
    rng = random.Random(0)
    want = iter([3, 6])  # prompts asked for: ceil(3 / 1.0) = 3, then at this step's rate ceil(2 / (1/3)) = 6
    orig = brorl.generate
    def spy(model, tok, prompts, *a, **k):
        assert len(prompts) == next(want)
        return orig(model, tok, prompts, *a, **k)
    monkeypatch.setattr(brorl, "generate", spy)
    kept, stats = brorl.sample_step_groups(model, tok, cfg, train, rng, 1, keep_est=1.0)
    assert stats["groups_generated"] == 9 and stats["rounds"] == 2
    assert stats["groups_survived"] == 4  # keep_rate counts survivors before truncation: 4 / 9
    assert stats["groups_kept"] == 3 and len(kept) == 3  # the 4th survivor is dropped: exactly B
    assert all(r.min() != r.max() for _, _, r in kept)


def test_dynamic_sampling_gives_up_after_max_rounds(random_lm, monkeypatch):
    model, tok = random_lm
    monkeypatch.setattr(brorl, "score", lambda ro, answers, *a: torch.zeros(len(ro.prompt_ids), ro.n))
    cfg = brorl.Config(n_rollouts=2, prompts_per_step=2, max_new_tokens=2, max_rounds=3)
    train = [dict(prompt=f"{i}+1=", answer=str(i + 1), task="arith") for i in range(50)]
    kept, stats = brorl.sample_step_groups(model, tok, cfg, train, random.Random(0), 1, keep_est=0.5)
    assert kept == [] and stats["rounds"] == 3 and stats["groups_kept"] == 0


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
    # float32 rounding between the decode and the training forward: ~1e-6, the largest seen 1.3e-5 (logp -2.9)
    assert all(r["max_ratio_dev"] < 3e-5 for r in rows[1:] if r["groups_kept"])
    saved = json.loads((out / "config.json").read_text())
    assert saved["n_rollouts"] == 32 and saved["steps"] == 2
    assert (out / "metrics.png").stat().st_size > 10_000
    assert (out / "ckpt" / "config.json").exists() and not (out / "ckpt.tmp").exists()


def test_resume_continues_the_run_exactly(tmp_path):
    """4 steps in one go == 2 steps, then --resume to 4 (weights, AdamW, random streams, reference,
    metrics): a crashed or extended run loses nothing. Exact, as the training is bitwise reproducible."""
    a, b = tmp_path / "a", tmp_path / "b"
    # on the CPU: CUDA's index_add_ (an embedding's backward) is not bitwise reproducible
    common = ["--eval_every", "2", "--kl_coef", "1e-3", "--ref_reset_every", "3", "--device", "cpu", *SMALL]
    rows_a = brorl.train(brorl.parse_config(["--steps", "4", "--out", str(a), *common]))
    brorl.train(brorl.parse_config(["--steps", "2", "--out", str(b), *common]))
    assert (b / "ckpt" / "trainer_state.pt").exists() and not (b / "ckpt.old").exists()
    rows_b = brorl.train(brorl.parse_config(["--resume", str(b), "--steps", "4"]))  # the rest from b's config.json
    strip = lambda r: {k: v for k, v in r.items() if not k.startswith("time") and k != "tokens_per_s"}
    assert [strip(r) for r in rows_b] == [strip(r) for r in rows_a] and len(rows_a) == 5
    on_disk = [json.loads(line)["step"] for line in (b / "metrics.jsonl").read_text().splitlines()]
    assert on_disk == [0, 1, 2, 3, 4]
    from safetensors.torch import load_file
    wa, wb = load_file(a / "ckpt" / "model.safetensors"), load_file(b / "ckpt" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_resume_takes_a_changed_lr_and_refuses_what_the_checkpoint_fixes(tmp_path, capsys):
    """AdamW's saved param groups would restore the old lr and weight decay over the new flags: the new ones
    take effect. A flag the restored state decides (the random streams of --seed, the held-out problems)
    cannot: changing it is refused with one line."""
    run = tmp_path / "run"
    brorl.train(brorl.parse_config(["--steps", "1", "--eval_every", "1", "--lr", "2e-4", "--out", str(run), *SMALL]))
    brorl.train(brorl.parse_config(["--resume", str(run), "--steps", "2", "--lr", "5e-5", "--weight_decay", "0.01"]))
    groups = torch.load(run / "ckpt" / "trainer_state.pt", weights_only=True)["opt"]["param_groups"]
    assert {(g["lr"], g["weight_decay"]) for g in groups} == {(5e-5, 0.01)}
    assert json.loads((run / "config.json").read_text())["lr"] == 5e-5
    for flag, value in [("--seed", "3"), ("--eval_seed", "2"), ("--probe_prompts", "3")]:
        code, err = run_in_process(capsys, "--resume", str(run), "--steps", "3", flag, value)
        assert code == 2 and f"{flag} {value} with --resume {run}: the checkpoint fixes it" in err, err
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]  # untouched


def test_init_from_starts_a_new_run_on_the_checkpoints_weights(tmp_path):
    """--init_from: the policy of a run's checkpoint, step 0, a new run directory; AdamW fresh, or the
    checkpoint's moments with --init_optimizer (at this run's lr). lr 0 leaves the weights as loaded."""
    from safetensors.torch import load_file
    src = tmp_path / "src"
    brorl.train(brorl.parse_config(["--steps", "2", "--eval_every", "2", "--out", str(src), *SMALL]))
    for init_optimizer in (False, True):
        out = tmp_path / f"branch-{init_optimizer}"
        rows = brorl.train(brorl.parse_config(["--init_from", str(src), "--init_optimizer", str(init_optimizer),
                                               "--lr", "0", "--steps", "1", "--eval_every", "1", "--out", str(out), *SMALL]))
        assert [r["step"] for r in rows] == [0, 1]
        w_src, w_out = load_file(src / "ckpt" / "model.safetensors"), load_file(out / "ckpt" / "model.safetensors")
        assert all(torch.equal(w_src[k], w_out[k]) for k in w_src)
        opt = torch.load(out / "ckpt" / "trainer_state.pt", weights_only=True)["opt"]
        steps = {float(v["step"]) for v in opt["state"].values()}  # AdamW updates each parameter has had
        assert steps == {2.0 + 4.0 * init_optimizer}  # 2 mini-batches a step; the source made 2 steps and {g["lr"] for g in opt["param_groups"]} == {0.0}


def test_eval_set_is_drawn_by_eval_seed_alone():
    """Runs of every --seed score the same held-out problems (--eval_seed); a seed-0 run's are those
    that --seed 0 drew before --eval_seed existed."""
    draw = lambda *a: [e["prompt"] for e in brorl.setup(brorl.parse_config([*a, "--eval_prompts", "8"]),
                                                       str(data.EMBEDDED_MODEL), "--model", with_train_set=False)[5]]
    before = [e["prompt"] for e in random.Random(1).sample(data.load_task("arith", "test", seed=0), 8)]
    assert draw("--seed", "0") == draw("--seed", "1") == before
    assert draw("--seed", "1", "--eval_seed", "1") != before


def run_in_process(capsys, *args):
    """brorl's command line, in this process: (exit code, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        brorl.train(brorl.parse_config(list(args)))
    return exit_info.value.code, capsys.readouterr().err


@pytest.mark.parametrize("args, needle", [
    (["--no_such_flag", "1"], "unrecognized arguments: --no_such_flag"),
    (["--n_rollouts", "1"], "--n_rollouts 1: need N >= 2"),
    (["--model", "./does/not/exist"], "--model ./does/not/exist: no such directory"),
    (["--adv_norm", "median"], "--adv_norm 'median'"),
    (["--old_logp", "trainer"], "--old_logp 'trainer': choose auto, sampler, recompute"),
    (["--preset", "nope"], "--preset 'nope': unknown"),
    (["--save", "flase"], "argument --save: 'flase' is not a boolean"),
    (["--resume", "/nonexistent/run"], "--resume /nonexistent/run: no checkpoint to resume"),
    (["--init_from", "/nonexistent/run"], "--init_from /nonexistent/run: no such directory"),
    (["--init_optimizer"], "--init_optimizer loads the AdamW state of --init_from: name one"),
    (["--task", "math:/nonexistent.jsonl"], "--task math:/nonexistent.jsonl"),
])
def test_bad_flags_fail_with_one_clear_line_and_write_nothing(tmp_path, capsys, args, needle):
    out = tmp_path / "run"
    code, err = run_in_process(capsys, *args, "--out", str(out), "--steps", "1")
    assert code != 0 and needle in err, err[-1500:]
    assert not out.exists()


def test_unwritable_out_fails_cleanly(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # a file where the run directory's parent should be
    code, err = run_in_process(capsys, "--out", str(blocker / "run"), "--steps", "1", *SMALL)
    assert code != 0 and f"--out {blocker / 'run'}: cannot write there" in err


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        brorl.parse_config(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for f in brorl.dataclasses.fields(brorl.Config):
        assert f"--{f.name}" in text
    assert set(brorl.harness.field_help(brorl.Config)) == {f.name for f in brorl.dataclasses.fields(brorl.Config)}
    flat = " ".join(text.split())  # argparse wraps lines
    assert "(default: 512)" in flat and "(default: the embedded tiny model)" in flat  # the real defaults

# ============================================================================
# data.py. Tests of data.py: the arith task, the embedded model and tokenizer, the math loaders.
# ============================================================================

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the embedded model must load with no network

import pytest
import torch

import data
from lib import tasks


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
    assert json.loads((tmp_path / "m" / "warmstart.json").read_text())["config"]["steps_mixture"] == 2
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "file").write_text("x")
    with pytest.raises(ValueError, match="refusing"):
        data.save(m1, tok, data.WarmStart(out=str(tmp_path / "precious")), r1)


# ----------------------------------------------------------------------------
# real math datasets


def test_load_math_sample():
    rows = tasks.load(f"math:{data.MATH_SAMPLE}")
    assert len(rows) == 16 and all(r["task"] == "math" and r["answer"] for r in rows)
    train, test = (data.load_task(f"math:{data.MATH_SAMPLE}", s) for s in ("train", "test"))
    assert len(train) + len(test) == 16 and test and not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert all(r["prompt"].endswith(" " + tasks.MATH_SUFFIX) for r in rows)
    assert tasks.MATH_SUFFIX == "Let's think step by step and output the final answer within \\boxed{}."
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
        tasks.load(f"math:{path}")


def test_load_math_json_array_and_missing_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"problem": "1+1?", "answer": "2"}, {"problem": "2+2?", "answer": None}]))
    with pytest.raises(ValueError, match=r"rows.json: row 2: missing key 'answer'"):
        tasks.load(f"math:{path}")
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


# ============================================================================
# kernels.py. Tests of kernels.py: the Triton kernels (run through the interpreter on a CPU) and the torch
# ============================================================================

FP32_TOL = 1e-5  # fp32 accumulation over <= 50k columns: observed errors are ~2e-6
# where the kernel tests run: on a GPU the compiled kernel, on a CPU the interpreter
KDEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(lead, V, dtype, seed, n_ignored=1, device=KDEV):
    """Random logits (*lead, V) ~ 4 * randn in dtype, targets (*lead) with n_ignored -100s,
    and an upstream gradient (*lead) so that every row's gradient is scaled differently."""
    gen = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(*lead, V, generator=gen)).to(dtype)
    t = torch.randint(0, V, lead, generator=gen)
    t.view(-1)[torch.randperm(t.numel(), generator=gen)[:n_ignored]] = -100
    g = torch.randn(lead, generator=gen)
    return x.to(device), t.to(device), g.to(device)


def _run(x, t, g, temperature, backend):
    """logp, entropy and d(sum g * logp)/d x, by token_logprobs with the given backend."""
    x = x.clone().requires_grad_()
    logp, entropy = token_logprobs(x, t, temperature, with_entropy=True, backend=backend)
    (logp * g).sum().backward()
    return logp.detach(), entropy, x.grad


def _oracle(x, t, g, temperature):
    """float64 logp, entropy, gradient of the same (already rounded) logits, written
    independently of kernels.py: full log_softmax and torch autograd."""
    x = x.double().requires_grad_()
    logp_all = torch.log_softmax(x / temperature, -1)  # (..., V)
    valid = t != -100
    logp = torch.where(valid, logp_all.gather(-1, t.clamp(min=0)[..., None])[..., 0], 0.0)
    p = logp_all.exp()
    entropy = torch.where(valid, -torch.where(p > 0, p * logp_all, 0.0).sum(-1), 0.0)
    (logp * g.double()).sum().backward()
    return logp.detach(), entropy.detach(), x.grad


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _assert_fp32_close(ours, ref, t):
    (logp, entropy, grad), (logp64, entropy64, grad64) = ours, ref
    assert logp.dtype == entropy.dtype == torch.float32
    assert _err(logp, logp64) < FP32_TOL
    assert _err(entropy, entropy64) < FP32_TOL
    assert _err(grad, grad64) < FP32_TOL
    assert (logp <= 0).all()
    ignored = t == -100
    assert (logp[ignored] == 0).all() and (entropy[ignored] == 0).all()
    assert (grad[ignored] == 0).all()  # exactly 0, not merely small


# -----------------------------------------------------------------------------
# The reference

def test_reference_matches_float64(monkeypatch):
    # a tiny chunk size so that rows are split into several checkpointed chunks (3 rows each)
    monkeypatch.setattr(kernels, "REF_CHUNK_ELEMENTS", 3000)
    x, t, g = _inputs((3, 5), 1000, torch.float32, seed=0, n_ignored=3)
    ref = _oracle(x, t, g, 0.7)
    _assert_fp32_close(_run(x, t, g, 0.7, "torch"), ref, t)
    # and in float64 it is the oracle up to float64 rounding
    x64 = x.double().requires_grad_()
    logp, entropy = token_logprobs_ref(x64, t, 0.7, with_entropy=True)
    (logp * g.double()).sum().backward()
    assert max(_err(logp, ref[0]), _err(entropy, ref[1]), _err(x64.grad, ref[2])) < 1e-12


def test_auto_backend_on_cpu_is_the_reference():
    x, t, g = _inputs((4,), 300, torch.bfloat16, seed=1, device="cpu")
    expected = _run(x, t, g, 1.3, "torch")
    for a, b in zip(_run(x, t, g, 1.3, "auto"), expected):
        assert torch.equal(a, b)
    with torch.no_grad():  # the old-policy / reference-policy use: no graph, same numbers
        assert torch.equal(token_logprobs(x, t, 1.3), expected[0])


# -----------------------------------------------------------------------------
# The Triton kernels, executed (interpreter on a CPU)

@pytest.mark.parametrize("lead, V, temperature", [
    ((5,), 1000, 1.0),       # (R,), V not a multiple of BLOCK_V, one partial block
    ((2, 3), 1000, 0.7),     # (B, T)
    ((1,), 50257, 1.3),      # a single row, 50 vocabulary blocks, last one partial
    ((2, 2), 50257, 0.7),
])
def test_kernel_fp32_matches_float64(lead, V, temperature):
    x, t, g = _inputs(lead, V, torch.float32, seed=V + len(lead))
    if lead == (1,):
        t[0] = 7  # the single row must not be the ignored one
    ours = _run(x, t, g, temperature, "triton")
    assert ours[0].shape == ours[1].shape == t.shape and ours[2].shape == x.shape
    _assert_fp32_close(ours, _oracle(x, t, g, temperature), t)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead, V, temperature", [((3, 2), 1000, 0.7), ((3,), 50257, 1.3)])
def test_kernel_low_precision_no_worse_than_torch(dtype, lead, V, temperature):
    x, t, g = _inputs(lead, V, dtype, seed=V + 1)
    ref = _oracle(x, t, g, temperature)  # float64 on the same rounded logits
    logp, entropy, grad = _run(x, t, g, temperature, "triton")
    # torch's own computation in that dtype: the bar to meet
    xd = x.clone().requires_grad_()
    logp_all = torch.log_softmax(xd / temperature, -1)
    valid = t != -100
    logp_d = logp_all.gather(-1, t.clamp(min=0)[..., None])[..., 0] * valid
    entropy_d = -(logp_all.exp() * logp_all).sum(-1) * valid
    (logp_d * g.to(dtype)).sum().backward()
    # logp and entropy: fp32 math on exactly representable inputs, so within the fp32 tolerance,
    # which is also inside the bar (torch's own error in that dtype, plus that tolerance)
    for ours, theirs, exact in [(logp, logp_d, ref[0]), (entropy, entropy_d, ref[1])]:
        assert _err(ours, exact) <= min(FP32_TOL, _err(theirs, exact) + FP32_TOL)
    # The gradient is written in dtype: one rounding of values up to max|grad| costs up to one
    # ulp there (the interpreter truncates on fp32 -> bf16; a GPU rounds to nearest, half an ulp).
    ulp = torch.finfo(dtype).eps * ref[2].abs().max().item()
    assert _err(grad, ref[2]) <= min(ulp, _err(xd.grad, ref[2]) + ulp)
    assert grad.dtype == dtype and (logp <= 0).all() and (grad[~valid] == 0).all()


def test_kernel_many_row_and_vocab_blocks(monkeypatch):
    # small blocks: 3 row blocks (the last partial) and 16 vocabulary blocks; logits sorted
    # ascending so the running max grows at every block and every rescale is exercised
    monkeypatch.setattr(kernels, "BLOCK_R", 2)
    monkeypatch.setattr(kernels, "BLOCK_V", 64)
    x, t, g = _inputs((5,), 1000, torch.float32, seed=3)
    x = x.sort(-1).values
    _assert_fp32_close(_run(x, t, g, 0.7, "triton"), _oracle(x, t, g, 0.7), t)


def test_kernel_ignored_rows():
    # all rows ignored, then a mix (incl. a whole block of 8 ignored rows)
    x, t, g = _inputs((3, 4), 1000, torch.bfloat16, seed=4, n_ignored=12)
    logp, entropy, grad = _run(x, t, g, 1.0, "triton")
    assert (logp == 0).all() and (entropy == 0).all() and (grad == 0).all()
    x, t, g = _inputs((13,), 1000, torch.float32, seed=5, n_ignored=0)
    t[:8] = -100
    t[11] = -100
    _assert_fp32_close(_run(x, t, g, 1.3, "triton"), _oracle(x, t, g, 1.3), t)


def test_peaked_and_masked_logits():
    # p(target) ~ 1 (logp must round to <= 0, never above) and -inf logits (a masked vocabulary)
    x, t, g = _inputs((4,), 1000, torch.float32, seed=6, n_ignored=0)
    x[:2, :] = 0.0
    x[0, t[0]] = 60.0  # softmax = 1 - 1e-23: logp rounds to 0
    x[1, t[1]] = 15.0
    x[2:, 500:] = float("-inf")
    t[2:] = torch.tensor([3, 499])
    for dtype in (torch.float32, torch.bfloat16):
        for backend in ("triton", "torch"):
            ours = _run(x.to(dtype), t, g, 0.7, backend)
            assert (ours[0] <= 0).all() and ours[0][0] == 0
            assert all(torch.isfinite(o).all() for o in ours)
            if dtype == torch.float32:
                _assert_fp32_close(ours, _oracle(x, t, g, 0.7), t)


def test_kernel_non_contiguous_logits_are_read_in_place():
    # logits[:, :-1] (the usual next-token shift) and a column-major (R, V): same numbers
    x, t, g = _inputs((2, 4), 1000, torch.bfloat16, seed=7)
    sliced = torch.cat([x, x[:, :1]], 1)[:, :-1]  # (2, 4, V), a non-contiguous view
    transposed = x.reshape(8, 1000).t().contiguous().t().view(2, 4, 1000)  # last stride 8
    assert not sliced.is_contiguous() and transposed.stride(-1) != 1
    expected = _run(x, t, g, 0.7, "triton")
    for view in (sliced, transposed):
        for a, b in zip(_run(view, t, g, 0.7, "triton"), expected):
            assert torch.equal(a, b)


def test_kernel_offsets_past_2_to_31():
    # The third row starts at element 2^31 + 34 of a 4 GiB bf16 buffer that stays untouched
    # except for 3 rows (pages are only mapped when written). With 32-bit offsets this reads
    # out of bounds: in the interpreter, a segmentation fault.
    V, stride = 1000, 2**30 + 17
    try:
        big = torch.empty(2 * stride + V, dtype=torch.bfloat16, device=KDEV)
    except RuntimeError:
        pytest.skip("cannot reserve 4 GiB of address space")
    x = big.as_strided((3, V), (stride, 1))  # (3, V), rows 2^30 + 17 elements apart
    src, t, g = _inputs((3,), V, torch.bfloat16, seed=8, n_ignored=0)
    x.copy_(src)
    x.requires_grad_()  # the view itself goes to the kernel: _run's clone would make it contiguous
    logp, entropy = token_logprobs(x, t, 1.0, with_entropy=True, backend="triton")
    (logp * g).sum().backward()
    assert x.stride() == (stride, 1) and x.grad.shape == (3, V)
    for a, b in zip((logp.detach(), entropy, x.grad), _run(src, t, g, 1.0, "triton")):
        assert torch.equal(a, b)
    del big, x


def test_kernel_allocates_no_fp32_copy():
    # the launcher must not upcast: during forward + backward torch allocates the bf16
    # gradient (R, V) and a few (R,) vectors, nothing else (counted by the torch profiler)
    x, t, g = _inputs((64,), 2000, torch.bfloat16, seed=10)
    x.requires_grad_()
    fwd_bwd = lambda: (token_logprobs(x, t, backend="triton") * g).sum().backward()
    peak = (bench_kernels._cuda_peak_bytes if KDEV == "cuda" else bench_kernels._cpu_peak_bytes)(fwd_bwd)
    assert x.grad.numel() * 2 <= peak <= x.grad.numel() * 2 + 64 * 1024


def test_empty_input():
    for backend in ("triton", "torch"):
        x = torch.randn(0, 3, 7, device=KDEV, requires_grad=True)
        logp = token_logprobs(x, torch.zeros(0, 3, dtype=torch.long, device=KDEV), backend=backend)
        logp.sum().backward()
        assert logp.shape == (0, 3) and x.grad.shape == x.shape


def test_interpreter_works_when_triton_was_imported_first():
    # torch._dynamo (torch.compile, checkpoint) imports triton; if that happens before
    # kernels.py sets TRITON_INTERPRET, triton.language's own helpers must still be interpreted
    import os
    import subprocess
    import sys
    if torch.cuda.is_available():
        pytest.skip("the interpreter is only forced without a GPU")
    code = ("import triton.language, torch, kernels;"
            "x = torch.randn(3, 100); t = torch.tensor([1, -100, 99]);"
            "assert torch.allclose(kernels.token_logprobs(x, t, backend='triton'),"
            " kernels.token_logprobs_ref(x, t), atol=1e-5)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a fresh shell
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=os.path.dirname(os.path.abspath(kernels.__file__)))
    assert out.returncode == 0, out.stderr[-2000:]


# -----------------------------------------------------------------------------
# Bad input

@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_inputs_raise_value_error(backend):
    x, t, _ = _inputs((2, 3), 50, torch.float32, seed=9)
    bad = [
        ((x, t[:, :2]), "shape"),                               # targets shape mismatch
        ((x, t.int()), "int64"),                                # targets dtype
        ((x, t.float()), "int64"),
        ((x.long(), t), "dtype"),                               # integer logits
        ((x, t, 0.0), "temperature"),
        ((x, t, -1.0), "temperature"),
        ((x, t, float("inf")), "temperature"),
        ((x, torch.full_like(t, 50)), r"\[0, 50\)"),            # target == V
        ((x, torch.full_like(t, -1)), r"\[0, 50\)"),            # negative but not -100
        ((x[..., :0], t), "V >= 1"),                            # empty vocabulary
    ]
    for args, match in bad:
        with pytest.raises(ValueError, match=match):
            token_logprobs(*args, backend=backend)
    with pytest.raises(ValueError, match="backend"):
        token_logprobs(x, t, backend="cuda")
    if backend == "triton":  # float64 is for the reference (the oracle) only
        with pytest.raises(ValueError, match="dtype"):
            token_logprobs(x.double(), t, backend="triton")


# ============================================================================
# verify.py. Tests for verify.py: equivalence table, extraction table, red team, the arith rule, bulk.
# ============================================================================

# ----------------------------------------------------------------------------- is_equiv table

MATCH = [  # equivalent forms: must match
    # integers and the fast path
    ("42", "42"), ("042", "42"), ("-0", "0"), (" 42 ", "42"), ("42.0", "42"), ("42.000", "42"),
    ("+42", "42"), ("10", "1e1"), ("1,000", "1000"), ("1{,}000", "1000"), ("1,\\!000", "1000"),
    ("1\\,000", "1000"), ("1,234,567", "1234567"), ("1,234.5", "1234.5"),
    ("123456789012345678901234567890", "123456789012345678901234567890.0"),
    # fractions, decimals, mixed numbers
    ("\\frac{1}{2}", "1/2"), ("\\dfrac{1}{2}", "\\frac12"), ("\\tfrac{1}{2}", "0.5"),
    ("\\frac{2}{4}", "\\frac{1}{2}"), ("-\\frac{1}{2}", "\\frac{-1}{2}"), ("\\frac{1}{-2}", "-0.5"),
    ("\\frac{3}{2}", "1.5"), (".5", "0.5"), ("0.50", "\\frac12"), ("\\frac{10}{4}", "2.5"),
    ("5/2", "\\frac{5}{2}"), ("(1/2)", "1/2"), ("\\frac{1}{3}", "\\dfrac{2}{6}"),
    ("2\\frac{1}{2}", "\\frac52"), ("2 1/2", "2.5"), ("-2\\frac{1}{2}", "-2.5"),
    ("\\frac{0}{5}", "0"), ("0.125", "\\frac{1}{8}"),
    # scientific notation and powers
    ("1.5\\times10^{3}", "1500"), ("1.5 \\cdot 10^3", "1500"), ("1.5e3", "1500"),
    ("2.5E-2", "0.025"), ("10^{-3}", "0.001"), ("2^{10}", "1024"), ("2^{-1}", "\\frac{1}{2}"),
    ("(-2)^3", "-8"), ("-2^2", "-4"), ("3^{2}\\cdot 2", "18"), ("6 \\div 4", "1.5"),
    # radicals, pi, implicit products
    ("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}"), ("\\sqrt{3}/2", "\\frac{\\sqrt3}{2}"),
    ("2\\sqrt{3}", "\\sqrt{12}"), ("\\sqrt{18}", "3\\sqrt2"), ("\\sqrt{4}", "2"),
    ("\\sqrt{\\frac{4}{9}}", "\\frac23"), ("\\sqrt[3]{27}", "3"), ("\\sqrt[3]{-8}", "-2"),
    ("\\sqrt[4]{16}", "2"), ("2\\pi", "\\pi+\\pi"), ("\\frac{\\pi}{2}", "\\frac12\\pi"),
    ("\\frac{2\\pi}{3}", "\\frac{2}{3}\\pi"), ("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}"),
    ("\\sqrt{2}\\cdot\\sqrt{8}", "4"), ("4^{1/2}", "2"), ("8^{\\frac{1}{3}}", "2"),
    ("1+\\sqrt{2}", "\\sqrt{2}+1"), ("\\frac{1+\\sqrt{5}}{2}", "\\frac{\\sqrt5+1}{2}"),
    ("2(3+1)", "8"), ("\\left(\\frac{1}{2}\\right)^2", "\\frac14"), ("\\frac\\pi4", "0.25\\pi"),
    ("3.14159265359", "\\pi"),  # ~12 significant digits of an irrational gold count (1e-9)
    # LaTeX and text normalisation
    ("\\$5", "5"), ("\\$5.00", "5"), ("$5$", "5"), ("50\\%", "50"), ("50%", "50"),
    ("90^\\circ", "90"), ("90^{\\circ}", "90"), ("90\u00b0", "90"), ("90 degrees", "90"),
    ("5\\text{ cm}", "5"), ("5 cm", "5"), ("5\\text{ cm}^2", "5"), ("5 square units", "5"),
    ("12 \\text{ inches}", "12"), ("3 hours", "3"), ("10 m", "10"), ("5\\mbox{ meters}", "5"),
    ("5cm", "5"), ("\\text{5}", "5"), ("\\textbf{5}", "5"), ("x = 5", "5"), ("x=5", "5"),
    ("y = -3", "-3"), ("5", "x=5"), ("a_1 = 7", "7"), ("\\theta = \\frac{\\pi}{4}", "\\frac\\pi4"),
    ("x \\in [1,2]", "[1,2]"), ("5.", "5"), ("\\boxed{5}", "5"), ("{5}", "5"), ("{{5}}", "5"),
    ("\\displaystyle\\frac{1}{2}", "0.5"), ("\\frac{1}{2}\\,", "0.5"), ("\\;7\\quad", "7"),
    ("\\text{Monday}", "Monday"), ("\\text{yes}", "Yes"), ("\\text{even}", "\\text{Even}"),
    ("\\text{no solution}", "no solution"), ("x^2+1", "x^2 + 1"), ("\\frac{x}{2}", "\\dfrac{x}{2}"),
    ("\\infty", "\\infty"),
    # unicode
    ("\u22125", "-5"), ("\u20135", "-5"), ("\uff11\uff12", "12"), ("\u0663", "3"),
    ("3\u00d74", "12"), ("\u03c0", "\\pi"), ("2\u03c0", "2\\pi"), ("\u221a4", "2"),
    ("\U0001d7d3", "5"),
    # tuples, intervals, sets, unions
    ("(1,2)", "(1, 2)"), ("(1,\\frac12)", "(1,0.5)"), ("[0,1)", "[0, 1)"),
    ("\\left(1,2\\right)", "(1,2)"), ("(-\\infty,3)", "(-\\infty, 3)"),
    ("(-\\infty,\\infty)", "(-\\infty, \\infty)"), ("[1,2)\\cup(3,4]", "(3,4]\\cup[1,2)"),
    ("\\{1,2,3\\}", "\\{3,2,1\\}"), ("3, 1, 2", "1,2,3"), ("\\{1,2\\}", "1, 2"),
    ("((1,2),(3,4))", "((1, 2), (3, 4))"), ("(1, 2, 3)", "\\left(1,2,3\\right)"),
    ("\\{-1, \\frac{1}{2}\\}", "\\{0.5, -1\\}"), ("(2, \\sqrt{2})", "(2, 2^{1/2})"),
    # multiple choice
    ("A", "A"), ("(A)", "A"), ("\\text{(A)}", "A"), ("\\textbf{(B)}", "B"), ("C", "(C)"),
    ("D.", "D"),
]

NO_MATCH = [  # near misses: must not match
    ("0.333", "\\frac{1}{3}"), ("0.3333333333", "1/3"), ("\\frac{1}{3}", "0.3333333333333333"),
    ("0.33", "0.333"), ("1/2", "2"), ("2", "\\frac{1}{2}"), ("(1,2)", "[1,2]"), ("(1,2)", "(1,2]"),
    ("(1,2)", "(2,1)"), ("(1,2)", "1,2"), ("[1,2]", "\\{1,2\\}"), ("\\{1,2\\}", "(1,2)"),
    ("(1,2,3)", "(1,2)"), ("10", "100"), ("100", "10"), ("3 or 4", "3"), ("3\\text{ or }4", "3"),
    ("3, 4", "3"), ("1,2,3,4", "3"), ("\\{3\\}", "3"), ("\\{1,2\\}", "\\{1,2,3\\}"),
    ("\\{1,1\\}", "\\{1,2\\}"), ("-5", "5"), ("5", "-5"), ("-\\frac12", "\\frac12"),
    ("\\frac{\\sqrt3}{2}", "\\frac{\\sqrt2}{2}"), ("0.866", "\\frac{\\sqrt{3}}{2}"),
    ("3.14", "\\pi"), ("\\frac{22}{7}", "\\pi"), ("\\sqrt{3}", "3"), ("2\\sqrt{3}", "2\\sqrt{2}"),
    ("\\sqrt[3]{8}", "\\sqrt{8}"), ("1.5", "1.50001"), ("1e3", "1e4"), ("2^{10}", "1000"),
    ("2^{3}", "2^{4}"), ("1.0000000001", "1"), ("1000000", "1000001"),
    ("123456789012345678901234567890", "123456789012345678901234567891"),
    ("0", "0.0001"), ("10^{10^{10}}", "10^{10^{11}}"), ("10^{10^{10}}", "1"),
    ("10^{-10^{10}}", "0"), ("\\pi^{-10^{6}}", "0"), ("2\\frac{1}{2}", "1"), ("2 1/2", "1"),
    ("50\\%", "0.5"), ("5\\%", "5.1"), ("1,000", "1"), ("1,000", "1000.5"), ("12", "1,2"),
    ("1,234", "1, 234"), ("B", "A"), ("(A)(B)", "A"), ("A, B", "A"), ("AB", "A"),
    ("\\text{(B)}", "A"), ("E", "A"), ("5", "6"), ("", "5"), ("5", ""), ("  ", "5"), ("\\$", "5"),
    ("x", "5"), ("x = 5", "6"), ("x = 5 \\text{ or } x = 6", "5"), ("5 = 5", "5"),
    ("\\infty", "-\\infty"), ("(-\\infty, 3)", "(-\\infty, 3]"),
    ("[1,2)\\cup(3,4]", "[1,2]\\cup(3,4]"), ("2.5.3", "0.75"), ("\\frac{1}{2}3", "\\frac32"),
    ("\\frac{1}{0}", "\\infty"), ("1/0", "2/0"), ("0^0", "1"), ("e", "2.718281828"),
    ("i", "-1"), ("x^2", "x^3"), ("Yes", "No"), ("\\text{Monday}", "Tuesday"),
    ("90^\\circ", "\\frac{\\pi}{2}"), ("\u0663", "4"), ("3\u00b2", "9"), ("\\sqrt{-4}", "2"),
    ("(-8)^{1/3}", "-2"), ("2\\infty", "\\infty"), ("None", "0"),
]


@pytest.mark.parametrize("pred,gold", MATCH)
def test_equivalent_forms_match(pred, gold):
    assert is_equiv(pred, gold)


@pytest.mark.parametrize("pred,gold", NO_MATCH)
def test_near_misses_do_not_match(pred, gold):
    assert not is_equiv(pred, gold)


def test_table_is_large_enough():
    assert len(MATCH) + len(NO_MATCH) >= 150


@pytest.mark.parametrize("pred,gold", MATCH[::7] + NO_MATCH[::7])
def test_is_equiv_is_symmetric(pred, gold):
    assert is_equiv(pred, gold) == is_equiv(gold, pred)


@pytest.mark.parametrize("bad", [None, 5, 5.0, b"5", ["5"]])
def test_is_equiv_non_strings_are_false(bad):
    assert not is_equiv(bad, "5") and not is_equiv("5", bad)

# ----------------------------------------------------------------------------- extraction table

EXTRACT = [
    ("The answer is \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\fbox{7}", "7"),
    ("$\\boxed{\\frac{1}{2}}$", "\\frac{1}{2}"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{\\left(1, \\frac{\\sqrt{3}}{2}\\right)}", "\\left(1, \\frac{\\sqrt{3}}{2}\\right)"),
    ("so $\\boxed 5$", "5"),
    ("\\boxed{ 12 }", "12"),
    ("\\boxed{\\boxed{5}}", "5"),
    ("\\boxed{}", None),
    ("\\boxed{   }", None),
    ("\\boxed{5", None),
    ("\\boxed{5} and later \\boxed{6", None),  # the last box is cut off: truncated, scores 0
    ("\\boxedx", None),
    ("no answer here", None),
    ("", None),
    ("<think>\\boxed{3}</think> so \\boxed{4}", "4"),
    ("<think>\\boxed{3}</think> the end", None),
    ("<think>still thinking \\boxed{3}", None),
    ("reasoning \\boxed{2} </think> \\boxed{5}", "5"),
    ("<answer>12</answer>", "12"),
    ("<answer> 12 </answer> more", "12"),
    ("<answer>12", None),
    ("\\boxed{1} <answer>2</answer>", "1"),  # a box wins over every fallback
    ("blah\n#### 1,234", "1,234"),
    ("blah\n#### 72\nmore text", "72"),
    ("So the answer is 17.", "17"),
    ("The final answer is $\\frac{3}{4}$.", "$\\frac{3}{4}$"),
    ("The answer is **9**", "9"),
    ("The answer is 3.5.", "3.5"),
    ("the answer is: 2. Then I checked it.", "2"),
    ("Answer is 1. No wait, the answer is 2", "2"),
]


@pytest.mark.parametrize("text,expected", EXTRACT)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_fallbacks_switch_off():
    assert extract_answer("<answer>3</answer>", answer_tag=False) is None
    assert extract_answer("#### 5", gsm8k=False) is None
    assert extract_answer("the answer is 5", answer_is=False) is None
    assert extract_answer("\\boxed{5}", boxed=False) is None
    assert extract_answer("\\boxed{5} and the answer is 6", boxed=False) == "6"
    assert extract_answer("\\boxed{5}", boxed=True, answer_tag=False, gsm8k=False,
                          answer_is=False) == "5"


def test_extract_bounds_answer_length():
    assert extract_answer("\\boxed{" + "1" * (verify.MAX_ANSWER + 1) + "}") is None
    assert extract_answer("\\boxed{" + "1" * verify.MAX_ANSWER + "}") == "1" * verify.MAX_ANSWER
    assert extract_answer(None) is None and extract_answer(42) is None

# ----------------------------------------------------------------------------- red team

def timed(fn, *args, repeats=3):
    """fn(*args) and its best time over a few repeats, caches cleared each time (cold calls)."""
    best = float("inf")
    for _ in range(repeats):
        verify._normalize.cache_clear()
        verify._value.cache_clear()
        t = time.perf_counter()
        out = fn(*args)
        best = min(best, time.perf_counter() - t)
    return out, best


MB = 1 << 20
PROMPT = "What is 2+3? Let's think step by step and output the final answer within \\boxed{}."
RED_TEAM = [  # (completion, gold, expected reward)
    ("\\boxed{3} \\boxed{4}", "3", 0.0),  # adjacent boxes are one answer, the list 3, 4
    ("\\boxed{3} \\boxed{4}", "4", 0.0),
    ("\\boxed{3}. No, \\boxed{4}", "4", 1.0),  # boxes apart: only the last counts
    (" ".join(f"\\boxed{{{i}}}" for i in range(100)), "42", 0.0),  # every candidate boxed
    ("\\boxed{" + ", ".join(map(str, range(100))) + "}", "42", 0.0),  # a boxed list of all
    ("\\boxed{" + ", ".join(map(str, range(10000))) + "}", "42", 0.0),  # ... longer than a box
    ("\\boxed{1, 2, 3, 4, 5}", "3", 0.0),
    ("\\boxed{\\{1,2,3\\}}", "2", 0.0),
    ("\\boxed{1 \\text{ or } 2 \\text{ or } 3}", "2", 0.0),
    ("\\boxed{x = 1 \\text{ or } x = 2}", "2", 0.0),
    ("\\boxed{(A)(B)(C)(D)}", "A", 0.0),
    ("\\boxed{ABCD}", "A", 0.0),
    (PROMPT, "5", 0.0),  # the question echoed back: its empty box is the last one
    ("\\boxed{5}. " + PROMPT, "5", 0.0),
    ("\\boxed{}", "5", 0.0),  # empty box
    ("\\boxed{5", "5", 0.0),  # unbalanced
    ("\\boxed{{{{5}", "5", 0.0),
    ("\\boxed{5}}}}", "5", 1.0),  # stray closers after the box are harmless
    ("}}}}\\boxed{5}", "5", 1.0),
    ("\\boxed{" + "{" * 10000 + "5" + "}" * 10000 + "}", "5", 0.0),  # deeper than a box
    ("\\boxed{" + "{" * 300 + "5" + "}" * 300 + "}", "5", 0.0),
    ("\\boxed{" + "(" * 400 + "5" + ")" * 400 + "}", "5", 0.0),
    ("\\boxed{" + "\\sqrt{" * 150 + "1" + "}" * 150 + "}", "1", 0.0),
    ("\\boxed{" + "-" * 900 + "5}", "5", 0.0),
    ("\\boxed{" + "+".join(["1"] * 400) + "}", "400", 1.0),  # long but honest arithmetic
    ("x" * MB + "\\boxed{5}", "5", 1.0),  # 1 MB strings
    ("\\boxed{5}" + "x" * MB, "5", 1.0),
    ("\\boxed{" * (MB // 7), "5", 0.0),
    ("{" * MB, "5", 0.0),
    ("\\boxed{" + "1" * MB + "}", "5", 0.0),
    ("<think>" + "\\boxed{5}" * (MB // 9), "5", 0.0),
    ("</think>" * (MB // 8) + "\\boxed{5}", "5", 1.0),
    ("the answer is " * (MB // 14), "5", 0.0),
    ("#### " * (MB // 5), "5", 0.0),
    ("<answer>" * (MB // 8) + "5</answer>", "5", 1.0),
    ("\\boxed{" + "\\text{" * 150000 + "}", "5", 0.0),
    ("\\boxed{" + "1," * 499 + "1}", "1", 0.0),
    ("\\boxed{" + " " * 990 + "5 cm}", "5", 1.0),
    ("\\boxed{10^{10^{10}}}", "1", 0.0),  # huge powers: bounded, never computed
    ("\\boxed{10^{10^{10}}}", "10^{10^{10}}", 1.0),
    ("\\boxed{2^{2^{2^{2^{2}}}}}", "0", 0.0),
    ("\\boxed{9^{9^{9^{9}}}}", "9", 0.0),
    ("\\boxed{10^{999999999}}", "1", 0.0),
    ("\\boxed{(10^{100})^{100}}", "1", 0.0),
    ("\\boxed{1^{10^{10^{10}}}}", "2", 0.0),
    ("\\boxed{1.0000001^{10^{12}}}", "1", 0.0),
    ("\\boxed{\\pi^{10^{6}}}", "1", 0.0),
    ("\\boxed{\\pi^{-10^{6}}}", "0", 0.0),
    ("\\boxed{1e999}", "1", 0.0),
    ("\\boxed{1e999}", "1e999", 1.0),
    ("\\boxed{2^{0.5^{-1000}}}", "2", 0.0),
    ("\\boxed{\\sqrt[64]{10^{2000}}}", "1", 0.0),
    ("\\boxed{" + "9" * 999 + "}", "9" * 999, 1.0),
    ("\\boxed{" + "9" * 999 + "}", "9" * 998, 0.0),
    ("\\boxed{\u22125}", "-5", 1.0),  # unicode: minus signs and digits are normalised
    ("\\boxed{\uff15}", "5", 1.0),
    ("\\boxed{\u0665}", "5", 1.0),
    ("\\boxed{\u22125}", "5", 0.0),
    ("\\boxed{5}", "\u22125", 0.0),
    ("\\boxed{\u00b2}", "2", 0.0),  # a superscript is not a digit
    ("\\boxed{\u2167}", "8", 0.0),  # nor a Roman numeral
    ("\\boxed{__import__('os').system('echo pwned')}", "0", 0.0),  # never eval'd
    ("\\boxed{1/0}", "\\infty", 0.0),
    ("\\boxed{0^0}", "1", 0.0),
    (None, "5", 0.0),
    (b"\\boxed{5}", "5", 0.0),
]


@pytest.mark.parametrize("i", range(len(RED_TEAM)))
def test_red_team_reward_is_right_and_fast(i):
    completion, gold, expected = RED_TEAM[i]
    got, seconds = timed(reward, completion, gold)
    assert got == expected
    assert seconds < 0.050, f"{seconds * 1e3:.1f} ms"


ADVERSARIAL_ANSWERS = [
    "{" * 999, "}" * 999, "\\frac{" * 150, "\\sqrt" * 200, "\\sqrt[" * 150, "(" * 999,
    "1," * 499, "\\{" * 499, "x=" * 499, "^" * 999, "2^" * 499 + "2",
    "10^{" * 200 + "10" + "}" * 200,
    " " * 999, "\\text{" * 150 + "cm" + "}" * 150, "1" * 1000, "1." * 499, "\\cup" * 250,
    "\\left(" * 166, "9" * 10 ** 6, "\\boxed{" * 140, "\\frac12" * 140, "-" * 999 + "1",
    "[" * 500 + "]" * 499, "\\pi" * 333, "\u2212" * 999, "\uff15" * 999, "1e999" * 200,
    "\\{" + ",".join("\\{" + ",".join(str((k + j) % 14) for j in range(14)) + "\\}"
                      for k in range(14)) + "\\}",  # sets of sets: the quadratic match
]


@pytest.mark.parametrize("i", range(len(ADVERSARIAL_ANSWERS)))
def test_red_team_is_equiv_is_total_and_fast(i):
    answer = ADVERSARIAL_ANSWERS[i]
    for pred, gold in ((answer, "5"), ("5", answer), (answer, answer[:-1] or "5")):
        got, seconds = timed(is_equiv, pred, gold)
        assert got in (True, False)
        assert seconds < 0.050, f"{seconds * 1e3:.1f} ms"

# ----------------------------------------------------------------------------- the arith task

ARITH = [  # (completion, gold, expected)
    ("579", "579", 1.0), (" 579 \n", "579", 1.0), ("123+456=579", "579", 1.0),
    ("=579", "579", 1.0), ("123+456= 579", "579", 1.0), ("0579", "579", 1.0),
    ("-5", "-5", 1.0), ("-0", "0", 1.0), ("580=579", "579", 1.0), ("9" * 32, "9" * 32, 1.0),
    ("-" + "9" * 31, "-" + "9" * 31, 1.0),
    ("1" * 33, "1" * 33, 0.0), ("-" + "9" * 32, "-" + "9" * 32, 0.0), ("57 9", "579", 0.0),
    ("579.0", "579", 0.0), ("+579", "579", 0.0), ("5,79", "579", 0.0), ("578", "579", 0.0),
    ("", "579", 0.0), ("=", "579", 0.0), ("579=", "579", 0.0), ("579=580", "579", 0.0),
    ("abc", "579", 0.0), ("579abc", "579", 0.0), ("0x243", "579", 0.0), ("5e2", "500", 0.0),
    ("1_000", "1000", 0.0), ("\uff11\uff12", "12", 0.0), ("\u0663", "3", 0.0),
    ("\u22125", "-5", 0.0), ("\\boxed{579}", "579", 0.0), ("5" * MB, "5", 0.0),
    ("=" * MB, "5", 0.0), (None, "5", 0.0),
]


@pytest.mark.parametrize("completion,gold,expected", ARITH)
def test_arith_rule(completion, gold, expected):
    got, seconds = timed(reward, completion, gold, "arith")
    assert got == expected and seconds < 0.050

# ----------------------------------------------------------------------------- bulk and API

BULK = ([(c, g) for c, g, _ in RED_TEAM if c is None or len(c) < 100_000]
        + [(f"so \\boxed{{{p}}}", g) for p, g in MATCH + NO_MATCH])


@pytest.mark.parametrize("workers", [None, 1, 2])
def test_rewards_equals_reward_elementwise(workers):
    completions, golds = zip(*BULK)
    expected = [reward(c, g) for c, g in BULK]
    assert rewards(list(completions), list(golds), workers=workers) == expected
    assert sum(expected) > 50  # the table really mixes right and wrong


def test_rewards_arith_and_empty():
    table = [(c, g, e) for c, g, e in ARITH if c is None or len(c) < 99]
    completions, golds, expected = zip(*table)
    assert rewards(list(completions), list(golds), task="arith") == list(expected)
    assert rewards([], []) == []
    with pytest.raises(ValueError):
        rewards(["1"], [])


def test_unknown_task_or_verifier_is_a_caller_error():
    with pytest.raises(ValueError, match="chess"):
        reward("\\boxed{1}", "1", task="chess")
    with pytest.raises(ValueError, match="chess"):
        rewards(["\\boxed{1}"], ["1"], task="chess")
    with pytest.raises(ValueError, match="oracle"):
        reward("\\boxed{1}", "1", verifier="oracle")


@pytest.fixture
def fake_math_verify(monkeypatch):
    """A stand-in for the optional math-verify package: it says yes to answers spelled 'half'."""
    calls = []
    fake = types.ModuleType("math_verify")
    fake.parse = lambda text, parsing_timeout=None: (calls.append(parsing_timeout), text)[1]
    fake.verify = lambda gold, pred, timeout_seconds=None: "half" in pred and "1/2" in gold
    monkeypatch.setitem(sys.modules, "math_verify", fake)
    verify._load_math_verify.cache_clear()
    yield calls
    verify._load_math_verify.cache_clear()


def test_both_verifier_accepts_if_either_does(fake_math_verify):
    assert reward("\\boxed{half}", "1/2", verifier="rules") == 0.0
    assert reward("\\boxed{half}", "1/2", verifier="both") == 1.0
    assert reward("\\boxed{0.5}", "1/2", verifier="both") == 1.0
    assert reward("<think>\\boxed{half}", "1/2", verifier="both") == 0.0  # same extraction
    assert fake_math_verify and all(t == verify.MV_TIMEOUT_S for t in fake_math_verify)
    assert rewards(["\\boxed{half}"] * 3, ["1/2"] * 3, verifier="both", workers=1) == [1.0] * 3


def test_both_verifier_off_the_main_thread_skips_with_a_warning(fake_math_verify):
    out = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = threading.Thread(target=lambda: out.append(reward("\\boxed{half}", "1/2",
                                                              verifier="both")))
        t.start()
        t.join()
    assert out == [0.0] and any("main thread" in str(w.message) for w in caught)


def test_both_verifier_without_the_package_says_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # makes the import fail
    verify._load_math_verify.cache_clear()
    with pytest.raises(ImportError, match="math-verify"):
        reward("\\boxed{1}", "1", verifier="both")
    verify._load_math_verify.cache_clear()


def test_rewards_survives_a_dead_worker_pool(monkeypatch):
    class Broken:
        def map(self, *args):
            raise verify.BrokenProcessPool("a worker died")
    monkeypatch.setattr(verify, "_pool", lambda workers: Broken())
    monkeypatch.setattr(verify._pool, "cache_clear", lambda: None, raising=False)
    assert rewards(["\\boxed{2}", "\\boxed{3}"], ["2", "2"], workers=2) == [1.0, 0.0]


# ============================================================================
# massbalance.py. Tests of massbalance.py: Theorem 1 and Lemma 2 against exact references, the simulation's
# ============================================================================

@pytest.fixture
def one_thread():
    """The simulation runs fastest on one thread on a shared 2-core CPU; restore afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _random_case(v, n, seed):
    """Random peaked logits (V,), a random correct mask and the distinct tokens of n draws."""
    gen = torch.Generator().manual_seed(seed)
    logits = 2.0 * torch.randn(v, generator=gen, dtype=torch.float64)  # (V,)
    correct = torch.rand(v, generator=gen) < 0.4  # (V,)
    draws = torch.multinomial(logits.softmax(-1), n, replacement=True, generator=gen)  # (n,)
    sampled = torch.zeros(v, dtype=torch.bool).index_fill_(0, draws, True)  # (V,)
    u = torch.rand(2, generator=gen, dtype=torch.float64)
    r_c, r_w = 0.2 + 1.5 * u[0].item(), -1.5 * u[1].item()  # any R_c > 0 >= R_w
    return logits, correct, sampled, r_c, r_w


@pytest.mark.parametrize("n", [1, 4, 16, 64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_theorem1_matches_exact_softmax_change(n, seed):
    # one exact step of the update Theorem 1 linearises, small lr, float64: the first-order
    # prediction must match the exact change of Q_pos to relative error O(lr) << 1e-3
    logits, correct, sampled, r_c, r_w = _random_case(v=53, n=n, seed=seed)
    lr = 1e-5
    new = mb.surrogate_logit_step(logits, correct, sampled, r_c, r_w, lr=lr, n=n)
    exact = (new.softmax(-1)[correct].sum() - logits.softmax(-1)[correct].sum()).item()
    terms = mb.mass_balance_terms(logits.softmax(-1), correct, sampled, r_c, r_w, lr=lr, n=n)
    assert abs(terms.total - exact) <= 1e-3 * abs(exact)
    assert terms.total == pytest.approx(sum(terms[:3]), rel=1e-12)
    # the paper's sign claims: sampled terms never negative
    assert terms.sampled_correct >= 0 and terms.sampled_incorrect >= 0


def test_theorem1_unsampled_coupling_can_shrink_correct_mass():
    # a big correct token left unsampled: the coupling term wins and Q_pos falls, exactly too
    # tokens: sampled correct, unsampled correct, unsampled wrong
    probs = torch.tensor([0.1, 0.8, 0.1], dtype=torch.float64)
    correct = torch.tensor([True, True, False])
    sampled = torch.tensor([True, False, False])
    terms = mb.mass_balance_terms(probs, correct, sampled, lr=1e-4)
    assert terms.unsampled_coupling < 0 and terms.total < 0
    new = mb.surrogate_logit_step(probs.log(), correct, sampled, lr=1e-4)
    exact = new.softmax(-1)[:2].sum().item() - 0.9
    assert exact < 0 and abs(terms.total - exact) <= 1e-3 * abs(exact)


@pytest.mark.parametrize("n", [1, 7, 40])
def test_lemma2_matches_monte_carlo(n):
    gen = torch.Generator().manual_seed(n)
    v, trials = 31, 20_000
    probs = (1.5 * torch.randn(v, generator=gen, dtype=torch.float64)).softmax(-1)  # (V,)
    correct = torch.rand(v, generator=gen) < 0.5  # (V,)
    draws = torch.multinomial(probs.expand(trials, v), n, replacement=True,
                              generator=gen)  # (trials, n)
    unsampled = torch.ones(trials, v, dtype=torch.bool).scatter_(1, draws, False)  # (trials, V)
    for mask in (None, correct, ~correct):
        keep = unsampled if mask is None else unsampled & mask
        u2 = (probs ** 2 * keep).sum(1)  # (trials,) unsampled squared mass per trial
        se = u2.std().item() / trials ** 0.5
        assert abs(u2.mean().item() - mb.expected_unsampled_mass(probs, n, mask)) <= 3 * se


def test_lemma2_falls_with_n():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    values = [mb.expected_unsampled_mass(probs, n) for n in (0, 1, 4, 16, 64, 512)]
    assert values[0] == pytest.approx((probs ** 2).sum().item())
    assert all(a > b for a, b in zip(values, values[1:]))


def test_surrogate_grad_matches_autograd():
    gen = torch.Generator().manual_seed(0)
    s, v, n = 3, 37, 9
    z = torch.randn(s, v, generator=gen, dtype=torch.float64, requires_grad=True)  # (S, V)
    reward = torch.where(torch.rand(v, generator=gen) < 0.3, 1.0, -1.0).double()  # (V,)
    draws = torch.multinomial(z.detach().softmax(-1), n, replacement=True, generator=gen)  # (S, n)
    r = reward[draws]  # (S, n) reward of each draw
    rtilde = r - r.mean(1, keepdim=True)  # batch-mean centred
    loss = -(rtilde * z.softmax(-1).gather(1, draws)).sum() / n  # summed over independent rows
    loss.backward()
    counts = torch.zeros(s, v, dtype=torch.float64).scatter_add_(
        1, draws, torch.ones(s, n, dtype=torch.float64))  # (S, V) draws per token
    grad = mb.surrogate_grad(z.detach().softmax(-1), counts, reward, n)
    torch.testing.assert_close(grad, z.grad)


def test_adamw_matches_torch():
    gen = torch.Generator().manual_seed(0)
    ref = torch.nn.Parameter(torch.randn(3, 17, generator=gen))
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1)
    z, m, v = ref.detach().clone(), torch.zeros(3, 17), torch.zeros(3, 17)
    for t in range(1, 6):
        grad = torch.randn(3, 17, generator=gen)
        ref.grad = grad.clone()
        opt.step()
        mb.adamw_(z, grad, m, v, t, 1e-2, (0.8, 0.99), 1e-6, 0.1)
    torch.testing.assert_close(z, ref.detach())


def test_small_simulation_orders_q_pos_by_n(one_thread):
    # the paper's Figure 3 shape at a small size (checked offline: holds for seeds 0..9, with
    # margins ~5x the seed spread). Not smaller: at V = 2000, 300 steps of N = 4 already sample
    # every correct token several times and Q_pos(N=4) rises instead of falling.
    res = mb.simulate([4, 512, 51200], seeds=1, vocab=10_000, n_correct=800, steps=200,
                      seed=0, log_every=0)
    q0, (q4, q512, q51200) = res["q_pos"][0, 0], res["q_pos"][-1]
    assert q51200 > q512 > q4 and q4 < q0 < q51200
    assert res["improved_pct"][-1, 2] == 100.0 and res["worst_drop"][-1, 2] == 0.0
    assert res["improved_pct"][-1, 0] < 50.0


def test_cli_writes_figures_and_json(tmp_path, capsys, one_thread):
    mb.main(["--vocab", "300", "--n-correct", "30", "--steps", "5", "--ns", "4", "64",
             "--sweep-ns", "4", "16", "--seeds", "2", "--out", str(tmp_path)])
    assert (tmp_path / "simulation.png").exists() and (tmp_path / "sweep.png").exists()
    out = json.loads((tmp_path / "results.json").read_text())
    assert [r["n"] for r in out["final"]] == [4, 16, 64]
    assert "Q_pos mean" in capsys.readouterr().out


def test_bad_arguments_raise():
    p = torch.full((4,), 0.25, dtype=torch.float64)
    yes, no = torch.tensor([True, False, True, False]), torch.zeros(4, dtype=torch.bool)
    with pytest.raises(ValueError):
        mb.mass_balance_terms(p, yes[:3], no)  # shape mismatch
    with pytest.raises(ValueError):
        mb.mass_balance_terms(p, yes.long(), no)  # not a boolean mask
    with pytest.raises(ValueError):
        mb.mass_balance_terms(2 * p, yes, no)  # not a distribution
    with pytest.raises(ValueError):
        mb.mass_balance_terms(p, yes, no, r_correct=-1.0)  # theorem needs R_c >= 0 >= R_w
    with pytest.raises(ValueError):
        mb.mass_balance_terms(p, yes, no, n=0)
    with pytest.raises(ValueError):
        mb.expected_unsampled_mass(p, -1)
    with pytest.raises(ValueError):
        mb.init_logits(10, 10)  # no incorrect token left
    with pytest.raises(ValueError):
        mb.init_logits(10, 3, anchor="maybe")
    with pytest.raises(ValueError):
        mb.simulate([0], vocab=10, n_correct=3, steps=1)
    with pytest.raises(SystemExit):
        mb.main(["--anchor", "maybe"])


def test_expected_terms_coupling_vanishes_when_every_token_is_sampled():
    probs = (0.5 * torch.randn(20, generator=torch.Generator().manual_seed(0))).softmax(-1)
    correct = torch.arange(20) < 7
    terms = mb.expected_terms(probs, correct, n=5000, draws=5)  # P(a token missed) < 1e-20
    assert terms.unsampled_coupling == 0.0
    assert terms.sampled_correct > 0 and terms.sampled_incorrect > 0
