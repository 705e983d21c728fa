"""
setup.py: what a training run and --eval_only share before their first step: seeds, processes and
device, Ctrl-C's one line, the verifier, the data (its training and held-out splits, each prompt
checked against the model's context), the fixed eval set, the policy and its tokenizer, and the
random stream of every evaluation. A run's memory plan, and --plan's, are lib/plan.py's.
"""

import ctypes
import dataclasses
import random
import re
import signal
import sys
import threading
from pathlib import Path

import torch
from tqdm import tqdm
from transformers.utils import logging as hf_logging

import data
import verify
from lib import distributed
from lib.checkpoint import checkpoint_dir, is_run_dir
from lib.errors import fail
from lib.policy import load_policy, pick_dtype
from sampler import encode_prompt


def keep_freed_memory() -> bool:
    """On a CPU under glibc, a freed block is kept for the next tensor instead of handed back to
    the system: glibc returns a block over 32 MiB (and a heap top past its trim threshold) at each
    free, and every page of the next tensor of that size then faults in again, zeroed by the
    kernel, at every pass over a step's (rows, vocabulary) temporaries. SmolLM2's step in bf16
    spends 15% less training CPU time, most of it system time, at a lower peak RSS
    (docs/results/smollm2.md). False where there is no glibc, or where it refuses a setting (an
    older glibc caps the mmap threshold at 32 MiB; the trim setting is made regardless)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
    most = ctypes.c_int(2**31 - 1)
    kept = [libc.mallopt(M_MMAP_THRESHOLD, most), libc.mallopt(M_TRIM_THRESHOLD, most)]
    return all(kept)


def setup(cfg, policy: str, flag: str, with_train_set=True):
    """What a run and --eval_only share: seeds, device, the data (first: a bad --task fails before
    anything is written), the fixed eval set, the policy and its tokenizer."""
    hf_logging.disable_progress_bar()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    device = distributed.setup(cfg.device)  # joins the process group when launched by torchrun
    if device.type == "cpu":
        keep_freed_memory()
    # The run records the verifier it used.
    cfg = dataclasses.replace(cfg, verifier=pick_verifier(cfg))
    train_set = load_data(cfg, "--task", cfg.task, "train", cfg.seed) if with_train_set else None
    if train_set is not None:
        check_train_size(cfg, train_set)
    # the held-out problems are drawn by --eval_seed alone (as --seed drew them before it: a seed-0
    # run's are unchanged), so that runs of different seeds are scored on the same problems, paired
    # problem by problem
    held_out = (load_data(cfg, "--eval_task", cfg.eval_task, "all", cfg.eval_seed) if cfg.eval_task
                else load_data(cfg, "--task", cfg.task, "test", cfg.eval_seed))
    if cfg.eval_task and train_set:
        check_overlap(cfg, train_set, held_out)
    if flag == "--model" and is_run_dir(Path(policy)):  # a run: its ckpt/, or one line
        checkpoint_dir(policy, flag)
    model, tok = load_policy(policy, device, flag)
    # The run records the dtype it computes in; auto's choice is said with its reason.
    dtype, why = pick_dtype(cfg, device, model.config, policy)
    if cfg.dtype == "auto" and distributed.is_main():
        tqdm.write(f"--dtype auto: {dtype} ({why})")
    cfg = dataclasses.replace(cfg, dtype=dtype)
    if cfg.system_prompt and not tok.chat_template:
        fail(f"--system_prompt: the tokenizer of {policy} has no chat template to put it in")
    positions = getattr(model.config, "max_position_embeddings", None)
    eval_new = max(cfg.max_new_tokens, cfg.eval_max_new_tokens)  # the eval's and the probe's
    source = f"--eval_task {cfg.eval_task}" if cfg.eval_task else f"--task {cfg.task}"
    held_out, longest = fit_context(cfg, held_out, f"{source}: held-out", eval_new, tok, positions)
    if train_set is not None:
        train_set, longest_train = fit_context(cfg, train_set, f"--task {cfg.task}: training",
                                               cfg.max_new_tokens, tok, positions)
        check_train_size(cfg, train_set)
        longest = max(longest, longest_train)
    eval_set = random.Random(cfg.eval_seed + 1).sample(held_out, min(cfg.eval_prompts,
                                                                   len(held_out)))
    if cfg.train_prompts and train_set is not None:
        train_set = trained_prompts(cfg, train_set, eval_set)
        check_train_size(cfg, train_set)
    for name in ("probe_prompts", "answer_prompts"):  # the probe's, the answer distributions'
        if getattr(cfg, name) > len(eval_set):  # the eval set's first ones: all, recorded as used
            if distributed.is_main():
                tqdm.write(f"--{name} {getattr(cfg, name)}: the eval set holds {len(eval_set)} "
                           f"prompt(s); it measures those {len(eval_set)} (config.json says so)")
            cfg = dataclasses.replace(cfg, **{name: len(eval_set)})
    if bad := next((n for n, p in model.named_parameters() if not torch.isfinite(p).all()), None):
        fail(f"{flag} {policy}: its weight {bad} holds NaN or inf; refusing to sample from it")
    return cfg, device, train_set, eval_set, model, tok, longest


def trained_prompts(cfg, train_set: list, eval_set: list) -> list:
    """--train_prompts n: the training task's first n prompts in the order its eval set is drawn
    (without --eval_task, the eval set's first n: every one measured at every eval; with one, the
    training set drawn as an eval set of it would be). More than the set holds: one line."""
    drawn = (random.Random(cfg.eval_seed + 1).sample(train_set, len(train_set)) if cfg.eval_task
             else eval_set)
    if cfg.train_prompts > len(drawn):
        fail(f"--train_prompts {cfg.train_prompts}: --task {cfg.task}'s "
             f"{'training' if cfg.eval_task else 'eval'} set holds {len(drawn)} prompts")
    return drawn[: cfg.train_prompts]


def stop_on_ctrl_c(note: str):
    """Ctrl-C ends the run with one line (`note`: what survives) and exit status 130, no traceback;
    the crash-safe checkpoint and metrics make any moment safe. An empty note restores Python's
    handling."""
    # only the main thread may set a handler
    if threading.current_thread() is not threading.main_thread():
        return

    def interrupted(signum, frame):
        if distributed.is_main():
            tqdm.write(note, file=sys.stderr)
        sys.exit(130)
    signal.signal(signal.SIGINT, interrupted if note else signal.default_int_handler)


def pick_verifier(cfg) -> str:
    """--verifier auto: both (rules or Math-Verify, the paper's) on math when math-verify is
    installed."""
    try:
        rule = data.task_of(cfg.task).rule  # the task's rule (data.TASKS): keys is arith's
    except ValueError as e:
        fail(f"--task {cfg.task}: {e}")
    try:
        return verify.choose_verifier(rule, cfg.verifier)
    except ImportError as e:
        fail(f"--verifier {cfg.verifier}: {e}")


def load_data(cfg, flag: str, task: str, split: str, seed: int) -> list:
    """Examples of one split of a task; a bad source or an empty split stops with one line."""
    try:
        rows = data.load_task(task, split, seed=seed, digits=cfg.digits)
    except (ValueError, OSError) as e:
        fail(f"{flag} {task}: {e}")
    if not rows:
        fail(f"{flag} {task}: its {split} split is empty"
             + (" (name a held-out source: --eval_task)" * (split == "test")))
    # A dataset's repeated rows would weigh twice (a generated task's are distinct by construction:
    # none dropped).
    unique = list({(r["prompt"], r["answer"]): r for r in rows}.values())
    if len(unique) < len(rows) and distributed.is_main():
        tqdm.write(f"{flag} {task}: dropped {len(rows) - len(unique)} duplicated rows of "
                   f"{len(rows)} ({split} split)")
    return unique


def check_train_size(cfg, train_set: list):
    """A step keeps B groups of B distinct prompts: a training set smaller than B stops, one line
    (a larger one is drawn from whole, prompts recurring only across rounds: sample_step_groups)."""
    if len(train_set) < cfg.prompts_per_step:
        fail(f"--task {cfg.task}: its training set holds {len(train_set)} prompt(s), fewer than "
             f"--prompts_per_step {cfg.prompts_per_step} (a step trains on B distinct prompts)")


def check_overlap(cfg, train_set: list, held_out: list):
    """An --eval_task that shares prompts with the training set would score trained prompts as
    held-out ones: said, and refused unless --eval_overlap allows it."""
    trained = {e["prompt"] for e in train_set}
    shared = sum(e["prompt"] in trained for e in held_out)
    if not shared:
        return
    line = (f"--eval_task {cfg.eval_task}: {shared} of its {len(held_out)} prompts "
            "are in --task's training set")
    if not cfg.eval_overlap:
        fail(line + " (its score would not be held out; --eval_overlap 1 allows it)")
    if distributed.is_main():
        tqdm.write(line + " (allowed by --eval_overlap)")


def fit_context(cfg, rows: list, where: str, max_new: int, tok, positions) -> tuple:
    """(rows, the longest prompt's tokens): every prompt checked, with max_new new tokens, against
    the model's context (`positions`, its max_position_embeddings; None: unknown, nothing checked).
    A prompt past it stops with one line naming its row (`where`: the flag, source and split) and
    its length; --long_prompts drop drops such rows, allow keeps them (rotary positions extend past
    the config's: the embedded model's 64 and a math prompt), each with a count. The tokenizer's own
    warning about length is left unsaid: this is the word. The lengths are bounded from each row's
    bytes and measured only where a bound cannot decide (PromptLengths)."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        lengths = PromptLengths(tok, rows, cfg.system_prompt)
        limit = positions - max_new if positions else None  # the most prompt tokens that fit
        too_long = lengths.over(limit) if positions else []
        if too_long and cfg.long_prompts == "refuse":
            i = too_long[0]
            fail(f"{where} row {i} ({rows[i]['prompt'][:24]!r}...) is {lengths.tokens(i)} tokens: "
                 f"+ {max_new} new > the model's {positions} positions, as are "
                 f"{len(too_long) - 1} more (--long_prompts drop drops them, allow keeps them)")
        if too_long and distributed.is_main():
            tqdm.write(f"{where} {len(too_long)} of {len(rows)} rows are longer than the model's "
                       f"{positions} positions with {max_new} new tokens: "
                       + ("dropped (--long_prompts drop)" if cfg.long_prompts == "drop" else
                          "kept (--long_prompts allow)"))
        kept = range(len(rows))
        if too_long and cfg.long_prompts == "drop":
            dropped = set(too_long)
            kept = [i for i in kept if i not in dropped]
            if not kept:
                fail(f"{where} every row is longer than the model's {positions} positions "
                     f"with {max_new} new tokens")
        return [rows[i] for i in kept], lengths.longest(kept)
    finally:
        hf_logging.set_verbosity(verbosity)


class PromptLengths:
    """Each row's prompt length in tokens as the sampler encodes it, bounded from its bytes alone
    (O(rows), no tokenizer call) and measured (prompt_lengths) only where a bound cannot
    decide. lo <= tokens <= hi, where lo = (the template's bytes + the stripped prompt's) / the
    most bytes a token covers, rounded up, - slack (0 where the prompt holds a special token's
    text), and hi = the template's tokens + the prompt's bytes + slack: every token covers at least
    one byte. The slack, 2, covers merges across a chat template's edges, a template that trims its
    content and a SentencePiece prefix space; it is 0 for a byte-level tokenizer with no template.
    Where these bounds may not hold (a slow tokenizer, or a measured row outside its bounds) every
    row is measured."""

    CHUNK = 256  # rows measured a call, for the longest

    def __init__(self, tok, rows: list, system_prompt: str):
        self.tok, self.rows, self.system_prompt = tok, rows, system_prompt
        self.exact = {}  # row index -> its tokens
        bounds = template_bounds(tok, system_prompt)
        if bounds is None:
            self.lo, self.hi = [0] * len(rows), [sys.maxsize] * len(rows)
            self.measure(range(len(rows)))
            return
        template_bytes, template_tokens, per_token, special, slack = bounds
        nbytes = [len(r["prompt"].encode()) for r in rows]
        self.hi = [template_tokens + n + slack for n in nbytes]
        # (a template may trim its content: the bytes of the prompt stripped)
        self.lo = [0 if special and special.search(r["prompt"]) else
                   max(0, -(-(template_bytes + len(r["prompt"].strip().encode())) // per_token)
                       - slack) for r in rows]

    def measure(self, indices):
        """The exact tokens of these rows; one outside its bounds has every row measured."""
        todo = [i for i in indices if i not in self.exact]
        counts = prompt_lengths(self.tok, [self.rows[i] for i in todo],
                                        self.system_prompt) if todo else []
        self.exact.update(zip(todo, counts))
        if any(not self.lo[i] <= self.exact[i] <= self.hi[i] for i in todo):
            self.lo, self.hi = [0] * len(self.rows), [sys.maxsize] * len(self.rows)
            self.measure(range(len(self.rows)))  # no bound is trusted now: every row measured
        for i in todo:
            self.lo[i] = self.hi[i] = self.exact[i]

    def tokens(self, i: int) -> int:
        self.measure([i])
        return self.exact[i]

    def over(self, limit: int) -> list:
        """The rows of more than `limit` tokens, in order: measured only where lo <= limit < hi."""
        self.measure([i for i in range(len(self.rows)) if self.lo[i] <= limit < self.hi[i]])
        return [i for i in range(len(self.rows))
                if self.exact.get(i, self.lo[i]) > limit]

    def longest(self, kept) -> int:
        """The most tokens of the rows `kept`: measured from the highest bound down, until no row
        left can hold more than the longest measured."""
        order, best = sorted(kept, key=lambda i: -self.hi[i]), 0
        for start in range(0, len(order), self.CHUNK):
            chunk = [i for i in order[start: start + self.CHUNK] if self.hi[i] > best]
            if not chunk:
                break
            self.measure(chunk)
            best = max(best, max(self.exact[i] for i in chunk))
        return best


def template_bounds(tok, system_prompt: str):
    """What PromptLengths bounds a prompt with: (the bytes outside special tokens and the tokens of
    the prompt's template around an empty prompt, the most bytes one token covers, a pattern of
    the special tokens' text or None, the slack); None for a tokenizer that is not a fast one (its
    vocabulary is not read here)."""
    if not getattr(tok, "is_fast", False):
        return None
    if tok.chat_template:
        chat = [{"role": "system", "content": system_prompt}] if system_prompt else []
        chat.append({"role": "user", "content": ""})
        text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    else:
        text = ""
    # A byte-level vocabulary writes one byte a character; any other, UTF-8.
    byte_level = "ByteLevel" in repr(tok.backend_tokenizer.decoder)
    added = set(tok.get_added_vocab())
    per_token = max((len(t) if byte_level else len(t.encode())
                     for t in tok.get_vocab() if t not in added), default=0)
    special = re.compile("|".join(map(re.escape, sorted(added)))) if added else None
    # The template's bytes outside its special tokens (each one token, whatever its length).
    plain = special.sub("", text) if special else text
    return (len(plain.encode()), len(encode_prompt(tok, "", system_prompt)), max(per_token, 1),
            special, 0 if byte_level and not tok.chat_template else 2)


def prompt_lengths(tok, rows: list, system_prompt: str = "") -> list:
    """Each row's prompt length in tokens, as the sampler encodes it (sampler.encode_prompt); with
    no chat template one batched call, the same ids."""
    if not tok.chat_template and not system_prompt:
        ids = tok([r["prompt"] for r in rows], add_special_tokens=True)["input_ids"]
        return [len(x) for x in ids]
    return [len(encode_prompt(tok, r["prompt"], system_prompt)) for r in rows]


def eval_generator(device, seed: int, step: int) -> torch.Generator:
    """The random stream of the evaluation (and probe) at `step`, a function of (seed, step) alone:
    evaluating never moves the training's stream (--eval_every cannot change a run), and --eval_only
    draws exactly what a run's evaluation at step 0 draws."""
    seed63 = random.Random(f"eval-{seed}-{step}").getrandbits(63)
    return torch.Generator(device=device).manual_seed(seed63)
