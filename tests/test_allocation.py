"""--alloc adaptive (lib/allocation.py): the allocation against brute force, the budget spent
exactly, the value function against its definition, the estimate and its checkpoint, groups of
unequal N through advantages, micro-batches, the batch and the step's metrics (equal sizes giving
the one-N path's numbers to the bit), --resume bit-exact, K = 2 processes equal to one, and the
uniform rule untouched."""

import itertools
import json
import math
import statistics

import pytest
import torch

import brorl
from lib import allocation, distributed, step, steplog
from lib.step import StepStats
import sampler
from test_brorl import SMALL


def value(n: int, q: float) -> float:
    """The test's own v(n, q): the chance that n draws of a q-coin are not all equal."""
    return 1 - q ** n - (1 - q) ** n


def brute_force(q: list, budget: int, n_min: int, n_max: int) -> float:
    """The largest sum of value over every allocation in [n_min, n_max] summing to budget."""
    sizes = itertools.product(range(n_min, n_max + 1), repeat=len(q))
    return max(sum(value(n, x) for n, x in zip(ns, q)) for ns in sizes if sum(ns) == budget)


@pytest.mark.parametrize("seed", range(12))
def test_allocation_is_the_brute_force_optimum(seed):
    """Random estimates (near 0 and 1 too), B in 1..4, bounds and every feasible budget: the
    greedy allocation's value equals the best of all allocations within the bounds that sum to
    the budget."""
    g = torch.Generator().manual_seed(seed)
    B = 1 + seed % 4
    q = torch.rand(B, generator=g, dtype=torch.float64) ** 3  # (B,) skewed toward 0: rare prompts
    q[0] = 1 - q[0] / 100 if seed % 3 == 0 else q[0]  # a nearly solved one
    n_min, n_max = 2 + seed % 2, 7
    for budget in range(B * n_min, B * n_max + 1):
        n = allocation.allocate(q, budget, n_min, n_max)  # (B,)
        assert n.sum().item() == budget and n.min() >= n_min and n.max() <= n_max
        got = sum(value(k, x) for k, x in zip(n.tolist(), q.tolist()))
        assert got == pytest.approx(brute_force(q.tolist(), budget, n_min, n_max), abs=1e-12)


def test_informative_chance_is_the_chance_a_group_is_not_all_equal():
    """v(n, q) by enumerating every outcome of n draws: the value function is its definition."""
    for n, q in itertools.product((2, 3, 5), (0.0, 0.01, 0.3, 0.5, 0.97)):
        mixed = sum(q ** sum(o) * (1 - q) ** (n - sum(o))
                    for o in itertools.product((0, 1), repeat=n) if 0 < sum(o) < n)
        assert allocation.informative_chance(n, q).item() == pytest.approx(mixed, abs=1e-12)


def test_allocation_spends_the_budget_exactly_and_favours_the_reachable():
    """A realistic step: 64 candidates, R = 1,024: the sum is R, every prompt within the bounds, a
    solved prompt (q ~ 1) and an unreachable one (q ~ 1e-9) at the floor, a rare but reachable
    one (1/100) above the uniform share; the result depends on q_hat alone; an infeasible budget
    is refused."""
    q = torch.full((64,), 0.3, dtype=torch.float64)
    q[:3] = torch.tensor([1 - 1e-9, 1e-9, 0.01], dtype=torch.float64)
    n = allocation.allocate(q, 1024, 4, 256)
    assert n.sum().item() == 1024 and n.min() >= 4 and n.max() <= 256
    assert n[0] == 4 and n[1] == 4 and n[2] > 16
    assert torch.equal(n, allocation.allocate(q.clone(), 1024, 4, 256))
    with pytest.raises(ValueError, match="budget"):
        allocation.allocate(q, 64 * 4 - 1, 4, 256)


