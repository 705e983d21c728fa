"""
diagnostics.py: what each evaluation measures beyond pass@k, the correct mass that BroRL's theory
is about (docs/paper.md §3). brorl.train calls Diagnostics.measure right after brorl.evaluate, on
the same random stream, and logs its metrics in the same row:
  - the probe's Q (probe_mass): each probe prompt's correct mass Q(x), estimated by the pass rate
    of --probe_samples rollouts at --temperature, and the shares of prompts whose Q rose or fell
    since step 0;
  - the exact Q (lib/mass.py): Q(x) computed, not sampled, where the right answer is one token
    sequence (the arith, keys and sets tasks), with its zones;
  - with --alloc adaptive, the estimate's calibration against the exact Q (lib/allocation.py);
  - with --answer_prompts (sets task), every answer's probability and Figure 3's measures
    (lib/answers.py).
The probe samples through lib/step.sample_share, as brorl.evaluate does.
And what a training step records beside its update when an instrument asks (brorl.train hooks
these in only then): the mass balance (lib/balance.py: watch_sampling before the update,
step_records after it) and samples.jsonl's training responses (lib/samples.py).
"""

import torch

from lib import allocation, answers, balance, distributed, mass, samples
from lib.errors import fail
from lib.rundir import writes_are_one_line
from lib.step import Group, SampleStep, StepStats, sample_share
from sampler import draw_seeds


def probe_mass(model, tok, probe, cfg, gen, start=None) -> tuple:
    """Correct mass Q(x) of each probe prompt, estimated by the pass rate of --probe_samples
    rollouts at the training temperature (not N, so that runs with different N are measured
    alike). Per prompt, it is an analogy to Theorem 1's Q_pos; pass@k(x) = 1 - (1 - Q(x))^k rises
    with it (docs/paper.md §3). Returns Q (P,) and the metrics,
    with the shares of prompts whose Q rose or fell since `start` (Q at step 0) when given."""
    seeds = draw_seeds(gen, len(probe))
    # Each prompt's pass rate over its samples. (P,)
    q = sample_share(model, tok, probe, cfg.probe_samples, cfg.temperature, cfg.top_p, cfg,
                     seeds)[2].mean(1)
    m = {"mass_mean": q.mean().item()}
    if start is not None:
        delta = q - start  # (P,)
        m.update(mass_rose=(delta > 0).float().mean().item(),
                 mass_fell=(delta < 0).float().mean().item(),
                 mass_worst_drop=max(0.0, -delta.min().item()))
    return q, m


def first_references(cfg, run_dir, eval_set, state: dict):
    """--resume: what the measures compare with the run's first eval, checked before any write:
    the probe's step-0 Q (the checkpoint's q_start, (probe_prompts,)) and, with --answer_prompts,
    the first answer distribution (answers/step-000000.pt), which this returns. Either missing or
    unreadable stops with one line."""
    q = state.get("q_start")
    if not (torch.is_tensor(q) and q.shape == (min(cfg.probe_prompts, len(eval_set)),)):
        fail(f"--resume {run_dir}: its checkpoint's step-0 probe Q (trainer_state.pt's q_start) is "
             f"{'missing' if q is None else 'not one value per probe prompt'}; mass_rose, "
             "mass_fell and mass_worst_drop compare with it (start the run over in another --out)")
    space = answers.space(cfg.task)
    return (answers.load_first(run_dir, eval_set[: cfg.answer_prompts], space)
            if cfg.answer_prompts and space else None)


