"""
mass.py: the exact correct mass of a prompt. Theorem 1 and Lemma 2 (docs/paper.md §3) are about
Q_pos, the correct mass of one softmax over free logits; a language model's per-prompt Q(x), the
probability the policy gives its correct answers, is read by analogy to it. The probe
(lib/diagnostics.probe_mass) samples Q(x) (the probe's Q), which cannot see a mass below
1/probe_samples; this module computes it (the exact Q). Where a task lists its right answers (its
entry's right_answers, data.TASKS: on the arith task and on keys the digits of the gold, then EOS;
on sets each of its right values), Q(x) is exact: the product of a sequence's tempered token
probabilities (summed over a prompt's right answers), teacher-forced, from one forward through the
log-prob path the update uses (lib/logprobs.py's response_logprobs, the log-prob kernel). It is a
lower bound on the verifier's accepted mass: the integer rule also takes " 579" or "0579", strings
no warm start ever wrote.

Zones, for a policy that samples N rollouts of a prompt (gate_small_n = 16, ProRL's N;
gate_large_n = 512, BroRL's): Q >= 1/16 "high" (N = 16 sees the right answer about once a group
or more); 1/512 <= Q < 1/16 "gate" (N = 512 sees it, N = 16 mostly not: where breadth can act);
below, "low" (neither: an update moves its mass only through the unsampled coupling). Logged at
every eval: mean Q, median log10 Q, the count per zone, and every prompt's log10 Q
(mass_exact_log10, in the set's fixed order) so zone migration between any two evals can be
recomputed from metrics.jsonl.
"""

import math

import torch

import data
from lib.errors import fail
from lib.logprobs import response_logprobs
from lib.step import Batch
from sampler import encode_prompt


def measured_task(cfg) -> data.Task:
    """The entry (data.TASKS) of the task whose prompts the exact Q measures: --eval_task's where
    the eval set is measured (--mass_prompts 0) and named by one, else --task's."""
    return data.task_of(cfg.eval_task if cfg.eval_task and cfg.mass_prompts == 0 else cfg.task)


def prompt_set(cfg, eval_set, train_set=None) -> list:
    """The prompts whose exact Q is logged: the eval set (--mass_prompts 0), or --mass_prompts
    training prompts drawn by --eval_seed alone (the same problems for every --seed, so runs pair
    prompt by prompt), under --train_prompts the first of those trained (train_set); none unless
    the training task and the measured one (measured_task) list their right answers."""
    if not (data.task_of(cfg.task).right_answers and measured_task(cfg).right_answers):
        return []  # (e.g. --eval_task math:..., whose rows have no exact Q)
    try:
        # The keys task has 512 prompts at most.
        rows = (eval_set if cfg.mass_prompts == 0 else
                train_set[: cfg.mass_prompts] if cfg.train_prompts and train_set else
                data.load_task(cfg.task, "train", n=cfg.mass_prompts, seed=cfg.eval_seed,
                               digits=cfg.digits))
    except ValueError as e:  # more than an arith split holds (few digits)
        fail(f"--mass_prompts {cfg.mass_prompts}: {e}")
    return rows


def ids_batch(prompts: list, responses: list, dev, group=None) -> Batch:
    """The update's Batch (lib/step.pack_groups') from token id lists: prompts left-padded
    to P, responses right-padded to T (at least 2 columns: response_logprobs' calls), and group
    (R,), the prompt each response answers (default: response i answers prompt i)."""
    G, R = len(prompts), len(responses)
    P, T = max(map(len, prompts)), max(2, max(map(len, responses)))
    # (G, P) each.
    prompt, prompt_mask = torch.zeros(G, P, dtype=torch.long), torch.zeros(G, P, dtype=torch.bool)
    # (R, T) each.
    resp, resp_mask = torch.zeros(R, T, dtype=torch.long), torch.zeros(R, T, dtype=torch.bool)
    for i, p in enumerate(prompts):
        prompt[i, P - len(p):], prompt_mask[i, P - len(p):] = torch.tensor(p), True
    for i, a in enumerate(responses):
        resp[i, :len(a)], resp_mask[i, :len(a)] = torch.tensor(a), True
    group = torch.arange(G) if group is None else torch.as_tensor(group)  # (R,)
    return Batch(prompt.to(dev), prompt_mask.to(dev), resp.to(dev), resp_mask.to(dev),
                 group.to(dev), sampler_logp=torch.zeros(R, T, device=dev))