def test_estimate_counts_decays_and_round_trips():
    """The posterior: the first step's mean reward is the prior; counts decay each step; a seen
    prompt's estimate is (a + s m) / (a + b + s); state_dict / load_state_dict restore it
    exactly."""
    est = allocation.Estimate(5, decay=0.5)
    assert est.q_hat([0, 4]).tolist() == [0.5, 0.5]  # nothing seen: no knowledge
    est.update([1, 2], [torch.tensor([1.0, 1, 0, 0]), torch.tensor([0.0, 0])])  # mean reward 2 / 6
    prior = 2 / 6
    assert est.prior == pytest.approx(prior)
    assert est.seen.tolist() == [False, True, True, False, False]
    assert est.q_hat([1]).item() == pytest.approx((2 + 2 * prior) / (4 + 2))
    assert est.q_hat([0]).item() == pytest.approx(prior)  # unseen: the prior
    est.update([2], [torch.tensor([1.0, 1])])
    assert est.a[1].item() == 1.0 and est.b[1].item() == 1.0  # decayed once
    assert est.a[2].item() == 2.0 and est.b[2].item() == 1.0
    again = allocation.Estimate(5, decay=0.5)
    again.load_state_dict(est.state_dict())
    assert torch.equal(again.q_hat(range(5)), est.q_hat(range(5))) and again.updates == 2
    with pytest.raises(ValueError, match="prompts"):
        allocation.Estimate(6, 0.5).load_state_dict(est.state_dict())


def test_calibration_over_the_seen_prompts():
    est = allocation.Estimate(4, decay=1.0)
    est.update([0, 1], [torch.tensor([1.0, 0]), torch.tensor([0.0, 0, 0, 1])])
    # position 2: never seen; None: not a training prompt; both left out
    m = allocation.calibration(est, [0, 1, 2, None], [-0.5, -1.0, -3.0, -2.0])
    q = est.q_hat([0, 1]).log10()
    assert m["alloc_calib_prompts"] == 2
    error = (q - torch.tensor([-0.5, -1.0], dtype=torch.float64)).abs().mean().item()
    assert m["alloc_calib_abs_log10"] == pytest.approx(error)
    assert m["alloc_calib_corr"] == pytest.approx(1.0)  # two points: their order agrees


# ----------------------------------------------------------------------------
# Groups of unequal N: one advantage path for all (test_brorl.py holds it to each group's
# arithmetic, to the bit); equal sizes give the one-N path's numbers exactly


def test_ragged_advantages_whiten_over_all_tokens():
    """Unequal N: each group centred on its own mean; then whitened over every valid token of the
    batch (a response counted once per token), so the token-weighted advantages sum to 0 and have
    unit (unbiased) variance; group: each group by its own std."""
    g = torch.Generator().manual_seed(2)
    sizes = [2, 7, 3, 16]
    r = [torch.randint(0, 2, (n,), generator=g).float() for n in sizes]
    r[0] = torch.tensor([0.0, 1.0])
    lengths = [torch.randint(1, 9, (n,), generator=g).double() for n in sizes]
    group = torch.arange(len(sizes)).repeat_interleave(torch.tensor(sizes))  # (R,)
    adv = brorl.compute_advantages(torch.cat(r), group, "batch", torch.cat(lengths))  # (R,)
    assert len(adv) == sum(sizes)
    w, a = torch.cat(lengths), adv.double()
    assert (w * a).sum().item() == pytest.approx(0, abs=1e-5)
    var = (w * a * a).sum() / w.sum() * w.sum() / (w.sum() - 1)
    assert var.item() == pytest.approx(1, abs=1e-4)
    centred = torch.cat([x - x.mean() for x in r])
    assert torch.corrcoef(torch.stack([centred.double(), a]))[0, 1] == pytest.approx(1, abs=1e-6)
    grp = brorl.compute_advantages(torch.cat(r), group, "group", torch.cat(lengths))
    assert torch.allclose(grp[group == 1], (r[1] - r[1].mean()) / (r[1].std() + 1e-6))


