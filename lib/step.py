"""
step.py: what the phases of a training step hand each other and what lib/'s instruments read,
defined once for brorl.py and lib/ alike:
  - sample_share: a batch of prompts' rollouts (sampler.generate), each of K ranks sampling its
    share, scored by the verifier (score: verify.py's verdict, 0 for a truncated response), every
    rank given every score. brorl.py's rollout phase and evaluation, --alloc adaptive's sampler
    (lib/allocation.py) and the probe (lib/diagnostics.py) all sample through it;
  - Group, a prompt's group, and sample_groups, which makes a batch's;
  - StepStats, what the sampling phase reports (lib/steplog.step_metrics makes it a row of
    metrics.jsonl), and SampleStep, that phase's signature, as brorl.rl_step calls it;
  - Batch, the update's rows packed into tensors, and pack_groups, which packs kept groups'.
"""

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F

import data
import verify
from lib import distributed
from sampler import Rollouts, generate

if TYPE_CHECKING:
    from lib.allocation import AllocStats
    from lib.balance import Snapshot


def sample_share(model, tok, examples, n, temperature, top_p, cfg, seeds, max_new=None, *,
                 lenient=False):
    """This rank's share of the prompts, n rollouts each (an int, or a list: each prompt's own;
    one sampler call either way), sampled and scored: its Rollouts (None if none), the share (a
    range into examples), and ALL prompts' rewards, lengths, truncated flags: (P, n) or P (n_p,).
    With lenient, the same responses' lenient verdicts too (score's), after the flags."""
    mine = distributed.share(len(examples))
    sizes = [n] * len(examples) if isinstance(n, int) else list(n)
    # Each prompt's rewards, lengths, truncation flags (and lenient verdicts), padded to the most
    # rollouts.
    scores = torch.zeros(len(mine), 4 if lenient else 3, max(sizes, default=0),
                         dtype=torch.float64)  # (P', 3 or 4, n)
    ro = None
    if len(mine):
        ro = generate(model, tok, [examples[i]["prompt"] for i in mine],
                      n if isinstance(n, int) else sizes[mine.start: mine.stop],
                      max_new or cfg.max_new_tokens, temperature, top_p, cfg.max_rows,
                      seeds[mine.start: mine.stop], cfg.system_prompt)
        answers, task = [examples[i]["answer"] for i in mine], examples[0]["task"]
        # The rules' rewards, and with lenient the lenient verdicts. (B', n) each, one or two
        r = (score(ro, answers, task, cfg.verifier, tok, lenient=True) if lenient
             else (score(ro, answers, task, cfg.verifier, tok),))
        r = [x.flatten() for x in r]  # (this rank's rows,) each
        rows = torch.stack([r[0], ro.mask.sum(1), ro.truncated, *r[1:]]).double()  # (3 or 4, rows)
        for j, part in enumerate(rows.split(sizes[mine.start: mine.stop], 1)):
            scores[j, :, : part.shape[1]] = part
    if distributed.world_size() > 1:  # Every rank is given every prompt's scores.
        scores = distributed.gather(scores)
    r, lengths, truncated, *rl = scores.unbind(1)  # (len(examples), n) each
    own = lambda x: x if isinstance(n, int) else [x[i, :k] for i, k in enumerate(sizes)]
    # Each (P, n), or each (n_p,) for a list; the lenient verdicts last when asked.
    return ro, mine, *map(own, (r.float(), lengths, truncated, *(x.float() for x in rl)))


