"""
step_lines.py: how much a reader reads to follow one training step, counted from what runs. It
trains `python brorl.py` (its defaults and the flags given, for 2 steps) and traces the first step,
not an evaluation's: brorl.rl_step's call, under sys.settrace. Counted: every function of brorl.py
and lib/ entered during it, whole (its def to its last line, blank lines left out; each line once,
however often it runs), and the class of each dataclass of ours made in it (what the data holds is
read too). The top-level files the step calls into (sampler.py, kernels.py, verify.py: each one
idea, opened for how a rollout, a log-prob or a reward is made) are shown beside the count, not in
it. Printed: the total lines and files, each file's and each function's lines, the no-ops, and the
idle code: the counted lines of statements that did not run (the branches the step did not take).

A no-op is a function that did nothing at every one of its calls: it ran only guards (`if` and
`return` lines) and returned one of its arguments, nothing, or an empty container; or it returned
a container equal to one of its (plain-data) arguments as given. The finder looks at the step's
calls and at the calls brorl.train makes itself (setup and loop), so that an instrument hooked in
while its flag is off shows too. It sees only what returns: a function that mutates its argument
and returns it is not called a no-op unless it ran only guards, and a check that passes (it
raises only on bad input) is listed as one.

  python -m tools.step_lines                  # the default step
  python -m tools.step_lines --alloc adaptive  # another step: any brorl.py flags
"""

import ast
import contextlib
import copy
import dataclasses
import functools
import inspect
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

import brorl

ROOT = Path(__file__).resolve().parent.parent
COUNTED = ("brorl.py", "lib")  # what the count reads: the algorithm and its machinery
# Statements that only decide whether a function goes on: all a call that does nothing runs.
GUARDS = (ast.If, ast.Return, ast.Pass)
PLAIN = (int, float, str, bool, type(None))
EMPTY = (list, dict, tuple, set, str)  # containers whose empty value says: nothing


@functools.cache
def own_file(filename: str) -> Path | None:
    """The file's path under the repository root if it is one of ours (not a library's, nor this
    program), else None."""
    path = Path(filename).resolve()
    if not path.is_file() or {".venv", "site-packages"} & set(path.parts) or path == Path(__file__):
        return None
    try:
        return path.relative_to(ROOT)
    except ValueError:
        return None


def plain_copy(x):
    """A copy of x if it is a non-empty container of plain data (numbers, strings, lists, dicts),
    else None: an argument as it was given, to tell a function that returns it unchanged."""
    def plain(v):
        if isinstance(v, (list, tuple)):
            return all(plain(y) for y in v)
        if isinstance(v, dict):
            return all(plain(y) for y in v.values())
        return isinstance(v, PLAIN)
    return copy.deepcopy(x) if isinstance(x, (list, dict, tuple)) and x and plain(x) else None


def same(a, b) -> bool:
    """a == b, False where the comparison cannot say (a tensor inside a container)."""
    try:
        return type(a) is type(b) and bool(a == b)
    except (RuntimeError, TypeError, ValueError):
        return False


@dataclasses.dataclass
class Call:
    """One traced call of a function of ours: its arguments, the lines it ran, what it returned."""
    args: dict  # each argument by name
    copies: dict  # the plain-data arguments as they were given (plain_copy)
    lines: set = dataclasses.field(default_factory=set)
    result: object = None


class Tracer:
    """sys.settrace's function over a whole run: during the step, every call of our code; outside
    it, the calls brorl.train makes itself."""

    def __init__(self):
        self.step = defaultdict(list)  # code object -> [Call], in the step
        self.train = defaultdict(list)  # code object -> [Call], brorl.train's own calls
        self.classes = set()  # our dataclasses made in the step
        self.in_step = False

    def __call__(self, frame, event, arg):
        code = frame.f_code
        if self.in_step and code.co_name == "__init__" and code.co_filename.startswith("<"):
            cls = type(frame.f_locals.get("self"))  # a dataclass's generated __init__
            if dataclasses.is_dataclass(cls) and own_file(inspect.getfile(cls)):
                self.classes.add(cls)
            return None
        if own_file(code.co_filename) is None:
            return None
        if self.in_step:
            calls = self.step[code]
        elif frame.f_back is not None and frame.f_back.f_code is brorl.train.__code__:
            calls = self.train[code]
        else:
            return None
        args = inspect.getargvalues(frame)
        given = {k: args.locals[k] for k in args.args + [args.varargs, args.keywords] if k}
        call = Call(given, {k: c for k, v in given.items() if (c := plain_copy(v)) is not None})
        calls.append(call)

        def local(frame, event, arg):
            if event == "line":
                call.lines.add(frame.f_lineno)
            elif event == "return":
                call.result = arg
            return local
        return local


class Statements:
    """The statements of our files by line: the kind of statement a traced line belongs to."""

    def __init__(self):
        self.spans = {}

    def kind(self, path: Path, line: int) -> type:
        if path not in self.spans:
            tree = ast.parse((ROOT / path).read_text())
            self.spans[path] = [(n.lineno, n.end_lineno, type(n)) for n in ast.walk(tree)
                                if isinstance(n, ast.stmt)]
        inner = [(end - start, kind) for start, end, kind in self.spans[path]
                 if start <= line <= end]
        return min(inner, key=lambda x: x[0])[1] if inner else ast.stmt


def noop_reason(calls: list, path: Path, statements: Statements) -> str | None:
    """Why a function did nothing at every one of its calls, or None if it did something."""
    reasons = set()
    for c in calls:
        guards_only = all(issubclass(statements.kind(path, line), GUARDS) for line in c.lines)
        given = [k for k, v in c.args.items() if c.result is v]
        equal = [k for k, v in c.copies.items() if same(c.result, v)]
        if guards_only and given:
            reasons.add(f"returns its argument {given[0]}")
        elif guards_only and (c.result is None or isinstance(c.result, EMPTY) and not c.result):
            reasons.add(f"returns {c.result!r}")
        elif equal:
            reasons.add(f"returns a copy of its argument {equal[0]}, equal to it")
        else:
            return None
    return "; ".join(sorted(reasons))


