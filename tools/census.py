"""
census.py: a reach census. Each held-out prompt's correct mass Q, estimated from many samples at
the training temperature, with its interval, and the prompts counted by zone:

  high     Q >= 1/16            N = 16 draws a right answer in most steps
  window   1/2048 <= Q < 1/16   BroRL's reach window: N = 512 draws one far more often than N = 16
  low      Q < 1/2048           neither draws one in most steps

A prompt's zone is read two ways: by its point estimate (right / samples) and by its 95%
Clopper-Pearson interval (the zone holds the whole interval; otherwise "unresolved"). With S
samples a prompt with no right answer has an interval [0, 1 - 0.025^(1/S)]: at S = 512 that
reaches 1/139, so 512 samples cannot tell the window's lower part from below it; the report says
how many prompts that leaves unresolved.

The prompts are the run's held-out set, drawn by brorl's own setup from the brorl flags given
after `--` (--model, --task, --eval_prompts, --eval_seed, --max_new_tokens, --system_prompt, ...),
so that a census and a run's evaluations read the same prompts. Prompt i's samples come from its
own seed (a function of --seed and i), so that the census is the same whether it ran whole or was
killed and rerun: `<out>/census.jsonl` is rewritten whole after every prompt, and a rerun of the
same command continues after the last recorded prompt (another command's census is refused).

  python -m tools.census --out runs/census-base --samples 512 -- --model smollm2-135m-instruct \
      --task math:assets/smollm2/add2.jsonl --eval_prompts 64
  python -m tools.census --report runs/census-base [runs/census-trained]   # table, zones, moves

--first K stops after the first K prompts (a census cut to a budget); the same command with a
larger K, or without it, goes on from the prompts recorded. It samples in the run's compute dtype
(--dtype; auto is bf16 on a CPU that computes it natively), named in census.json unless fp32, and
goes on in the dtype it began in.
"""

import argparse
import dataclasses
import json
import math
import random
import sys
from pathlib import Path

import torch

from lib.errors import fail
from tools import study

HIGH, LOW = 1 / 16, 1 / 2048  # the zones' bounds: N = 16's reach and N = 512's 4-draw reach
KS = (1, 4, 16, 64, 256, 512)  # the pass@k a census reports (k <= its samples)


def prompt_seed(seed: int, i: int) -> int:
    """Prompt i's sampling seed: its own, whatever else the census sampled before it."""
    return random.Random(f"census:{seed}:{i}").getrandbits(62)


def clopper_pearson(right: int, n: int, level: float = 0.95) -> tuple:
    """The exact (Clopper-Pearson) interval of a binomial proportion: right of n."""
    from scipy.stats import beta
    a = (1 - level) / 2
    lo = 0.0 if right == 0 else float(beta.ppf(a, right, n - right + 1))
    hi = 1.0 if right == n else float(beta.ppf(1 - a, right + 1, n - right))
    return lo, hi


def zone(q: float) -> str:
    return "high" if q >= HIGH else "window" if q >= LOW else "low"


def interval_zone(lo: float, hi: float) -> str:
    """The zone holding the whole interval, else "unresolved"."""
    return zone(lo) if zone(lo) == zone(hi) else "unresolved"


def pass_at_k(right: int, n: int, k: int) -> float:
    """Unbiased pass@k of one prompt from `right` of n samples (Chen et al. 2021): 1 - C(n-c, k) /
    C(n, k), as a product so that it stays exact in floating point."""
    if n - right < k:
        return 1.0
    return 1.0 - math.prod((n - right - j) / (n - j) for j in range(k))


# ----------------------------------------------------------------------------
# The census: one prompt at a time, rewritten whole after each


# A record's fields, each with the types it may hold: what the report reads of every prompt.
RECORD = dict(index=(int,), prompt=(str,), answer=(str,), right=(int,), samples=(int,),
              mean_len=(int, float), truncated=(int,))
# right_lenient: the samples right by verify.py's lenient reading (the rules' verdict or the last
# number's), between right and samples; a census recorded before it was kept lacks it.