def test_ragged_micro_batches_equal_equal_sizes(monkeypatch):
    """distributed.micro_batches with per-group sizes: equal sizes give the int's result on every
    rank of K; unequal sizes give each rank the rows of its share() of the groups."""
    gen = torch.Generator().manual_seed(0)
    for K in (1, 2, 3):
        monkeypatch.setenv("WORLD_SIZE", str(K))
        for G, n in ((5, 3), (2, 4), (7, 1)):
            rows = torch.randperm(G * n, generator=gen)
            for r in range(K):
                monkeypatch.setenv("RANK", str(r))
                a = distributed.micro_batches(rows, G, n, 2)
                b = distributed.micro_batches(rows, G, [n] * G, 2)
                assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
        sizes = [3, 1, 4, 2, 5]
        ends = [0, *itertools.accumulate(sizes)]
        rows = torch.randperm(ends[-1], generator=gen)
        for r in range(K):
            monkeypatch.setenv("RANK", str(r))
            share = distributed.share(len(sizes), r)
            held = range(ends[share.start], ends[share.stop])
            got = distributed.micro_batches(rows, len(sizes), sizes, 100)
            mine = torch.cat(got).tolist() if got else []
            assert [x + held.start for x in mine] == [int(x) for x in rows if int(x) in held]


def test_pack_groups_of_unequal_n():
    """pack_groups: rows of groups of 3 and 2 rollouts, each pointing at its prompt; lengths a list
    of per-group tensors; groups of one n keep the (G, n) tensor."""
    def rollouts(prompt, mask):  # one group of len(mask) rollouts, 2 tokens each
        n = len(mask)
        return sampler.Rollouts(prompt_ids=[prompt], tokens=torch.arange(2 * n).view(n, 2),
                              mask=torch.tensor(mask, dtype=torch.bool), logp=-torch.rand(n, 2),
                              entropy=torch.rand(n, 2), truncated=torch.zeros(n, dtype=torch.bool),
                              texts=[""] * n, n=n)
    ro3, ro2 = rollouts([1, 2], [[1, 1], [1, 0], [1, 1]]), rollouts([3], [[1, 1], [1, 1]])
    batch = step.pack_groups([ro3, ro2])
    assert batch.group.tolist() == [0, 0, 0, 1, 1]
    assert [x.tolist() for x in batch.lengths] == [[2.0, 1.0, 2.0], [2.0, 2.0]]
    assert step.pack_groups([ro3, ro3]).lengths.shape == (2, 3)


