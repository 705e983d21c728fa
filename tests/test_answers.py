"""The sets task and its whole answer distribution (lib/answers.py): the task's verifier, every
answer's probability against the model's full logits (brute force, one answer at a time) and
against the sampler's rates (binomial error), the Figure 3 measures by hand; the mass balance's
terms (lib/balance.py) against the softmax's own first-order change; a run that logs both."""

import dataclasses
import json
import math

import pytest
import torch

import brorl
import data
import verify
from lib import answers, balance
from lib.policy import load_policy
from sampler import generate


@pytest.fixture(scope="module")
def sets_model():
    model, tok = load_policy(str(data.EMBEDDED_MODEL_SETS), torch.device("cpu"))
    return model.eval(), tok


def test_sets_task():
    """256 fixed prompts, 16 right values and 4 decoys each, all distinct 3-digit values; train =
    eval."""
    rows = data.load_task("sets", "train")
    assert len(rows) == 256 == len({r["prompt"] for r in rows})
    assert rows == data.load_task("sets", "test")
    for r in rows:
        values = r["answer"].split(",") + r["decoys"]
        assert len(values) == len(set(values)) == 20 and all(100 <= int(v) <= 999 for v in values)
    assert len({r["answer"] for r in rows}) == 256  # every prompt its own set


def test_sets_verifier():
    gold = "105,230,999"
    completions = ("230", " 230 ", "0230", "x=999", "231", "", "2 30")
    want = [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0]
    assert [verify.reward(c, gold, "sets") for c in completions] == want
    assert verify.rewards(["105", "106"], [gold, gold], task="sets") == [1.0, 0.0]


def full_logits(model, tok, prompt, answer, temperature):
    """The oracle: one answer alone, every position's logits, tempered, log-softmax in float64."""
    p = tok(prompt)["input_ids"]
    a = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([p + a])).logits[0, len(p) - 1: -1].double()
    logp = torch.log_softmax(logits / temperature, -1)  # (len(a), V)
    return logp.gather(1, torch.tensor(a)[:, None]).sum().item()


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_distribution_equals_brute_force(sets_model, temperature):
    """Every one of the 900 answers of 3 prompts in one call (answers batched against their
    prompt's keys/values) against each answer alone through the full logits; and the mass sums
    below 1."""
    model, tok = sets_model
    examples = data.load_task("sets", "train")[:3]
    space = answers.space("sets")
    # (3, 900)
    got = answers.distribution(model, tok, examples, space, temperature, rows_per_pass=1000)
    for i in (0, 2):
        for j in (0, 137, 899, *[space.index(v) for v in examples[i]["answer"].split(",")[:3]]):
            want = full_logits(model, tok, examples[i]["prompt"], space[j], temperature)
            assert abs(got[i, j].item() - want) < 1e-4, (i, j, got[i, j].item(), want)
    total = got.exp().sum(1)
    assert (total <= 1 + 1e-6).all() and (total > 0.9).all(), total  # little mass outside the space


@pytest.mark.slow
def test_distribution_matches_the_sampled_rates(sets_model):
    """4,096 rollouts of 4 prompts at T = 1: the share of right answers drawn is Q, and the share
    of each prompt's most likely answer its probability, within 4.5 binomial standard errors.
    Within 4 tokens the integer rule accepts exactly the right values' sequences (a 4th digit or a
    space is cut)."""
    model, tok = sets_model
    examples = data.load_task("sets", "train")[:4]
    space = answers.space("sets")
    logp = answers.distribution(model, tok, examples, space, 1.0)
    q = answers.measures(logp, answers.right_mask(examples, space))["q"]
    n = 4096
    ro = generate(model, tok, [x["prompt"] for x in examples], n, 4, 1.0, 1.0, 8192, [7, 8, 9, 10])
    for i, x in enumerate(examples):
        texts = ro.texts[i * n: (i + 1) * n]
        cut = ro.truncated[i * n: (i + 1) * n].tolist()
        rate = sum(verify.reward(t, x["answer"], "sets") * (not c) for t, c in zip(texts, cut)) / n
        p = q[i].item()
        assert abs(rate - p) < 4.5 * math.sqrt(p * (1 - p) / n) + 1 / n, (i, rate, p)
        top = logp[i].argmax().item()
        p_top = logp[i, top].exp().item()
        rate_top = sum(t == space[top] and not c for t, c in zip(texts, cut)) / n
        assert abs(rate_top - p_top) < 4.5 * math.sqrt(p_top * (1 - p_top) / n) + 1 / n