def score(rollouts: Rollouts, answers, task: str, verifier: str = "rules",
          tok=None, lenient=False):
    """Rewards (B, N), or (sum n_j,) for prompts of unequal n: the verifier on each response; a
    truncated one scores 0. A response is scored with the <think> its prompt opened (R1-Distill's
    template ends with one), so that an unfinished think block does not count. With lenient, a
    pair: the rewards and, of the same texts, verify.lenient_rewards (the rules' verdict or the
    last number's; truncated 0 too: a response cut at the cap has no last word)."""
    prompts = [tok.decode(ids) if tok is not None else "" for ids in rollouts.prompt_ids]
    # Whether each prompt leaves a think block open. (B,)
    opened = ["<think>" if p.rfind("<think>") > p.rfind("</think>") else "" for p in prompts]
    n = rollouts.n if isinstance(rollouts.n, list) else [rollouts.n] * len(prompts)
    owner = [p for p, k in enumerate(n) for _ in range(k)]  # (B*N,) each row's prompt
    texts = [opened[p] + t for p, t in zip(owner, rollouts.texts)]
    golds = [answers[p] for p in owner]
    # Each response's verdict; a truncated response's is then set to 0. (B*N,)
    r = torch.tensor(verify.rewards(texts, golds, task=task, verifier=verifier),
                     dtype=torch.float32)
    r[rollouts.truncated] = 0.0
    shape = lambda x: x.view(-1, rollouts.n) if isinstance(rollouts.n, int) else x
    if not lenient:
        return shape(r)
    # The lenient verdicts of the same texts, the rules' reused (scored once). (B*N,)
    rl = torch.tensor(verify.lenient_rewards(texts, golds, task, verifier, rules=r.tolist()),
                      dtype=torch.float32)
    rl[rollouts.truncated] = 0.0
    return shape(r), shape(rl)


@dataclass
class Group:
    """A prompt's group: its rewards and lengths (every rank's), its rollouts at `index` (one's)."""
    rewards: torch.Tensor  # (n,) one per rollout
    lengths: torch.Tensor  # (n,) valid tokens per response
    rollouts: Rollouts = None  # None where another rank sampled the group
    index: int = None  # the group's place in rollouts: its rows are index * n + j
    example: dict = None  # its prompt (the mass balance's, samples.jsonl's)


def sample_groups(model, tok, cfg, batch, n, seeds) -> list:
    """n rollouts of each prompt of batch (an int, or a list: each prompt's own) at the training
    temperature, this rank's share sampled, all scored: a Group for each prompt. With one n a
    group points into this rank's Rollouts; with each prompt's own n it holds a copy of its own
    rollouts (index 0), so that its rows are index * n + j as in a group of one n."""
    ro, mine, r, lengths, _ = sample_share(model, tok, batch, n, cfg.temperature, cfg.top_p, cfg,
                                           seeds)
    held = lambda g: (ro, g) if isinstance(n, int) else (ro.group(g), 0)  # (rollouts, index)
    return [Group(r[g], lengths[g], *(held(g - mine.start) if g in mine else ()),
                  example=batch[g]) for g in range(len(batch))]


@dataclass
class StepStats:
    """What a step's sampling phase reports, over ALL its generated groups (before dynamic sampling
    drops any): lib/steplog.step_metrics makes it the step's row; lib/diagnostics reads
    balance_before."""
    groups_generated: int = 0  # groups sampled, over all rounds
    groups_survived: int = 0  # of those, kept by dynamic sampling, before the cut to B
    groups_kept: int = 0  # groups handed to the update (at most B)
    rounds: int = 0  # sampling rounds
    rewards: list = field(default_factory=list)  # each generated group's rewards (n_j,)
    tokens: int = 0  # response tokens generated
    sampled_right: list = None  # keys, sets (train_is_eval, data.TASKS): the prompts sampled right
    alloc: "AllocStats" = None  # --alloc adaptive's statistics (lib/allocation.py); else None
    # --mass_balance, on its steps: the kept groups' answer distributions before the update.
    balance_before: "Snapshot" = None

    def count(self, groups: list, task: str):
        """One sampling round's generated Groups: their number, rewards and response tokens; where
        every training prompt is also evaluated (keys, sets), the prompts with a right rollout, so
        that the prompts a run never sampled right can be told from metrics.jsonl."""
        self.rounds += 1
        self.groups_generated += len(groups)
        self.rewards += [g.rewards for g in groups]
        self.tokens += int(sum(g.lengths.sum() for g in groups))
        if data.task_of(task).train_is_eval:
            right = [g.example["prompt"] for g in groups if g.rewards.max() > 0]
            self.sampled_right = (self.sampled_right or []) + right