class Diagnostics:
    """The prompts each diagnostic follows, fixed for the whole run, and what it carries between
    evaluations (the first answer distribution). estimate: --alloc adaptive's, or None."""

    def __init__(self, cfg, run, estimate=None):
        self.cfg, self.out, self.estimate, self.kept = cfg, run.out, estimate, run.kept
        # The probe's prompts, and those whose exact Q is computed (the latter also followed by
        # --mass_balance when a step does not train them).
        self.probe, self.exact_set = run.eval_set[: cfg.probe_prompts], mass.prompt_set(
            cfg, run.eval_set, run.train_set)
        # Each training prompt's position: where the estimate keeps an eval prompt's Q.
        self.position = {x["prompt"]: i for i, x in enumerate(run.train_set)}
        # The sets task's answer distributions: their prompts, each prompt's right answers, and
        # the first evaluation's distribution (from disk when a run resumes: first_references).
        self.answer_set, self.space = run.eval_set[: cfg.answer_prompts], answers.space(cfg.task)
        self.right = answers.right_mask(self.answer_set, self.space)
        self.first = run.first_answers

    def measure(self, model, tok, gen, step, q_start=None) -> tuple:
        """This evaluation's diagnostics of model: their metrics, and the probe's Q (P,). gen is
        the evaluation's random stream, after brorl.evaluate."""
        cfg = self.cfg
        q, m = probe_mass(model, tok, self.probe, cfg, gen, start=q_start)
        # The exact Q and its zones (lib/mass.py).
        m.update(mass.exact_mass(model, tok, self.exact_set, cfg))
        if step == 0 and self.exact_set:
            # Whose exact Q each position of mass_exact_log10 holds, written once.
            m["mass_exact_prompts"] = [x["prompt"] for x in self.exact_set]
        if self.estimate is not None and "mass_exact_log10" in m:
            # The allocation's estimate of Q against the exact Q.
            positions = [self.position.get(x["prompt"]) for x in self.exact_set]
            m.update(allocation.calibration(self.estimate, positions, m["mass_exact_log10"]))
        if self.answer_set:
            # Every answer's probability and Figure 3's measures (lib/answers.py). (P, A)
            logp = answers.distribution(model, tok, self.answer_set, self.space,
                                        cfg.temperature, cfg.system_prompt)
            self.first = logp if self.first is None else self.first
            m.update(answers.eval_metrics(logp, self.right, self.first))
            if distributed.is_main():  # before the step's row: a failure here stops the run
                with writes_are_one_line(self.out, f"answers/step-{step:06d}.pt and step {step}'s "
                                                   f"row were not written; {self.kept}"):
                    answers.save(self.out, step, logp, self.answer_set)
        return m, q


# ----------------------------------------------------------------------------
# What a training step records beside its update


def watch_sampling(sample: SampleStep, cfg, followed: list) -> SampleStep:
    """--mass_balance: a step's sampling phase that on its steps also takes the kept groups'
    answer distributions before any update (a balance.Snapshot, the StepStats' balance_before),
    for step_records to compare with after it. followed: the prompts whose Q is followed when not
    trained."""

    def sample_and_snapshot(model, tok, cfg, train_set, rng, step, keep_est):
        kept, stats = sample(model, tok, cfg, train_set, rng, step, keep_est)
        if kept and step % cfg.mass_balance == 0:
            with torch.autocast(model.device.type, enabled=False):  # as after it: no autocast
                stats.balance_before = balance.Snapshot(model, tok, cfg, kept, followed)
        return kept, stats
    return sample_and_snapshot


def step_records(model, tok, cfg, kept: list[Group], chosen: list, adv: torch.Tensor,
                 stats: StepStats) -> dict:
    """With --mass_balance or --sample_groups (brorl.train hands it to rl_step only then), after a
    step's update, of model (the updated policy): on --mass_balance's steps, each trained group's
    mass balance (lib/balance.py, against watch_sampling's snapshot); with --sample_groups, the
    first groups' trained responses with their advantages (samples.jsonl's, not metrics.jsonl's).
    kept: the step's Groups; chosen: each one's trained rollouts (G tensors (m_j,)); adv (R,) the
    trained rows' advantages, group-major."""
    m = {}
    if stats.balance_before is not None:  # The four parts' mass, Theorem 1's terms, the others' Q.
        model.eval()
        before = stats.balance_before
        after = balance.Snapshot(model, tok, cfg, kept, before.followed)
        m.update(balance.records(before, after, kept, chosen))
    if cfg.sample_groups:  # the same on every rank: all call group_records' collective, or none
        advs = list(adv.split([len(c) for c in chosen]))  # G tensors (m_j,)
        m["train_responses"] = samples.group_records(kept, chosen, advs, tok, cfg)
    return m