@torch.no_grad()
def sequence_log_mass(model, prompts: list, responses: list, temperature: float,
                      chunk: int = 512) -> torch.Tensor:
    """log P(response | prompt) (P,) float64 for token id lists, at `temperature`: the tempered
    log-probs of the update's path (float32 per token, as training's), summed in float64 (Q may be
    1e-20)."""
    dev = next(model.parameters()).device
    out = []
    for i in range(0, len(prompts), chunk):
        batch = ids_batch(prompts[i: i + chunk], responses[i: i + chunk], dev)
        logp = response_logprobs(model, batch, torch.arange(len(batch.group), device=dev),
                                 temperature)  # (p, T)
        out.append((logp.double() * batch.resp_mask).sum(1).cpu())  # (p,)
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def exact_log_mass(model, tok, examples, right_answers, temperature: float,
                   system_prompt: str = "") -> torch.Tensor:
    """log Q(x) (P,) float64: the log-probability of each of an example's right answers' tokens
    (right_answers(example), its task's: data.Task), then EOS, summed over them (the gold alone on
    arith, as on the keys task; each of its right values on sets)."""
    prompts = [encode_prompt(tok, x["prompt"], system_prompt) for x in examples]
    values = [right_answers(x) for x in examples]
    rows = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            for v in values for a in v]
    if all(len(v) == 1 for v in values):  # one right answer each: its log-probability
        return sequence_log_mass(model, prompts, rows, temperature)  # (P,)
    owner = torch.tensor([i for i, v in enumerate(values) for _ in v])  # (rows,) its example
    logp = sequence_log_mass(model, [prompts[i] for i in owner.tolist()], rows,
                             temperature)  # (rows,)
    return torch.stack([torch.logsumexp(logp[owner == i], 0) for i in range(len(examples))])


def zone(log10_q: float, small_n: int, large_n: int) -> str:
    """A prompt's zone from its log10 Q (as metrics.jsonl keeps it): "high" (Q >= 1/small_n),
    "gate" (1/large_n <= Q < 1/small_n) or "low" (Q < 1/large_n). The one definition: the eval's
    counts, the sweeps' zone migration (tools/ablate.py) and the study's branch point
    (tools/breadth_study.py)."""
    return ("high" if log10_q >= -math.log10(small_n)
            else "gate" if log10_q >= -math.log10(large_n) else "low")


def zone_counts(log_q: torch.Tensor, small_n: int, large_n: int) -> dict:
    """Prompts per zone, from log Q (P,) (natural log, as exact_log_mass gives it)."""
    zones = [zone(x, small_n, large_n) for x in (log_q / math.log(10)).tolist()]
    return {z: zones.count(z) for z in ("high", "gate", "low")}


def exact_mass(model, tok, examples, cfg) -> dict:
    """The eval's exact-mass metrics of `examples` (prompt_set) at the training temperature; {} if
    none."""
    if not examples:
        return {}
    log_q = exact_log_mass(model, tok, examples, measured_task(cfg).right_answers,
                           cfg.temperature, cfg.system_prompt)  # (P,)
    zones = zone_counts(log_q, cfg.gate_small_n, cfg.gate_large_n)
    return {"mass_exact_mean": log_q.exp().mean().item(),
            "mass_exact_log10_median": torch.quantile(log_q, 0.5).item() / math.log(10),
            **{f"mass_exact_{k}": v for k, v in zones.items()},
            # Every prompt's log10 Q, in the set's fixed order.
            "mass_exact_log10": [round(x / math.log(10), 4) for x in log_q.tolist()]}
