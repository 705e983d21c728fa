"""tools/step_lines.py: the count of the lines one training step reads, and its finder of no-ops
(functions that did nothing at every call), checked on small functions traced here, and on the
default step itself (slow: it trains)."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import step_lines

ROOT = Path(__file__).resolve().parent.parent


def passthrough(x, on):
    """Its input back unless on: what a hook whose flag is off did."""
    if not on:
        return x
    return [v * 2 for v in x]


def records(cfg):
    if not cfg:
        return []
    return [cfg]


def total(metrics: dict) -> dict:
    """A copy equal to its input: a sum over one process."""
    return {k: float(v) for k, v in metrics.items()}


def shift(x):
    return [v + 1 for v in x]


def grow(x):
    """Changes its argument and returns it: work, though what comes back is what went in."""
    x.append(len(x))
    return x


def step():
    x = [1, 2]
    passthrough(x, False)
    records(0)
    total({"a": 1.0, "b": 2.0})
    shift(x)
    grow(x)
    records(1)  # records did something at one call: not a no-op


def traced(fn) -> dict:
    tracer = step_lines.Tracer()
    tracer.in_step = True
    sys.settrace(tracer)
    try:
        fn()
    finally:
        sys.settrace(None)
    return step_lines.count(tracer)


def test_the_finder_names_what_did_nothing_and_only_that():
    counted = traced(step)
    here = "tests/test_step_lines.py"
    assert counted["noops"] == {
        f"{here}:passthrough": (5, "returns its argument x"),
        f"{here}:total": (3, "returns a copy of its argument metrics, equal to it")}
    # Every function entered, each counted whole: its lines but the blank ones.
    whole = lambda f: sum(1 for line in inspect.getsource(f).splitlines() if line.strip())
    assert {k.split(":")[1]: n for k, n in counted["functions"].items()} == {
        f.__name__: whole(f) for f in (passthrough, records, total, shift, grow, step)}
    # This file is not brorl.py's or lib/'s: beside the count, all of it that ran.
    assert counted["files"] == {} and counted["beside"] == {here: sum(
        whole(f) for f in (passthrough, records, total, shift, grow, step))}


def test_an_empty_result_after_guards_is_nothing():
    assert traced(lambda: records(0))["noops"] == {
        "tests/test_step_lines.py:records": (4, "returns []")}


@pytest.mark.slow
def test_the_default_step_is_counted():
    """The program's own output on the default step: the total, then each file's lines adding up to
    it, each function's, the no-ops and the idle code."""
    out = subprocess.run([sys.executable, "-m", "tools.step_lines"], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=900,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin",
                              "HF_HUB_OFFLINE": "1"}).stdout
    total, files = map(int, re.match(r"one step: (\d+) lines in (\d+) files\n", out).groups())
    rows = re.findall(r"^ +(\d+)  ((?:brorl\.py|lib/\w+\.py))$", out.split("beside it:")[0], re.M)
    assert len(rows) == files >= 2 and sum(int(n) for n, _ in rows) == total
    assert {"brorl.py", "lib/step.py", "lib/logprobs.py"} <= {f for _, f in rows}
    functions = re.search(r"^functions: (\d+)\n((?: +\d+  .+\n)+)", out, re.M)
    assert functions and len(functions.group(2).splitlines()) == int(functions.group(1))
    assert "brorl.py:rl_step" in functions.group(2) and "brorl.py:update_policy" in out
    assert re.search(r"^no-ops: \d+ lines in \d+ functions$", out, re.M)
    assert re.search(r"^idle code: \d+ of the counted lines", out, re.M)