def test_measures_by_hand():
    """Two prompts, four answers (0.1 of prompt 0 outside the space): Q, outside, entropy, the
    share of right answers that rose and the worst drop (a wrong answer of prompt 0 falls further:
    it must not count), and the exact pass@k."""
    p0 = torch.tensor([[0.4, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    p1 = torch.tensor([[0.5, 0.2, 0.0, 0.2], [0.1, 0.3, 0.3, 0.3]], dtype=torch.float64)
    right = torch.tensor([[True, True, False, False], [True, True, True, False]])
    m = answers.measures(p1.log(), right, p0.log())
    assert torch.allclose(m["q"], torch.tensor([0.7, 0.7], dtype=torch.float64))
    assert torch.allclose(m["outside"], torch.tensor([0.1, 0.0], dtype=torch.float64))
    h0 = -(0.5 * math.log(0.5) + 0.2 * math.log(0.2) * 2 + 0.1 * math.log(0.1))
    assert abs(m["entropy"][0].item() - h0) < 1e-12  # the outside mass one outcome
    assert torch.allclose(m["right_rose"], torch.tensor([0.5, 2 / 3], dtype=torch.float64))
    assert torch.allclose(m["right_worst_drop"], torch.tensor([0.1, 0.15], dtype=torch.float64))
    q = torch.tensor([0.0, 1e-9, 0.3, 1.0], dtype=torch.float64)
    for k in (1, 7, 1024):
        assert torch.allclose(answers.pass_at_k(q, k), 1 - (1 - q) ** k, rtol=1e-6, atol=0)
    # No cancellation near Q = 0.
    assert answers.pass_at_k(q, 1024)[1].item() == pytest.approx(1024e-9, rel=1e-5)


def test_theorem_terms_are_the_softmax_first_order_change():
    """The free-logit model's first-order change of Q (dp from dz = p (R - S_R)) is Theorem 1's
    three terms summed, on random distributions and sets; the sets partition the answers."""
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        p = torch.rand(41, generator=gen, dtype=torch.float64) ** 4
        p /= p.sum()
        right = torch.rand(41, generator=gen) < 0.4
        drawn = torch.randperm(41, generator=gen)[: 1 + trial % 7].tolist()
        t, sets = balance.theorem_terms(p, right, drawn,
                                        mean_reward=float(torch.rand(1, generator=gen)))
        assert abs(t["pred_dq"] - (t["term1"] + t["term2"] + t["term3"])) < 1e-12, (trial, t)
        assert sum(s.long() for s in sets.values()).eq(1).all()
        assert t["term1"] >= -1e-15 and t["term2"] >= -1e-15  # never negative (the theorem)


def test_theorem_terms_against_a_gradient_step_on_free_logits():
    """The oracle is autograd: the logits z = log p take one small gradient ascent step on the
    surrogate sum of R_i p_i over the distinct drawn answers (rewards centred by the group's mean),
    and the softmax's change of Q, and of the unsampled right mass, over eta is Theorem 1's three
    terms summed, and pred_du_pos, to first order in eta."""
    gen, eta = torch.Generator().manual_seed(1), 1e-6
    for trial in range(20):
        p = torch.rand(41, generator=gen, dtype=torch.float64) ** 4
        p /= p.sum()
        right = torch.rand(41, generator=gen) < 0.4
        drawn = torch.randperm(41, generator=gen)[: 1 + trial % 7].tolist()
        r = float(torch.rand(1, generator=gen))
        t, sets = balance.theorem_terms(p, right, drawn, mean_reward=r)
        z = p.log().requires_grad_()
        reward = torch.zeros(41, dtype=torch.float64)
        reward[drawn] = torch.where(right[drawn], 1 - r, -r).double()
        (grad,) = torch.autograd.grad((reward * z.softmax(0)).sum(), z)
        p1 = (z + eta * grad).softmax(0).detach()  # (41,)
        dq = (p1[right].sum() - p[right].sum()).item() / eta
        du = (p1[sets["U_pos"]].sum() - p[sets["U_pos"]].sum()).item() / eta
        scale = max(abs(dq), 1e-3)
        assert abs(dq - (t["term1"] + t["term2"] + t["term3"])) < 1e-3 * scale, (trial, dq, t)
        assert abs(du - t["pred_du_pos"]) < 1e-3 * max(abs(du), 1e-3), (trial, du, t)


@pytest.mark.slow
def test_a_sets_run_logs_the_answer_distribution_and_the_mass_balance(tmp_path):
    """--preset sets --mass_balance 1: every eval logs Figure 3's measures over 4 prompts and saves
    their distribution; every step with an update logs each trained group's four parts and the
    theorem's terms; a resumed run compares with the first eval's distribution, as the whole run
    did."""
    common = ["--n_rollouts", "16", "--prompts_per_step", "2", "--eval_prompts", "8",
              "--eval_samples", "2", "--answer_prompts", "4", "--probe_prompts", "2",
              "--probe_samples", "4", "--eval_every", "2"]
    out = tmp_path / "run"
    rows = brorl.train(brorl.parse_config(["--preset", "sets", "--steps", "2", *common,
                                           "--mass_balance", "1", "--out", str(out)]))
    evals = [r for r in rows if "answers_q" in r]
    assert [r["step"] for r in evals] == [0, 2] and len(evals[0]["answers_log10_q_per_prompt"]) == 4
    assert evals[0]["answers_right_rose"] == 0 and evals[0]["answers_right_worst_drop"] == 0
    saved = sorted(p.name for p in (out / "answers").iterdir())
    assert saved == ["step-000000.pt", "step-000002.pt"]
    trained = [r for r in rows if r.get("balance_groups")]
    assert trained and all(len(r["balance_groups"]) == r["groups_kept"] for r in trained)
    g = trained[0]["balance_groups"][0]
    parts = sum(g[f"{k}_before"] for k in ("A", "B", "U_pos", "U_neg"))
    assert abs(parts - 1) < 1e-4 and abs(g["A_before"] + g["U_pos_before"] - g["q_before"]) < 1e-6
    resumed = brorl.train(brorl.parse_config(["--resume", str(out), "--steps", "4"]))
    last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 4 and resumed[-1]["answers_right_rose"] == last["answers_right_rose"]
    first, now = (torch.load(out / "answers" / f"step-{s:06d}.pt") for s in (0, 4))
    assert first["prompts"] == now["prompts"] and len(now["prompts"]) == 4
    by_prompt = {x["prompt"]: x for x in data.load_task("sets", "train")}
    right = answers.right_mask([by_prompt[p] for p in now["prompts"]], answers.space("sets"))
    want = answers.measures(now["logp"], right, first["logp"])["right_rose"].mean().item()
    assert abs(last["answers_right_rose"] - want) < 1e-6


def test_resume_refuses_another_answer_set(tmp_path, capsys):
    """The first eval's answer distributions (answers/step-000000.pt) are what every later eval's
    rose and worst drop compare with, prompt by prompt: a resumed run with another --answer_prompts
    would fail at its first eval, after its training steps. It is refused in one line, before any
    work; the same value is taken."""
    run = tmp_path / "run"
    cfg = brorl.parse_config(["--preset", "sets", "--answer_prompts", "4", "--out", str(run)])
    (run / "ckpt").mkdir(parents=True)
    (run / "ckpt" / "trainer_state.pt").write_bytes(b"")  # parse_config only looks for it
    (run / "config.json").write_text(json.dumps(dataclasses.asdict(cfg)))
    assert brorl.parse_config(["--resume", str(run), "--answer_prompts", "4"]).answer_prompts == 4
    for n in ("8", "2", "0"):
        with pytest.raises(SystemExit) as stop:
            brorl.parse_config(["--resume", str(run), "--answer_prompts", n])
        err = capsys.readouterr().err
        assert stop.value.code == 2 and f"--answer_prompts {n} with --resume" in err, err


def test_eval_metrics_are_plain_json_when_q_underflows():
    """A prompt whose right answers all underflow to probability 0 is logged at log10 Q = -324, not
    -Infinity (metrics.jsonl is strict JSON)."""
    logp = torch.tensor([[0.0, -1e4], [-1.0, -2.0]], dtype=torch.float64)
    right = torch.tensor([[False, True], [True, False]])
    m = answers.eval_metrics(logp, right, logp)
    assert m["answers_log10_q_per_prompt"][0] == -324
    json.dumps(m, allow_nan=False)


def test_eval_only_measures_a_testbed_s_answer_distribution(tmp_path, capsys):
    """--eval_only --answer_prompts: the warm start's answer distribution measured before any run,
    printed and written to eval.json."""
    out = tmp_path / "eval"
    report = brorl.eval_only(brorl.parse_config(
        ["--preset", "sets", "--eval_only", "1", "--eval_prompts", "8", "--eval_samples", "2",
         "--answer_prompts", "3", "--probe_prompts", "2", "--out", str(out)]))
    assert "every answer of 3 prompts" in capsys.readouterr().out
    m = json.loads((out / "eval.json").read_text())
    answers_m = m["benchmarks"]["sets"]["answers"]
    assert 0 < answers_m["q"] < 1 and len(answers_m["log10_q_per_prompt"]) == 3
    assert answers_m["pass@1024"] >= answers_m["pass@1"] and report["benchmarks"] == m["benchmarks"]
