r"""
tasks.py: real datasets, read by schema into examples dict(prompt, answer, task="math"). It
imports nothing of ours (data.load_task dispatches here; the gold of a MATH solution is read by
the same last-box rule the verifier applies to a model's answer, written out again below).

A task is "<schema>:<source>". The source is a local .jsonl / .json / .parquet file (its rows,
all of them) or a Hugging Face hub dataset id, optionally with a config and a split:
"<id>[:<config>][@<split>]" (default split "train"), read by datasets.load_dataset.

Schemas (the keys each row must have):
  gsm8k  question; answer = worked solution ending in "#### <number>". The gold is that number
         alone, its thousands commas removed: "#### 7,029" -> "7029".          (GSM8K)
  math   problem; answer, or else solution, whose last \boxed{...} is the gold. (MATH,
         MATH-500, DeepScaleR-Preview, AIME-style sets: an integer answer is read as text)
Every prompt is the problem text, one space, and ProRL's suffix MATH_SUFFIX (the verifier reads
the last \boxed{}); sampler.encode_prompt wraps it in the model's chat template, if it has one.
A bad row is an error naming the file (or hub id) and the row: no row is skipped silently.
"""

import json
import re
from pathlib import Path

# ProRL's math prompt suffix (docs/paper.md §6), joined to the problem by one space as in veRL
MATH_SUFFIX = "Let's think step by step and output the final answer within \\boxed{}."
LOCAL = (".jsonl", ".json", ".parquet")
_GSM8K_NUMBER = re.compile(r"-?[0-9]+(?:\.[0-9]+)?")


def load(task: str) -> list[dict]:
    """Every example of "<schema>:<source>", in the source's order."""
    schema, _, source = task.partition(":")
    if schema not in SCHEMAS or not source:
        raise ValueError(f"unknown task {task!r}: use arith, or gsm8k:/math: followed by a "
                         f".jsonl/.json/.parquet path or a hub dataset id[:config][@split]")
    rows = read_local(Path(source)) if source.endswith(LOCAL) else read_hub(source)
    return [SCHEMAS[schema](row, f"{source}: row {i}") for i, row in enumerate(rows, 1)]


# ----------------------------------------------------------------------------
# Schemas: one row -> one example, or a ValueError naming the row


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


SCHEMAS = {"gsm8k": gsm8k_row, "math": math_row}


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


# ----------------------------------------------------------------------------
# Sources: a local file, or a hub dataset


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