def read_header(head_path: Path) -> dict:
    """A census folder's census.json (the command that made it: samples, argv, ...), or one line
    naming it: unreadable, cut short, or not a census's header (no whole number of samples)."""
    try:
        head = json.loads(head_path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        fail(f"{head_path}: unreadable ({getattr(e, 'msg', None) or e}); not a census's header "
             "(give another folder)")
    if not (isinstance(head, dict) and type(head.get("samples")) is int and head["samples"] >= 1):
        fail(f"{head_path}: not a census's header (no whole number of samples >= 1); give "
             "another folder")
    return head


def is_record(row, n: int, samples: int) -> bool:
    """Whether row is a census's record of prompt n - 1 at `samples` samples, every field there."""
    return (isinstance(row, dict)
            and all(type(row.get(k)) in kinds for k, kinds in RECORD.items())
            and row["index"] == n - 1 and row["samples"] == samples
            and 0 <= row["right"] <= samples and 0 <= row["truncated"] <= samples
            and ("right_lenient" not in row or type(row["right_lenient"]) is int
                 and row["right"] <= row["right_lenient"] <= samples))


def read_records(path: Path, header: dict) -> list:
    """The prompts a census in `path`'s folder has recorded, checked against this command's
    header; a record that is not this census's stops with one line."""
    head_path = path.with_name("census.json")
    if not head_path.exists():
        if path.exists():
            fail(f"{path}: no census.json beside it; not a census folder (give another --out)")
        return []
    old = read_header(head_path)
    if old != header:
        keys = sorted(k for k in set(old) | set(header) if old.get(k) != header.get(k))
        fail(f"{head_path}: another census ({', '.join(keys)} differ); give another --out")
    rows = []
    if path.exists():
        try:
            lines = path.read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            fail(f"{path}: unreadable ({getattr(e, 'strerror', None) or e})")
        for n, line in enumerate(lines, 1):
            try:
                row = json.loads(line)
            except ValueError:
                row = None
            if not is_record(row, n, header["samples"]):
                missing = [k for k in RECORD if isinstance(row, dict) and k not in row]
                fail(f"{path}, line {n}: not this census's record of prompt {n - 1}"
                     + (f" (it lacks {missing[0]})" if missing else ""))
            rows.append(row)
    return rows


def run_census(out: Path, samples: int, brorl_args: list, first: int = None):
    import brorl
    from lib.rundir import write_atomic
    from lib.setup import setup
    from lib.policy import autocast
    cfg = brorl.parse_config(brorl_args)
    header = dict(samples=samples, argv=brorl_args, temperature=cfg.temperature, top_p=cfg.top_p,
                  max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
    # A census goes on in the dtype it began in: its header names it, unless fp32 (the censuses
    # made before --dtype auto chose bf16 on a CPU that computes it natively name none).
    if (out / "census.json").is_file() and cfg.dtype == "auto":
        began = read_header(out / "census.json").get("dtype", "float32")
        if began not in ("float32", "bfloat16"):
            fail(f"{out / 'census.json'}: its dtype {began!r} is not float32 or bfloat16")
        cfg = dataclasses.replace(cfg, dtype=began)
    header.update({"dtype": cfg.dtype} if cfg.dtype not in ("auto", "float32") else {})
    path = out / "census.jsonl"
    rows = read_records(path, header)
    # The model and --task read (a refusal of either one line) before --out is made.
    cfg, device, _, eval_set, model, tok, _ = setup(cfg, cfg.model, "--model",
                                                    with_train_set=False)
    header.update({"dtype": cfg.dtype} if cfg.dtype != "float32" else {})
    study.make_folders(out)
    write_atomic(out / "census.json", json.dumps(header) + "\n")
    print(f"census: {len(eval_set)} prompts, {samples} samples each at T = {cfg.temperature}; "
          f"{len(rows)} recorded")
    with torch.no_grad(), autocast(cfg, device):  # (no weight changes: one region)
        for i in range(len(rows), min(first or len(eval_set), len(eval_set))):
            ex = eval_set[i]
            _, _, r, lengths, truncated, lenient = brorl.sample_share(
                model.eval(), tok, [ex], samples, cfg.temperature, cfg.top_p, cfg,
                [prompt_seed(cfg.seed, i)], lenient=True)  # (1, samples) each
            rows.append(dict(index=i, prompt=ex["prompt"], answer=ex["answer"],
                             right=int(r.sum()), samples=samples,
                             mean_len=round(float(lengths.mean()), 3),
                             truncated=int(truncated.sum()), right_lenient=int(lenient.sum())))
            write_atomic(path, "".join(json.dumps(x) + "\n" for x in rows))
            print(f"prompt {i}: {rows[-1]['right']} / {samples} right "
                  f"({rows[-1]['right_lenient']} leniently)")


# ----------------------------------------------------------------------------
# The report


def summary(rows: list) -> dict:
    """One census's numbers: mean Q, zones by point and by interval, pass@k, lengths."""
    n = rows[0]["samples"]
    q = [r["right"] / r["samples"] for r in rows]
    ivals = [clopper_pearson(r["right"], r["samples"]) for r in rows]
    count = lambda zs, z: sum(x == z for x in zs)
    points, by_ival = [zone(x) for x in q], [interval_zone(*iv) for iv in ivals]
    return dict(prompts=len(rows), samples=n, mean_q=sum(q) / len(q),
                zones={z: count(points, z) for z in ("high", "window", "low")},
                interval_zones={z: count(by_ival, z)
                                for z in ("high", "window", "low", "unresolved")},
                none_right=sum(r["right"] == 0 for r in rows),
                pass_at_k={k: sum(pass_at_k(r["right"], r["samples"], k) for r in rows)
                           / len(rows) for k in KS if k <= n},
                mean_len=sum(r["mean_len"] for r in rows) / len(rows),
                truncated=sum(r["truncated"] for r in rows) / (n * len(rows)))


def moves(before: list, after: list) -> dict:
    """Two censuses of the same prompts: zone moves by point estimate, and the prompts whose Q
    fell, with each fall's Fisher exact p (two-sided) on the two 2 x 2 counts."""
    from scipy.stats import fisher_exact
    pairs = list(zip(before, after))
    if any(a["prompt"] != b["prompt"] for a, b in pairs) or len(before) != len(after):
        fail("--report: the two censuses are not of the same prompts in the same order")
    table = {}
    for a, b in pairs:
        key = (zone(a["right"] / a["samples"]), zone(b["right"] / b["samples"]))
        table[key] = table.get(key, 0) + 1
    fell = []
    for a, b in pairs:
        qa, qb = a["right"] / a["samples"], b["right"] / b["samples"]
        if qb < qa:
            p = fisher_exact([[a["right"], a["samples"] - a["right"]],
                              [b["right"], b["samples"] - b["right"]]])[1]
            fell.append(dict(index=a["index"], before=qa, after=qb, p=float(p)))
    return dict(table=table, fell=fell)


def load(folder) -> list:
    """A census folder's records, checked against its own header; one line if it has none."""
    path, head = Path(folder) / "census.jsonl", Path(folder) / "census.json"
    if not head.is_file() or not path.is_file():
        fail(f"{folder}: no census.json and census.jsonl there")
    rows = read_records(path, read_header(head))
    if not rows:
        fail(f"{folder}: its census.jsonl records no prompt")
    return rows


def table(censuses: list) -> list:
    """A markdown table, a row for each (name, records) of censuses."""
    lines = ["| census | prompts | samples | mean Q | high / window / low (point) | "
             "high / window / low / unresolved (95% interval) | none right | "
             + " | ".join(f"pass@{k}" for k in KS) + " | mean length | truncated |",
             "|---" * (9 + len(KS)) + "|"]
    for name, rows in censuses:
        s = summary(rows)
        z, iz = s["zones"], s["interval_zones"]
        lines.append(f"| {name} | {s['prompts']} | {s['samples']} | {s['mean_q']:.4f} | "
                     f"{z['high']} / {z['window']} / {z['low']} | {iz['high']} / {iz['window']} / "
                     f"{iz['low']} / {iz['unresolved']} | {s['none_right']} | "
                     + " | ".join(f"{s['pass_at_k'][k]:.3f}" if k in s["pass_at_k"] else "-"
                                  for k in KS)
                     + f" | {s['mean_len']:.1f} | {s['truncated']:.3f} |")
    return lines


def moves_lines(before: tuple, after: tuple) -> list:
    """Two (name, records) censuses of the same prompts: the zone moves and the falls."""
    m = moves(before[1], after[1])
    lines = [f"Zone moves by point estimate, {before[0]} -> {after[0]}:", ""]
    lines += [f"- {a} -> {b}: {c}" for (a, b), c in sorted(m["table"].items())]
    sig = [f for f in m["fell"] if f["p"] < 0.05]
    lines += ["", f"Q fell on {len(m['fell'])} prompts ({len(sig)} with Fisher's exact p < "
              "0.05)" + (":" if m["fell"] else ".")]
    lines += [f"- prompt {f['index']}: {f['before']:.4f} -> {f['after']:.4f} (p {f['p']:.3g})"
              for f in sorted(m["fell"], key=lambda f: f["after"] - f["before"])]
    left = [(a, b) for a, b in zip(before[1], after[1])
            if zone(b["right"] / b["samples"]) != "high"]
    lines += ["", f"Below 1/16 in {after[0]} ({len(left)})" + (":" if left else ".")]
    lines += [f"- prompt {a['index']} ({a['answer']}): {a['right']}/{a['samples']} -> "
              f"{b['right']}/{b['samples']}" for a, b in left]
    return lines


def report(dirs: list) -> str:
    censuses = [(Path(d).name, load(d)) for d in dirs]
    lines = table(censuses)
    if len(censuses) == 2:
        lines += [""] + moves_lines(*censuses)
    return "\n".join(lines) + "\n"


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    brorl_args = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                usage="census.py --out DIR [--samples S] -- BRORL_FLAGS | "
                                      "--report DIR [DIR]")
    p.add_argument("--out", help="the census folder (census.json, census.jsonl)")
    p.add_argument("--samples", type=int, default=512, help="samples per prompt (default 512)")
    p.add_argument("--first", type=int, help="census the first K prompts only (a census cut to "
                   "a budget; the same command with a larger K goes on from it)")
    p.add_argument("--report", nargs="+", metavar="DIR", help="tables of one census, or of two "
                   "of the same prompts with the zone moves between them")
    a = p.parse_args(ours)
    if a.report:
        if a.out or brorl_args or len(a.report) > 2:
            p.error("--report takes one or two census folders and nothing else")
        print(report(a.report), end="")
        return
    if not a.out:
        p.error("--out is required (or --report)")
    if a.samples < 1:
        p.error(f"--samples {a.samples}: at least 1")
    if a.first is not None and a.first < 1:
        p.error(f"--first {a.first}: at least 1")
    # A file where the folder goes, or one there it cannot rewrite: one line, before any work.
    study.check_folder("--out", Path(a.out), files=("census.json", "census.jsonl"))
    run_census(Path(a.out), a.samples, brorl_args, a.first)


if __name__ == "__main__":
    main()