def test_step_metrics_of_unequal_groups_and_of_one_n():
    """step_metrics: groups of one N by hand (reward over rollouts, pass@N and zero_adv_frac over
    groups); unequal groups: rewards over rollouts, pass@N and zero_adv_frac over groups."""
    r = torch.tensor([[1.0, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    counts = dict(groups_survived=1, groups_generated=3, groups_kept=1, rounds=1, tokens=24)
    one = steplog.step_metrics(StepStats(**counts, rewards=list(r)), 1.0, 1.0, {})
    assert one["samples"] == 12 and one["reward_mean"] == 6 / 12 and one["resp_len"] == 2
    assert one["pass@N"] == pytest.approx(2 / 3) == one["zero_adv_frac"]  # (float32 means)
    assert one["keep_rate"] == 1 / 3
    assert not any(k.startswith(("alloc", "sampled")) for k in one)  # None: not logged
    ragged = steplog.step_metrics(StepStats(**counts, rewards=[torch.tensor([1.0, 0]),
                                                                torch.zeros(6)]), 1.0, 1.0, {})
    assert ragged["samples"] == 8 and ragged["reward_mean"] == 1 / 8
    assert ragged["pass@N"] == 0.5 and ragged["zero_adv_frac"] == 0.5


# ----------------------------------------------------------------------------
# Whole runs: the budget, --resume, the uniform rule


# R = 33 over B = 2 unseen prompts: 17 and 16, so every step holds groups of unequal N
ADAPTIVE = ["--alloc", "adaptive", "--rollout_budget", "33", "--min_rollouts", "3",
            "--max_rollouts", "24", "--sample_groups", "2"]


@pytest.mark.slow
def test_adaptive_run_spends_the_budget_and_resumes_exactly(tmp_path, monkeypatch):
    """An adaptive run: every step draws exactly R rollouts, in [min, max] per prompt, and trains
    groups of unequal N (the ragged advantages run); 4 steps == 2 steps, then --resume to 4,
    metrics and weights to the bit (the estimate is in the checkpoint)."""
    seen = []
    advantages = brorl.compute_advantages
    monkeypatch.setattr(brorl, "compute_advantages", lambda r, group, *a: seen.append(
        torch.bincount(group).tolist()) or advantages(r, group, *a))
    a, b = tmp_path / "a", tmp_path / "b"
    common = ["--eval_every", "2", "--device", "cpu", *SMALL, *ADAPTIVE]
    rows_a = brorl.train(brorl.parse_config(["--steps", "4", "--out", str(a), *common]))
    steps = [r for r in rows_a if r["step"] > 0]
    assert all(r["samples"] == 33 for r in steps)  # the budget, exactly
    assert all(3 <= r["alloc_n_min"] <= r["alloc_n_max"] <= 24 for r in steps)
    assert seen and any(len(set(s)) > 1 for s in seen)  # groups of unequal N were trained
    brorl.train(brorl.parse_config(["--steps", "2", "--out", str(b), *common]))
    assert "estimate" in torch.load(b / "ckpt" / "trainer_state.pt", weights_only=True)
    rows_b = brorl.train(brorl.parse_config(["--resume", str(b), "--steps", "4"]))
    timing = lambda k: k.startswith("time") or k == "tokens_per_s"
    strip = lambda r: {k: v for k, v in r.items() if not timing(k)}
    assert [strip(r) for r in rows_b] == [strip(r) for r in rows_a]
    from safetensors.torch import load_file
    wa, wb = (load_file(x / "ckpt" / "model.safetensors") for x in (a, b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    records = [json.loads(x) for x in (a / "samples.jsonl").read_text().splitlines()]
    assert any(x["kind"] == "train" for x in records)  # samples.jsonl of unequal groups


@pytest.mark.slow
def test_uniform_rule_never_touches_the_allocation(tmp_path, monkeypatch):
    """--alloc uniform (the default): no estimate is made, sampled with, or saved; no allocation key
    is logged; the step's metrics are step_metrics' of the one-N path."""
    def never(*a, **k):
        raise AssertionError("the allocation ran under --alloc uniform")
    monkeypatch.setattr(allocation, "sample_allocated_groups", never)
    monkeypatch.setattr(allocation, "Estimate", never)
    rows = brorl.train(brorl.parse_config(["--steps", "2", "--eval_every", "2", "--out",
                                           str(tmp_path / "u"), "--device", "cpu", *SMALL]))
    assert brorl.Config().alloc == "uniform"
    keys = {k for r in rows for k in r}
    assert not any(k.startswith(("alloc", "informative", "rollouts_dropped")) for k in keys)
    state = torch.load(tmp_path / "u" / "ckpt" / "trainer_state.pt", weights_only=True)
    assert "estimate" not in state


@pytest.mark.parametrize("flags, word", [
    (["--alloc", "greedy"], "--alloc"),
    (["--alloc", "adaptive", "--min_rollouts", "1"], "--min_rollouts"),
    (["--alloc", "adaptive", "--rollout_budget", "5", "--min_rollouts", "4"], "--rollout_budget"),
    (["--alloc", "adaptive", "--rollout_budget", "5000", "--max_rollouts", "8"],
     "--rollout_budget"),
    (["--alloc_decay", "0"], "--alloc_decay"),
])
def test_bad_allocation_flags_fail_with_one_line(flags, word, capsys):
    with pytest.raises(SystemExit):
        brorl.parse_config(flags)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert word in err


@pytest.mark.slow
def test_two_processes_equal_one_under_adaptive(tmp_path):
    """torchrun (gloo, CPU), K = 2 against one process, --alloc adaptive with groups of unequal N
    (R = 26 over B = 4: 7, 7, 6, 6; --train_rollouts 6: min(m, n) of each): the same allocations,
    rollouts and kept groups exactly; the update's numbers and the weights up to float summation
    order (test_distributed's bound: the ranks sum their gradients in another order)."""
    from test_distributed import TINY, finish, metrics, rel_diff, start, weights
    flags = [*TINY, "--prompts_per_step", "4", *ADAPTIVE, "--rollout_budget", "26",
             "--train_rollouts", "6"]
    one, two = tmp_path / "one", tmp_path / "two"
    runs = [start(tmp_path, one, flags, procs=0),
            start(tmp_path, two, [*flags, "--max_rows", "4"], procs=2)]
    for p in runs:
        code, out = finish(p)
        assert code == 0, out[-3000:]
    m1, m2 = metrics(one), metrics(two)
    assert len(m1) == len(m2) == 4
    assert any(r.get("alloc_n_min", 0) != r.get("alloc_n_max", 0) for r in m1)  # unequal N
    exact = ("reward_mean", "keep_rate", "groups_kept", "samples", "zero_adv_frac", "pass@N",
             "resp_len", "alloc_n_min", "alloc_n_median", "alloc_n_max", "informative_per_1k",
             "rollouts_dropped", "reward_kept", "reward_trained")
    for a, b in zip(m1, m2):  # the same candidates, allocations, rollouts and kept groups: exactly
        assert all(a.get(k) == b.get(k) for k in exact), a["step"]
        for k in ("entropy", "clip_frac", "grad_norm"):  # up to summation order (test_distributed)
            assert a.get(k, 0) == pytest.approx(b.get(k, 0), rel=1e-4, abs=1e-6)
    assert rel_diff(weights(one), weights(two)) <= 1e-4


def test_planner_plans_min_rows_and_keeps_the_cheapest_small_option():
    """The sampler decodes at least sampler.MIN_ROWS rows, its prompts padded to PAD_TO tokens: a
    plan of fewer rows costs MIN_ROWS rows, and fit_rows still offers the largest option below
    MIN_ROWS (N = 12: 12 rows, which decode 16), cheaper than the next one up (24 rows)."""
    import dataclasses
    from lib import planner
    from transformers import Qwen2Config
    mc = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    cfg = brorl.Config(n_rollouts=12, max_rows=30)
    peak = lambda rows: planner.peaks(planner.plan(mc, dataclasses.replace(cfg, max_rows=rows),
                                                   8))["rollout"]
    assert peak(1) == peak(12) == peak(sampler.MIN_ROWS) < peak(24)
    assert planner.fit_rows(mc, cfg, 8, (peak(12) + peak(24)) / 2) == 12
    assert planner.fit_rows(mc, cfg, 8, peak(12) - 1) is None


def test_planner_plans_adaptive_with_its_ceiling():
    """--alloc adaptive: the planner's training chunk and update hold up to --max_rollouts rows a
    prompt and R rows in all, not N a prompt: with N = 512 (the default) and a ceiling of 8, both
    shrink; with a ceiling of N they are uniform N's but for R's cap."""
    from lib import planner
    from transformers import Qwen2Config
    mc = Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=300)
    item = lambda cfg, phase, name: dict(planner.plan(mc, cfg, 16)[phase])[name]
    rows = lambda cfg: item(cfg, "update", "step's (rows, T) tensors")
    kv = lambda cfg: item(cfg, "rollout", "sampling buffers (rows, V)")
    uniform = brorl.Config(n_rollouts=16, prompts_per_step=4, eval_samples=1, eval_prompts=1)
    capped = dict(alloc="adaptive", rollout_budget=32, min_rollouts=4, max_rollouts=8)
    adaptive = brorl.Config(n_rollouts=512, prompts_per_step=4, eval_samples=1, eval_prompts=1,
                            **capped)
    assert planner.most_rollouts(adaptive) == 8 and planner.most_rollouts(uniform) == 16
    assert rows(adaptive) == rows(uniform) // 2  # 4 groups of <= 8 rows, against 4 of 16
    assert kv(adaptive) == kv(uniform) // 8  # one call of R = 32 rows, against a round of 4B x 16
    wide = brorl.Config(n_rollouts=16, prompts_per_step=4, eval_samples=1,
                        **{**capped, "rollout_budget": 48, "max_rollouts": 16})
    assert rows(wide) == 48 * rows(uniform) // 64  # R = 48 caps the update's 4 x 16 rows


def test_allocation_study_refuses_bad_flags_and_its_control_gives_every_candidate_16(capsys):
    """tools/allocation_study.py: a budget that is not a finite positive number of CPU seconds,
    no job at once, repeated seeds: one line each, before any run. Its control arm N=16-one-round
    is --alloc adaptive with every candidate's n fixed at 16: whatever the estimates, 32 x 16 =
    512 rollouts, the adaptive arm's budget."""
    from tools import allocation_study as study
    for argv, word in ((["--budget", "inf"], "--budget"), (["--budget", "0"], "--budget"),
                       (["--jobs", "0"], "--jobs"), (["--seeds", "1", "1"], "--seeds")):
        with pytest.raises(SystemExit):
            study.main(argv)
        assert word in capsys.readouterr().err.strip().splitlines()[-1]
    adaptive, control = (brorl.parse_config([*study.ARMS[a]]) for a in ("adaptive",
                                                                         "N=16-one-round"))
    assert control.rollout_budget == adaptive.rollout_budget == 512
    q = torch.rand(32, generator=torch.Generator().manual_seed(0), dtype=torch.float64) ** 4
    n = allocation.allocate(q, control.rollout_budget, control.min_rollouts, control.max_rollouts)
    assert n.tolist() == [16] * 32
    assert len(set(allocation.allocate(q, 512, adaptive.min_rollouts,
                                       adaptive.max_rollouts).tolist())) > 1


def test_allocation_study_compares_at_equal_rollouts_by_hand(tmp_path):
    """tools/allocation_study.equal_rollouts on hand-made runs: adaptive and its control measured
    at the last step every run of the two evaluated (here 2: adaptive's second seed stopped
    there), 512 rollouts a step; N=16's mean exact Q interpolated linearly at those rollouts
    between its evaluations; an arm that never drew that many is left out; a run without a
    step-0 evaluation is refused."""
    from tools import allocation_study as study

    def write(arm, seed, rows):
        path = tmp_path / "keys" / arm / f"seed{seed}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    ev = lambda step, q, cpu, samples: {"step": step, "samples": samples, "mass_exact_mean": q,
                                        "time_train_cpu": cpu}
    plain = lambda step, samples: {"step": step, "samples": samples}
    write("adaptive", 0, [ev(0, 0.1, 0, 0), plain(1, 512), ev(2, 0.3, 4, 512), ev(3, 0.5, 6, 512)])
    write("adaptive", 1, [ev(0, 0.2, 0, 0), plain(1, 512), ev(2, 0.6, 5, 512)])
    write("N=16-one-round", 0, [ev(0, 0.1, 0, 0), plain(1, 512), ev(2, 0.2, 3, 512)])
    write("N=16-one-round", 1, [ev(0, 0.1, 0, 0), plain(1, 512), ev(2, 0.3, 5, 512),
                                ev(3, 0.4, 7, 512)])
    # N=16: 1,024 rollouts lie a quarter of the way from 800 (Q 0.3) to 1,696 rollouts (Q 0.5).
    write("N=16", 0, [ev(0, 0.1, 0, 0), ev(1, 0.3, 2, 800), ev(2, 0.5, 4, 896)])
    write("N=16", 1, [ev(0, 0.0, 0, 0), ev(1, 0.2, 2, 1024)])
    write("N=512", 0, [ev(0, 0.1, 0, 0), ev(1, 0.2, 2, 1000)])  # never reaches 1,024
    text = study.equal_rollouts(tmp_path)
    assert "at 1,024 rollouts (step 2 of adaptive and its control)" in text
    row = {line.split(" | ")[0][2:]: line.split(" | ") for line in text.splitlines()
           if line.startswith("| ") and " reach it " in line}
    assert row["adaptive"][1:4] == ["2 of 2 reach it", "0.3 (0.141)", "4.5"]
    assert row["N=16-one-round"][1:4] == ["2 of 2 reach it", "0.15 (0.0707)", "4.0"]
    n16 = [0.3 + 0.2 * (1024 - 800) / 896 - 0.1, 0.2]
    mean, sd = statistics.mean(n16), statistics.stdev(n16)
    assert row["N=16"][1:4] == ["2 of 2 reach it", f"{mean:.3g} ({sd:.3g})", "-"]
    assert row["N=512"][1:3] == ["0 of 1 reach it", "-"]
    assert row["adaptive"][4] == "measured at step S |" and row["N=16"][4] == "interpolated |"
    # The control's step-100 comparison with N=16: the report tests it too.
    assert "| N=16-one-round | N=16 | " in text
    # A run with no evaluation at step 0 has no start to measure from: one line, no table.
    write("N=16", 1, [plain(1, 512), ev(2, 0.2, 2, 1024)])
    with pytest.raises(SystemExit):
        study.equal_rollouts(tmp_path)
