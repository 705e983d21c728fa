"""
answers.py: the whole answer distribution of a prompt, exact, where the answer space is small enough
to enumerate (the sets task, data.py: every value 100..999). Each answer's probability is its tokens
then EOS, teacher-forced at the training temperature through the update's own log-prob path
(lib/logprobs.py's response_logprobs: the prompt run once, its A answers against its keys/values),
summed in float64. What no answer of the space holds (a 2-digit string, a letter, no EOS) is the
mass outside.

At every eval (--answer_prompts n, the first n prompts of the eval set, a fixed order) the measures
of the paper's Figure 3, for a transformer instead of one softmax over free logits, per prompt and
averaged: Q (the right answers' mass), the share of its right answers whose probability rose since
the first eval, the worst drop of a right answer's probability since then; also the entropy over
answers (the outside mass one outcome) and the exact pass@k(x) = 1 - (1 - Q(x))^k for k up to 1024
(docs/paper.md section 3), averaged. Every eval's whole distribution is saved (answers/step-*.pt in
the run directory), so that any two evals compare on any measure.
"""

from pathlib import Path

import torch

import data
from lib.errors import fail
from lib.mass import ids_batch
from lib.logprobs import response_logprobs
from lib.rundir import replace_atomic
from sampler import encode_prompt

PASS_K = [2 ** i for i in range(11)]  # 1 ... 1024


def space(task: str) -> list:
    """Every answer of a task whose answer space is enumerable (its answer_space, data.TASKS), as
    strings; [] for any other task."""
    enumerate_answers = data.task_of(task).answer_space
    return enumerate_answers() if enumerate_answers else []


def right_mask(examples, answers: list) -> torch.Tensor:
    """(P, A) bool: which answers of the space each example's gold (comma-separated values)
    accepts."""
    index = {a: i for i, a in enumerate(answers)}
    mask = torch.zeros(len(examples), len(answers), dtype=torch.bool)
    for row, x in enumerate(examples):
        mask[row, [index[v] for v in x["answer"].split(",")]] = True
    return mask


@torch.no_grad()
def distribution(model, tok, examples, answers: list, temperature: float, system_prompt: str = "",
                 rows_per_pass: int = 8192) -> torch.Tensor:
    """log p(answer | prompt) (P, A) float64 for every answer of the space, at `temperature`: the
    tempered log-probs of the update's path (float32 per token, as training's), summed in
    float64."""
    dev = next(model.parameters()).device
    resp_ids = [tok(a, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for a in answers]
    A = len(answers)
    prompts = [encode_prompt(tok, x["prompt"], system_prompt) for x in examples]
    out, chunk = [], max(1, rows_per_pass // A)  # prompts a pass
    for i in range(0, len(prompts), chunk):
        part = prompts[i: i + chunk]
        g = len(part)
        # Every answer of each prompt of the pass: (g*A,) rows, row r answering prompt r // A.
        batch = ids_batch(part, resp_ids * g, dev, group=torch.arange(g).repeat_interleave(A))
        logp = response_logprobs(model, batch, torch.arange(g * A, device=dev), temperature)
        out.append((logp.double() * batch.resp_mask).sum(1).view(g, A).cpu())  # (g, A)
    return torch.cat(out) if out else torch.zeros(0, A, dtype=torch.float64)


def measures(logp: torch.Tensor, right: torch.Tensor, first: torch.Tensor = None) -> dict:
    """Per prompt (P,) from log p (P, A) and the right answers (P, A): Q, the mass outside the
    space, the entropy over answers in nats (the outside mass one outcome), and against `first`
    (the first eval's log p, same prompts): the share of right answers whose probability rose and
    the worst drop of a right answer's probability (0 if none fell)."""
    p = logp.exp()  # (P, A)
    outside = (1 - p.sum(1)).clamp(min=0)  # (P,)
    plogp = torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(1)  # (P,)
    m = dict(q=(p * right).sum(1), outside=outside,
             entropy=-(plogp + torch.where(outside > 0, outside * outside.log(), 0 * outside)))
    if first is not None:
        p0 = first.exp()
        rose = ((p > p0) & right).sum(1).double() / right.sum(1).clamp(min=1)  # (P,)
        drop = torch.where(right, p0 - p, torch.zeros_like(p)).max(1).values.clamp(min=0)  # (P,)
        m.update(right_rose=rose, right_worst_drop=drop)
    return m


def pass_at_k(q: torch.Tensor, k: int) -> torch.Tensor:
    """Exact pass@k(x) = 1 - (1 - Q(x))^k (P,), computed as -expm1(k log1p(-Q)): exact near
    Q = 0."""
    return -torch.expm1(k * torch.log1p(-q.clamp(max=1)))


def eval_metrics(logp: torch.Tensor, right: torch.Tensor, first: torch.Tensor = None) -> dict:
    """The eval's metrics: each measure averaged (answers_*) and per prompt (answers_*_per_prompt,
    in the set's fixed order), and the exact pass@k averaged."""
    m = measures(logp, right, first)
    out = {f"answers_{k}": v.mean().item() for k, v in m.items()}
    out["answers_worst_drop_max"] = m["right_worst_drop"].max().item() if first is not None else 0.0
    out.update({f"answers_pass@{k}": pass_at_k(m["q"], k).mean().item() for k in PASS_K})
    # log10 Q per prompt; a Q that underflowed to 0 is written as -324 (JSON has no -Infinity)
    log10_q = m["q"].log10().clamp(min=-324)  # (P,)
    out["answers_log10_q_per_prompt"] = [round(x, 4) for x in log10_q.tolist()]
    for k in ("right_rose", "right_worst_drop", "entropy"):
        if k in m:
            out[f"answers_{k}_per_prompt"] = [float(f"{x:.4g}") for x in m[k].tolist()]
    return out


def save(out_dir, step: int, logp: torch.Tensor, examples) -> None:
    """An eval's whole distribution to <out>/answers/step-<step>.pt: {"prompts": the P prompts,
    "logp": log p (P, A) float64 (as compared), the answers in the order of space()}."""
    folder = Path(out_dir) / "answers"
    folder.mkdir(exist_ok=True)
    saved = {"prompts": [x["prompt"] for x in examples], "logp": logp}
    replace_atomic(folder / f"step-{step:06d}.pt", lambda tmp: torch.save(saved, tmp))


def load_first(out_dir, examples, answers: list) -> torch.Tensor:
    """The first eval's distribution (P, A), a resumed run's reference: answers/step-000000.pt, for
    the same prompts and answers. Missing or unreadable, it stops with one line: the current eval
    would silently become the reference."""
    path = Path(out_dir) / "answers" / f"step-{0:06d}.pt"
    why = "missing" if not path.is_file() else ""
    try:
        saved = {} if why else torch.load(path, weights_only=True)
        logp, prompts = saved.get("logp"), saved.get("prompts")
    except Exception as e:  # a cut-short zip, a pickle error, a directory in its place
        why = f"unreadable: {(str(e).splitlines() or [type(e).__name__])[0][:100]}"
    if not why and not (torch.is_tensor(logp) and logp.shape == (len(examples), len(answers))
                        and prompts == [x["prompt"] for x in examples]):
        why = "not the distribution of this run's --answer_prompts prompts"
    if why:
        fail(f"--resume {out_dir}: {path} is {why}; it is the first eval's answer distribution "
             "that answers_right_rose and answers_worst_drop compare with (restore it, or start "
             "the run over in another --out)")
    return logp