def idle_lines(code, ran: set) -> set:
    """The lines of code of a function (its statements, not its docstring, comments or nested
    defs' bodies) that did not run in the step: the branches it did not take. ran: the lines of
    its file that ran, in any function."""
    path = own_file(code.co_filename)
    tree = ast.parse((ROOT / path).read_text())
    # (code's first line is its first decorator's)
    node = next(n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                and n.name == code.co_name
                and min([n.lineno, *(d.lineno for d in n.decorator_list)]) == code.co_firstlineno)
    body = node.body[1:] if ast.get_docstring(node) is not None else node.body
    idle = set()
    for stmt in (s for top in body for s in ast.walk(top) if isinstance(s, ast.stmt)):
        # A compound statement's own lines are its header's; a simple one's, all of it.
        inner = [getattr(stmt, k) for k in ("body", "orelse", "finalbody", "handlers")
                 if getattr(stmt, k, None)]
        end = min(x[0].lineno for x in inner) - 1 if inner else stmt.end_lineno
        own = set(range(stmt.lineno, max(end, stmt.lineno) + 1))
        if not own & ran:
            idle |= own
    return idle


def source_lines(obj) -> set:
    """A function's or a class's line numbers, its decorators to its last line, blank lines left
    out."""
    lines, first = inspect.getsourcelines(obj)
    return {i for i, text in enumerate(lines, first) if text.strip()}


def name(code) -> str:
    return f"{own_file(code.co_filename)}:{code.co_qualname}"


def trace(argv: list) -> Tracer:
    """Train brorl.py with argv's flags, tracing its first step and brorl.train's own calls."""
    tracer, rl_step = Tracer(), brorl.rl_step

    def traced_step(*args, **kwargs):
        tracer.in_step = not tracer.step  # the first step alone
        try:
            return rl_step(*args, **kwargs)
        finally:
            tracer.in_step = False

    brorl.rl_step = traced_step
    sys.settrace(tracer)
    try:  # the run's own output to stderr: stdout is the count's
        with contextlib.redirect_stdout(sys.stderr):
            brorl.train(brorl.parse_config(argv))
    finally:
        sys.settrace(None)
        brorl.rl_step = rl_step
    return tracer


def count(tracer: Tracer) -> dict:
    """The step's lines: of each counted file, of each function, of the files beside; the
    no-ops."""
    statements = Statements()
    files, beside, functions, noops = defaultdict(set), defaultdict(set), {}, {}
    ran, idle = defaultdict(set), {}  # the lines that ran, by file; each function's idle code
    for code, calls in tracer.step.items():
        ran[own_file(code.co_filename)] |= {line for c in calls for line in c.lines}
    for code, calls in tracer.step.items():
        path = own_file(code.co_filename)
        if code.co_name.startswith("<"):  # a lambda or a comprehension: inside a function
            continue
        lines = source_lines(code)
        (files if path.parts[0] in COUNTED else beside)[path] |= lines
        functions[name(code)] = len(lines)
        if path.parts[0] in COUNTED and (unrun := idle_lines(code, ran[path]) & lines):
            idle[name(code)] = len(unrun)
        if (why := noop_reason(calls, path, statements)) is not None:
            noops[name(code)] = (len(lines), why)
    for cls in tracer.classes:
        path = own_file(inspect.getfile(cls))
        (files if path.parts[0] in COUNTED else beside)[path] |= source_lines(cls)
        functions[f"{path}:{cls.__qualname__} (a dataclass)"] = len(source_lines(cls))
    for code, calls in tracer.train.items():
        path = own_file(code.co_filename)
        if (why := noop_reason(calls, path, statements)) is not None:
            noops[f"{name(code)} (called by brorl.train)"] = (len(source_lines(code)), why)
    return dict(files={str(p): len(v) for p, v in files.items()},
                beside={str(p): len(v) for p, v in beside.items()}, functions=functions,
                noops=noops, idle=idle)


def report(counted: dict) -> str:
    files, beside, functions, noops = (counted[k] for k in ("files", "beside", "functions",
                                                             "noops"))
    out = [f"one step: {sum(files.values())} lines in {len(files)} files"]
    out += [f"  {n:5d}  {f}" for f, n in sorted(files.items(), key=lambda x: (-x[1], x[0]))]
    out.append(f"beside it: {sum(beside.values())} lines in {len(beside)} files")
    out += [f"  {n:5d}  {f}" for f, n in sorted(beside.items(), key=lambda x: (-x[1], x[0]))]
    out.append(f"functions: {len(functions)}")
    out += [f"  {n:5d}  {f}" for f, n in sorted(functions.items())]
    out.append(f"no-ops: {sum(n for n, _ in noops.values())} lines in {len(noops)} functions")
    out += [f"  {n:5d}  {f}: {why}" for f, (n, why) in sorted(noops.items())]
    idle = counted["idle"]
    out.append(f"idle code: {sum(idle.values())} of the counted lines are code the step did not "
               f"run (branches not taken), in {len(idle)} functions")
    out += [f"  {n:5d}  {f}" for f, n in sorted(idle.items())]
    return "\n".join(out)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        # Two steps, the second an evaluation's: the first is traced, a step as most steps are.
        tracer = trace(["--steps", "2", "--eval_every", "2", "--save", "0", "--out",
                        f"{tmp}/run", *argv])
    print(report(count(tracer)))


if __name__ == "__main__":
    main()