class SampleStep(Protocol):
    """The rollout, reward and dynamic-sampling phases of a step, as brorl.rl_step calls them:
    brorl.sample_step_groups, or --alloc adaptive's (lib/allocation.sampler), with --mass_balance
    watched (lib/diagnostics.watch_sampling). Every rank returns the same kept Groups (at most B,
    each with rewards that differ unless dynamic sampling is off) and the same StepStats."""

    def __call__(self, model, tok, cfg, train_set: list, rng: random.Random, step: int,
                 keep_est: float) -> tuple[list[Group], StepStats]: ...


# ----------------------------------------------------------------------------
# The update's batch: the kept groups' trained rows, packed


@dataclass
class Batch:
    """The rows an update trains on (pack_groups), or whose log-probs a measure takes (lib/mass.py):
    G prompts and R responses, each response pointing at its prompt."""
    prompt: torch.Tensor  # (G, P) prompt token ids, left-padded (the pad id is masked: any)
    prompt_mask: torch.Tensor  # (G, P) the real prompt tokens
    resp: torch.Tensor  # (R, T) response token ids, right-padded
    resp_mask: torch.Tensor  # (R, T) the valid response tokens
    group: torch.Tensor  # (R,) each response's prompt: its row of prompt
    sampler_logp: torch.Tensor = None  # (R, T) the sampler's log-probs of the response tokens
    sampler_entropy: torch.Tensor = None  # (R, T) the sampler's entropies at those tokens
    lengths: list = None  # each row's valid tokens, float64 on the CPU: (G, n), or G tensors
    # (n_j,) for groups of unequal n; in training every rank's rows' (the loss's normalisers)


def pack_groups(groups: list, dev="cpu") -> "Batch":
    """One-group Rollouts (Rollouts.group) -> the update's Batch on `dev`: G prompts, left-padded to
    P, and R = G*n responses, right-padded to T (trailing all-padding columns dropped, at least 2
    kept: lib/logprobs.response_logprobs always makes its two model calls), each row pointing at
    its prompt, and `lengths` (G, n), these groups' rows' valid tokens (brorl.pack_rows gives all
    ranks'); groups of unequal n: R = sum n_j rows and `lengths` a list of G tensors (n_j,). No
    groups: an empty batch."""
    G = len(groups)
    P = max((len(x.prompt_ids[0]) for x in groups), default=1)
    prompt = torch.zeros(G, P, dtype=torch.long)  # (G, P), pad id irrelevant: masked
    prompt_mask = torch.zeros(G, P, dtype=torch.bool)  # (G, P)
    for i, x in enumerate(groups):
        ids = x.prompt_ids[0]
        prompt[i, P - len(ids):], prompt_mask[i, P - len(ids):] = torch.tensor(ids), True
    empty = dict(tokens=torch.long, mask=torch.bool, logp=torch.float32, entropy=torch.float32)
    # (R, T_max)
    cat = lambda field: torch.cat([getattr(x, field) for x in groups]
                                  or [torch.zeros(0, 1, dtype=empty[field])])
    mask = cat("mask")
    T = max(int(mask.any(0).nonzero().max()) + 1 if mask.any() else 1, 2)
    # (R, T), one padding column if T_max = 1
    rows = lambda field: F.pad(cat(field), (0, 1))[:, :T].to(dev)
    # (R,)
    group = torch.arange(G).repeat_interleave(torch.tensor([x.n for x in groups], dtype=torch.long))
    lengths = mask.sum(1).double()  # (R,) valid tokens per row
    # (G, n); groups of unequal n (--alloc adaptive): a list of G tensors (n_j,)
    lengths = (lengths.reshape(G, groups[0].n if groups else 0) if len({x.n for x in groups}) <= 1
               else list(lengths.split([x.n for x in groups])))
    return Batch(prompt.to(dev), prompt_mask.to(dev), rows("tokens"), rows("mask"), group.to(dev),
                 rows("logp"), rows("entropy"), lengths)


