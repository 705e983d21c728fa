"""
samples.py: samples.jsonl, what the model writes. At every evaluation, the first
--sample_responses of the responses sampled for each of the first --sample_prompts held-out prompts
(the evaluation's own, at T = 0.6: nothing more is sampled); with --sample_groups G, each step's
first G training groups, the same number of their responses each, with their advantages. One JSON
object a line:
  {"step", "kind": "eval" or "train", "prompt", "answer" (eval: the reference), "response",
   "reward", "length" (tokens), "truncated", "advantage" (train)}
Bounded whatever the run's length: a response longer than RESPONSE_CHARS keeps its head and its
tail (where the answer is), and each kind keeps at most MAX_STEPS steps: past that, every other
step is dropped (the first and the last stay), so the file still spans the whole run, older steps
more sparsely than recent ones. At most (MAX_STEPS + 1) x sample_prompts x sample_responses eval
lines, (MAX_STEPS + eval_every) x sample_groups x sample_responses train lines (train steps are
thinned at evals), each under ~2 x RESPONSE_CHARS (prompt and response are clipped alike).
A resumed run first drops the lines after its checkpoint, as metrics.jsonl does; the thinning
happens right after checkpoints (and at the start), a function of the steps in the file, so a
resumed run's file is the uninterrupted run's.
"""

import json
import sys
from pathlib import Path

from lib import distributed
from lib.errors import fail
from lib.rundir import write_atomic
from lib.step import Group

RESPONSE_CHARS = 4000  # a longer response keeps its first 1000 and last 3000 characters
MAX_STEPS = 64  # steps of each kind kept; default run: 5 evaluations


def clip(text: str, limit: int = RESPONSE_CHARS) -> str:
    """text, or its first quarter and last three quarters of `limit` around a marker of what was
    cut."""
    if len(text) <= limit:
        return text
    head, tail = limit // 4, limit - limit // 4
    return f"{text[:head]} [... {len(text) - head - tail} characters ...] {text[-tail:]}"


# ----------------------------------------------------------------------------
# The records: from what the evaluation and the step already hold


def eval_records(examples, ro, mine, correct, lengths, truncated, cfg) -> list:
    """The first --sample_responses responses to each of the first --sample_prompts held-out
    prompts, gathered from the ranks that sampled them (every rank calls this). ro: this rank's
    Rollouts (n a prompt) of examples[mine], None if its share is empty; correct, lengths,
    truncated (len(examples), n) all ranks'."""
    n = cfg.eval_samples
    return distributed.gather_list([
        dict(kind="eval", prompt=clip(examples[i]["prompt"]), answer=str(examples[i]["answer"]),
             response=clip(ro.texts[(i - mine.start) * n + j]), reward=float(correct[i, j]),
             length=int(lengths[i, j]), truncated=bool(truncated[i, j]))
        for i in mine if i < cfg.sample_prompts for j in range(min(cfg.sample_responses, n))])


def group_records(kept: list[Group], keep, adv, tok, cfg) -> list:
    """--sample_groups (> 0): the first trained responses of the step's first groups, with their
    advantages, gathered from the ranks that sampled them (every rank calls this: all hold the same
    kept groups). kept: the step's kept Groups; keep: G tensors (m_j,), the trained rollouts'
    indices among each group's n; adv: G tensors (m_j,), their advantages (a (G, m) tensor each
    serves as well). A record's row is found through its own group's n."""
    records = []
    for k, group in enumerate(kept[: cfg.sample_groups]):
        ro, g, r, n_tok = group.rollouts, group.index, group.rewards, group.lengths
        if ro is None:  # another rank sampled this group
            continue
        # The prompt as the model saw it (a chat template included).
        prompt = clip(tok.decode(ro.prompt_ids[g]))
        # p: the response's place among the m trained; j: its place among the group's N.
        for p, j in enumerate(keep[k][: cfg.sample_responses].tolist()):
            row = g * ro.n + j
            records.append((k, dict(kind="train", prompt=prompt, response=clip(ro.texts[row]),
                                    reward=float(r[j]), length=int(n_tok[j]),
                                    truncated=bool(ro.truncated[row]),
                                    advantage=float(adv[k][p]))))
    # The records in group order.
    return [rec for _, rec in sorted(distributed.gather_list(records), key=lambda x: x[0])]


# ----------------------------------------------------------------------------
# The file: appended at every step that has records; rewound on --resume; thinned at checkpoints


def read(path: Path) -> list:
    """The records of samples.jsonl. A last line cut short (a full disk, a kill as it was written)
    is dropped with a line, as metrics.jsonl's; any other unreadable line stops with one line
    naming it."""
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    records = []
    for i, line in enumerate(lines, 1):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines):
                fail(f"{path}: line {i} is not a record ({line[:60]!r})")
            print(f"{path}: dropped its last line, cut short ({len(line)} characters)",
                  file=sys.stderr)
    return records


def rewrite(path: Path, records: list):
    """path holding exactly records, replaced whole (a crash leaves the old file or the new one)."""
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in records))


def rewind(path: Path, upto: int):
    """Keep the records of steps <= upto: a resumed run redoes the steps after its checkpoint (upto
    -1: none)."""
    rewrite(path, [r for r in read(path) if r["step"] <= upto])


def append(path: Path, step: int, records: list):
    with open(path, "a") as f:
        f.writelines(json.dumps({"step": step, **r}) + "\n" for r in records)


def kept_steps(steps: list, cap: int) -> set:
    """Of sorted distinct steps, those kept: all while at most cap; past it every other one (the
    first and the last always), again until at most cap are left. A function of the steps alone:
    thinning twice is once."""
    while len(steps) > cap:
        steps = steps[::2] + ([steps[-1]] if len(steps) % 2 == 0 else [])
    return set(steps)


def thin(path: Path, cap: int = 0):
    """Each kind down to at most cap (default MAX_STEPS) steps (kept_steps); rewritten only when
    that changes it."""
    records, cap = read(path), cap or MAX_STEPS
    keep = {kind: kept_steps(sorted({r["step"] for r in records if r["kind"] == kind}), cap)
            for kind in {r["kind"] for r in records}}
    if any(r["step"] not in keep[r["kind"]] for r in records):
        rewrite(path, [r for r in records if r["step"] in keep[r["kind"]]])
