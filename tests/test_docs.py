"""The text keeps up with the code: every citation resolves, the README's example log line is the
code's own format, and every flag, default and preset the docs name is the code's.

Citation formats (strict, so that they can be checked):
  docs/paper.md §N        a numbered section: docs/paper.md has a heading "## N. ..."
  docs/results/X.md#a     a heading of that page (GitHub's anchor of the heading text)
  [text](path#anchor)     a Markdown link in README.md, docs/*.md, docs/results/*.md: the file, and
                          the heading
  `path`                  a backticked repository path in the docs (`tests/`, `assets/tiny-arith`, `kernels.py`)
  `module.name`           a backticked function or constant of one of our modules: it exists
  python X.py / bash X.sh a command anywhere in the shipped text (docs, docstrings, comments, CI
                          scripts): the path exists as written, from the repository root
                          (`python bench.py` fails: the file is tools/bench.py); python -m tools.X
                          and python -m lib.X: tools/X.py, lib/X.py; torchrun [flags] X.py: X.py
  `--flag`                a flag in the docs: a Config field, or a flag of one of our programs or
                          of the launchers named in EXTERNAL_FLAGS; after `brorl.py` only Config's
  `--flag`, default V     in README.md (or "`--flag` (default V"): V is Config's default
  --preset NAME           NAME is in presets.PRESETS; docs/running.md's presets table agrees with it
"""

import dataclasses
import importlib
import json
import re
import shutil
from pathlib import Path

import brorl
from lib import config, presets
import data

ROOT = Path(__file__).resolve().parent.parent
RESULTS = "docs/results"  # the results book: one page a question, an index, an archive
DOCS = ["README.md", "docs/paper.md", "docs/running.md",
        *sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / RESULTS).glob("*.md"))]
MODULES = ("brorl", "sampler", "kernels", "verify", "data", "harness", "rundir", "steplog",
           "checkpoint", "setup", "evalonly", "massbalance", "bench", "objectives", "policy", "config",
           "diagnostics", "allocation", "distributed", "planner", "balance", "step", "checks",
           "presets", "errors")
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)
FOLDERS = ("", "lib/", "tools/", "tests/")  # where a module may live: the top, the machinery, the programs


def find(root: Path, name: str):
    """The file `name` (x.py, x.sh) at the top or in one of FOLDERS, or None."""
    return next((root / d / name for d in FOLDERS if (root / d / name).is_file()), None)


def import_module(name: str):
    """One of our modules, wherever it lives (`harness` or `lib.harness`, `ablate` or `tools.ablate`)."""
    for prefix in ("", "lib.", "tools."):
        try:
            return importlib.import_module(prefix + name)
        except ModuleNotFoundError as e:
            if e.name not in (prefix + name, prefix.rstrip(".")):
                raise
    raise ModuleNotFoundError(name)


def text_files(root: Path) -> list:
    """Every file whose text ships: code, CI scripts, docs."""
    files = [*root.glob("*.py"), *root.glob("*.sh"), *root.glob("*.md"), *root.glob("*.txt"), *root.glob("*.ini"),
             *root.glob("tests/*.py"), *root.glob("lib/*.py"), *root.glob("tools/*.py"), *root.glob("tools/*.sh"),
             *root.glob(".ci/*"), *root.glob("docs/*.md"), *root.glob("docs/results/*.md"),
             *root.glob("assets/**/*.md")]
    return sorted(f for f in files if f.is_file())


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md: str) -> set:
    """The anchors of a Markdown file's headings (outside code blocks), duplicates numbered as GitHub does."""
    seen, out = {}, set()
    for line in FENCE.sub("", md).splitlines():
        if m := re.match(r"#{1,6}\s+(.+?)\s*#*$", line):
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def numbered_sections(md: str) -> set:
    """N for every heading '## N. title' (what `docs/paper.md §N` points at)."""
    return set(re.findall(r"^##\s+(\d+)\.\s", FENCE.sub("", md), flags=re.M))


def citation_problems(root: Path) -> list:
    """`X.md §N` and `X.md#anchor` anywhere in the shipped text, each checked against its file. A
    name that opens a string literal ("report.md", a file the code writes under a folder it joins)
    is not a citation."""
    cite = re.compile(r"(?<![\w/.\-\"'])((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+)|\s§(\d+))?")
    problems = []
    for f in text_files(root):
        if f.name == "test_docs.py":
            continue
        for lineno, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in cite.finditer(line):
                path, anchor, section = m.groups()
                where = f"{f.relative_to(root)}:{lineno}: {m.group(0)}"
                target = root / path
                if not target.is_file() and f.suffix == ".md":  # a page names its neighbours by name
                    target = f.parent / path
                if not target.is_file():
                    problems.append(f"{where}: no file {path}")
                elif anchor and anchor not in anchors(target.read_text()):
                    problems.append(f"{where}: {path} has no heading with anchor #{anchor}")
                elif section and section not in numbered_sections(target.read_text()):
                    problems.append(f"{where}: {path} has no section '## {section}. ...'")
    return problems


def link_problems(root: Path) -> list:
    """Markdown links [text](target) in the docs: the file exists, and so does the heading."""
    problems = []
    for doc in DOCS:
        src = root / doc
        md = FENCE.sub("", src.read_text())
        for m in re.finditer(r"\[[^\]]*\]\(([^)\s]+)\)", md):
            target = m.group(1)
            if re.match(r"[a-z]+://", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (src.parent / path).resolve() if path else src
            if not dest.exists():
                problems.append(f"{doc}: link ({target}): no file {path}")
            elif anchor and anchor not in anchors(dest.read_text()):
                problems.append(f"{doc}: link ({target}): no heading with anchor #{anchor}")
    return problems


def ignored_folders(root: Path) -> set:
    """The top-level folders .gitignore keeps out of the repository (`runs/`, `.venv/`): what a run
    or an install makes there is not a repository path, whether or not it exists yet."""
    ignore = root / ".gitignore"
    lines = ignore.read_text().splitlines() if ignore.is_file() else []
    return {line.strip("/") for line in lines if line.endswith("/") and "*" not in line}


def path_problems(root: Path) -> list:
    """Backticked repository paths in the docs exist. A backticked path counts when it names a module
    (x.py, x.sh, x.md: at the top or in one of FOLDERS, so `harness.py` is lib/harness.py) or starts
    with a folder the repository has; run outputs (`runs/...`, `metrics.jsonl`) are not repository
    paths; a pattern (`bench*.py`) is not checked. Commands: command_problems."""
    problems = []
    folders = {p.name for p in root.iterdir() if p.is_dir()} - ignored_folders(root)
    for doc in DOCS:
        md = (root / doc).read_text()
        for span in re.findall(r"`([^`\n]+)`", md):
            if " " in span or "<" in span or "*" in span:
                continue
            top = span.split("/")[0]
            is_module = "/" not in span and re.fullmatch(r"[\w-]+\.(py|sh|md)", span)
            if is_module and not ((root / span).exists() or find(root, span)):
                problems.append(f"{doc}: `{span}` does not exist")
            elif "/" in span and top in folders and not (root / span).exists():
                problems.append(f"{doc}: `{span}` does not exist")
    return problems


# A command as a reader would type it from the repository root: python X.py, python tools/x.py,
# bash X.sh, bash .ci/X, torchrun [flags] X.py (the path, as written); python -m tools.x or lib.x (the
# module's file; tools.X, in capitals, is a placeholder). python -m pytest, venv, ...: not ours.
COMMAND = re.compile(r"\b(?:python3?|bash)\s+((?:[\w.-]+/)*[\w.-]+\.(?:py|sh)|\.ci/\w+)(?![\w/])"
                     r"|\bpython3?\s+-m\s+((?:tools|lib)\.[a-z]\w*)\b"
                     r"|\btorchrun\s+(?:--[\w-]+(?:=\S+)?\s+)*([\w./-]+\.py)\b")


def command_problems(root: Path) -> list:
    """Every command in the shipped text (the docs, the code's docstrings, --help and comments, the CI
    scripts) names a file that exists where the command says: `python bench.py` fails, the file being
    tools/bench.py (`python -m tools.bench`), though `bench.py` alone in prose finds it."""
    problems = []
    for f in text_files(root):
        if f.name == "test_docs.py":  # its own examples, placeholders and broken cases
            continue
        for lineno, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in COMMAND.finditer(line):
                path, module, launched = m.groups()
                target = path or launched or module.replace(".", "/") + ".py"
                if not (root / target).is_file():
                    problems.append(f"{f.relative_to(root)}:{lineno}: `{m.group(0)}`: no file {target} "
                                    f"(commands run from the repository root)")
    return problems


def name_problems(root: Path) -> list:
    """Backticked `module.name` in the docs: that module has that name (functions named in the
    README's step, constants cited by docs/paper.md)."""
    problems = []
    for doc in DOCS:
        for mod, name in re.findall(rf"`({'|'.join(MODULES)})\.(\w+)`", (root / doc).read_text()):
            if name in ("py", "md", "json", "jsonl"):  # a file (`config.json`), not a name
                continue
            if not hasattr(import_module(mod), name):
                problems.append(f"{doc}: `{mod}.{name}`: {mod}.py has no {name}")
    return problems


def code_name_problems(root: Path) -> list:
    """`module.name` in the code's comments and docstrings (not its code, where a local variable may
    share a module's name): that module has that name. A file name (brorl.py, config.json) is no
    such reference."""
    import io
    import tokenize
    cite = re.compile(rf"(?<![\w./-])({'|'.join(MODULES)})\.([A-Za-z_]\w*)")
    problems = []
    for f in text_files(root):
        if f.suffix != ".py" or f.name == "test_docs.py":
            continue
        for t in tokenize.generate_tokens(io.StringIO(f.read_text()).readline):
            text = t.string
            if not (t.type == tokenize.COMMENT or t.type == tokenize.STRING
                    and text.lstrip("rbuRBU").startswith(('"""', "'''"))):
                continue
            problems += [f"{f.relative_to(root)}:{t.start[0]}: {mod}.{name}: {mod}.py has no {name}"
                         for mod, name in cite.findall(text)
                         if name not in ("py", "md", "json", "jsonl", "sh", "txt", "png")
                         and not hasattr(import_module(mod), name)]
    return problems


# Flags of programs that are not ours, as the docs use them: PyTorch's launcher, pip, argparse's help
EXTERNAL_FLAGS = {"standalone", "nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "index-url", "help",
                  "target", "no-index", "no-deps", "timeout",  # pip install --no-index --no-deps --target; pytest-timeout
                  "python-version", "only-binary"}  # pip download for another Python
FLAG = re.compile(r"(?<![\w-])--([a-zA-Z][\w-]*)")


def config_defaults() -> dict:
    return {f.name: f.default for f in dataclasses.fields(brorl.Config)}


def program_flags(root: Path) -> set:
    """Every flag one of our programs accepts: the string literals "--x" in their source (argparse's
    add_argument, sys.argv checks), --no-x beside a BooleanOptionalAction, and the fields of the
    dataclasses that are flags (brorl's Config; data.py's WarmStart, `python data.py build`)."""
    flags = set(config_defaults()) | {f.name for f in dataclasses.fields(data.WarmStart)}
    for f in [*root.glob("*.py"), *root.glob("lib/*.py"), *root.glob("tools/*.py")]:
        if f.name.startswith("test_"):  # test_brorl.py at the top: a test's "--x" is no flag of ours
            continue
        src = f.read_text()
        flags |= set(re.findall(r"""["']--([a-zA-Z][\w-]*)["']""", src))
        flags |= {"no-" + x for x in re.findall(r"""add_argument\(\s*["']--([\w-]+)["'][^)]*BooleanOptionalAction""", src)}
    return flags


def command_texts(md: str) -> list:
    """The places a command can be written: each line of a code block (continuations joined) and
    each backticked span outside them."""
    blocks = [ln for block in FENCE.findall(md) for ln in block.replace("\\\n", " ").splitlines()]
    return blocks + re.findall(r"`([^`\n]+)`", FENCE.sub("", md))


def flag_problems(root: Path) -> list:
    """Every --flag in the docs is one that something accepts; a flag given to brorl.py is a Config field."""
    known, fields = program_flags(root) | EXTERNAL_FLAGS, set(config_defaults()) | {"help"}
    problems = []
    for doc in DOCS:
        md = (root / doc).read_text()
        for lineno, line in enumerate(md.splitlines(), 1):
            problems += [f"{doc}:{lineno}: --{f} is no Config field nor a flag of our programs"
                         for f in FLAG.findall(line) if f not in known]
        for text in command_texts(md):
            if "brorl.py " in text:
                args = text.rsplit("brorl.py ", 1)[1].split(" #")[0]
                problems += [f"{doc}: `brorl.py ... --{f}`: brorl.py has no --{f}"
                             for f in FLAG.findall(args) if f not in fields]
    return problems


def same_value(quoted: str, value) -> bool:
    """A value as the docs write it (16,384; 0.2; a path relative to the repository) against the code's."""
    quoted = quoted.strip("`").replace(",", "")
    if isinstance(value, bool):
        return quoted.lower() in (("1", "true", "on") if value else ("0", "false", "off"))
    if isinstance(value, (int, float)):
        try:
            return float(quoted) == value
        except ValueError:
            return False
    parts = Path(quoted).parts
    return quoted == value or (len(parts) > 1 and Path(value).parts[-len(parts):] == parts)


def default_problems(root: Path) -> list:
    """Defaults README.md and docs/running.md quote, written "`--flag`, default V" or "`--flag`
    (default V": V is Config's."""
    defaults = config_defaults()
    return [f"{doc}: `--{flag}`, default {v}: " + (f"the code's default is {defaults[flag]!r}"
                                                   if flag in defaults else "no such Config field")
            for doc in ("README.md", "docs/running.md")
            for flag, v in re.findall(r"`--(\w+)`(?:, | \()default ([\w.+-]+)", (root / doc).read_text())
            if flag not in defaults or not same_value(v, defaults[flag])]


def preset_problems(root: Path) -> list:
    """Every `--preset NAME` in the docs exists, and every row of docs/running.md's presets table is that preset:
    model and task (or "your ..." where the preset leaves them to the user), N x B, new tokens (and the
    eval's, when quoted)."""
    problems = []
    for doc in DOCS:
        for name in re.findall(r"--preset[ =]([\w.-]+)", (root / doc).read_text()):
            if name not in presets.PRESETS and not name.isupper():  # X, NAME: a placeholder
                problems.append(f"{doc}: --preset {name}: no such preset (presets.PRESETS: {sorted(presets.PRESETS)})")
    md = (root / "docs/running.md").read_text()
    header = "\n| preset | model | task | N x B | new tokens |"
    table = md.split(header, 1)[1].split("\n\n", 1)[0] if header in md else ""
    rows = re.findall(r"^\| `([\w.-]+)` \| (.+) \|$", table, flags=re.M)
    if not rows:
        return problems + ["docs/running.md: no presets table (| preset | model | task | N x B | new tokens |)"]
    for name, rest in rows:
        if name not in presets.PRESETS:
            problems.append(f"docs/running.md presets table: {name}: no such preset")
            continue
        preset, cfg = presets.PRESETS[name], {**config_defaults(), **presets.PRESETS[name]}
        model, task, nb, tokens = (c.strip() for c in rest.split(" | "))
        for flag, cell in (("model", model), ("task", task)):
            if (flag in preset) if cell.startswith("your") else not same_value(cell, cfg[flag]):
                problems.append(f"docs/running.md presets table: {name}'s {flag} is {cell}, the code's {cfg[flag]!r}")
        n, b = nb.split(" x ")
        if not (same_value(n, cfg["n_rollouts"]) and same_value(b, cfg["prompts_per_step"])):
            problems.append(f"docs/running.md presets table: {name} is {nb}, "
                            f"the code's {cfg['n_rollouts']} x {cfg['prompts_per_step']}")
        m = re.fullmatch(r"([\d,]+)(?: \(eval ([\d,]+)\))?", tokens)
        want_eval = cfg["eval_max_new_tokens"] or cfg["max_new_tokens"]
        if not m or not same_value(m[1], cfg["max_new_tokens"]) or (m[2] and not same_value(m[2], want_eval)):
            problems.append(f"docs/running.md presets table: {name}'s new tokens are {tokens}, the code's "
                            f"{cfg['max_new_tokens']} (eval {want_eval})")
    return problems

def shape(line: str) -> str:
    """A log line with every number replaced by its format: integers -> 9, 0.980 -> 9.999,
    3.3e-06 -> 9.9e~; runs of spaces collapsed (the step is right-aligned)."""
    line = re.sub(r"e[+-]\d+", "e~", line)
    line = re.sub(r"\d+(\.\d+)?", lambda m: "9" + ("." + "9" * (len(m.group(1)) - 1) if m.group(1) else ""), line)
    return " ".join(line.split())


class AnyMetrics(dict):
    """A metrics dict that has every key (value 1), so steplog.log_line prints all of its fields;
    but --alloc adaptive's (alloc_*): the README's example is a run of the default, uniform rule."""

    def __getitem__(self, key):
        return 1

    def get(self, key, default=None):
        return 1

    def __contains__(self, key):
        return not key.startswith("alloc_")


def readme_log_line(root: Path) -> str:
    """The example log line: the 'step ...' line of the code block in README's 'What you will see'."""
    md = (root / "README.md").read_text()
    assert "\n## What you will see\n" in md, "README.md has no section '## What you will see'"
    section = md.split("\n## What you will see\n", 1)[1].split("\n## ", 1)[0]
    lines = [ln for block in FENCE.findall(section) for ln in block.splitlines() if ln.startswith("step ")]
    assert len(lines) == 1, f"README.md, 'What you will see': expected one example log line, found {len(lines)}"
    return lines[0]


def log_line_problems(root: Path) -> list:
    problems = []
    line = readme_log_line(root)
    want = import_module("steplog").log_line(AnyMetrics())
    if shape(line) != shape(want):
        problems.append(f"README.md's example log line is not steplog.log_line's format:\n"
                        f"  README: {line}\n  code:   {want}")
    # the example comes from a recorded run: its results page names it, with its eval numbers on one
    # line (pass@1, pass@k, the probe's Q) and its exact Q on the page
    m = re.search(r"eval pass@1 ([\d.]+) pass@k ([\d.]+) probe Q ([\d.]+) exact Q ([\d.]+)", line)
    page = (root / RESULTS / "default-run.md").read_text()
    if not m:
        problems.append("README.md: the example log line has no eval part (pick an eval step)")
    elif not any(all(v in ln for v in m.groups()[:3]) for ln in page.splitlines()) or m[4] not in page:
        problems.append(f"README.md's example log line (pass@1 {m[1]}, pass@k {m[2]}, probe Q {m[3]}, exact Q "
                        f"{m[4]}) is not the run recorded in {RESULTS}/default-run.md")
    return problems


# ----------------------------------------------------------------------------
# The checks, on this repository


def test_citations_resolve():
    assert citation_problems(ROOT) == []


def test_markdown_links_resolve():
    assert link_problems(ROOT) == []


def test_paths_in_docs_exist():
    assert path_problems(ROOT) == []


def test_run_outputs_are_not_repository_paths(tmp_path, monkeypatch):
    """A run's folder made by the README's first command (`runs/`, ignored by git) does not turn the
    docs' run paths into missing repository paths; a missing path in a tracked folder still counts."""
    (tmp_path / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    (tmp_path / "runs" / "arith-1").mkdir(parents=True)
    (tmp_path / "assets").mkdir()
    (tmp_path / "README.md").write_text("See `runs/smollm2-breadth-n16` and `assets/missing.json`.\n")
    monkeypatch.setitem(globals(), "DOCS", ["README.md"])
    assert path_problems(tmp_path) == ["README.md: `assets/missing.json` does not exist"]


def test_commands_in_the_text_run_as_written():
    assert command_problems(ROOT) == []


def test_named_functions_exist():
    assert name_problems(ROOT) == []


def test_names_in_the_codes_comments_exist():
    assert code_name_problems(ROOT) == []


def test_readme_log_line_is_the_codes_format():
    assert log_line_problems(ROOT) == []


def test_flags_defaults_and_presets_in_docs_are_the_codes():
    assert flag_problems(ROOT) == []
    assert default_problems(ROOT) == []
    assert preset_problems(ROOT) == []


def test_preset_help_lists_every_preset(capsys):
    try:
        brorl.parse_config(["--help"])
    except SystemExit:
        pass
    helptext = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert all(name in helptext for name in presets.PRESETS), helptext


def test_readme_lists_every_module():
    """The README's file table names every module at the top, in lib/ and in tools/ (by name or by a
    pattern such as `bench*.py`), and the tests folder."""
    import fnmatch
    md = (ROOT / "README.md").read_text()
    assert "\n## Where to read on\n" in md, "README.md has no section '## Where to read on'"
    table = md.split("\n## Where to read on\n", 1)[1]
    named = [s.split("/")[-1] for s in re.findall(r"`([^`\n]+)`", table)]
    modules = [*ROOT.glob("*.py"), *ROOT.glob("lib/*.py"), *ROOT.glob("tools/*.py")]
    missing = [p.name for p in modules if p.name != "__init__.py" and not any(fnmatch.fnmatch(p.name, n) for n in named)]
    assert missing == [] and "`tests/`" in table, f"not in README's file table: {missing}"


def test_help_gives_each_flag_one_default():
    """A field's comment that names its default writes it "(default: ...)", so that --help adds no second one."""
    helps = config.field_help(brorl.Config)
    assert [n for n, text in helps.items() if "default" in text and text.count("(default:") != 1] == []


def test_embedded_model_size_is_the_same_everywhere():
    """Every "embedded ... N.NNM" (and "`assets/tiny-arith` (N.NNM") in the docs is the shipped model's size."""
    from transformers import AutoModelForCausalLM
    size = f"{sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(data.EMBEDDED_MODEL).parameters()) / 1e6:.2f}"
    pattern = re.compile(r"(?:embedded|tiny-arith`)\D{0,12}?(\d+(?:\.\d+)?)M\b")
    found = [(doc, x) for doc in [*DOCS, "brorl.py"] for x in pattern.findall((ROOT / doc).read_text())]
    assert found and all(x == size for _, x in found), (size, found)


def readme_brorl_commands() -> list:
    """The `python brorl.py ...` lines of the code blocks of README.md and docs/running.md, as argument
    lists (a placeholder's line left out)."""
    lines = [ln for doc in ("README.md", "docs/running.md") for block in FENCE.findall((ROOT / doc).read_text())
             for ln in block.replace("\\\n", " ").splitlines()]
    return [ln.split(" #")[0].split("brorl.py", 1)[1].split() for ln in lines
            if ln.startswith("python brorl.py") and "<" not in ln]


def test_readme_commands_parse_and_name_each_objective():
    """Every README `python brorl.py` line is a valid config; one line each runs GSPO, CISPO, SAPO, Dr. GRPO, PODS and
    LoRA (at 10x full fine-tuning's lr, as the objectives page's study), and the paper's eval protocol is the
    paper preset's, on a benchmark given as --eval_task (all its rows), never as --task (its ~10% test split)."""
    cfgs = [brorl.parse_config(args) for args in readme_brorl_commands()]
    default = brorl.Config()
    wanted = {"GSPO": lambda c: c.loss == "gspo" and c.loss_agg == "sequence",
              "CISPO": lambda c: c.loss == "cispo",
              "SAPO": lambda c: c.loss == "sapo" and c.loss_agg == "sequence",
              "Dr. GRPO": lambda c: c.loss == "ppo" and c.adv_norm == "none" and c.loss_agg == "constant",
              "PODS": lambda c: 0 < c.train_rollouts < c.n_rollouts,
              "LoRA": lambda c: c.lora_rank > 0 and c.lr == 10 * default.lr}
    assert [name for name, ok in wanted.items() if not any(ok(c) for c in cfgs)] == []
    paper = {**dataclasses.asdict(default), **presets.PRESETS["paper"]}
    evals = [c for c in cfgs if c.eval_only and c.eval_task.startswith("math:")]  # (arith's: a testbed measured)
    assert not [c for c in cfgs if c.eval_only and c.task.startswith("math:")]
    assert evals and all((c.eval_max_new_tokens or c.max_new_tokens) == paper["eval_max_new_tokens"]
                         and c.eval_samples == paper["eval_samples"] for c in evals)


def test_readme_loss_is_the_codes_lines():
    """README's loss block, line for line: the names it assigns are the ones brorl.ppo_token_loss, then
    brorl.token_loss, assign, in order; its numbers are Config's defaults."""
    import ast
    import inspect
    md = (ROOT / "README.md").read_text()
    block = md.split("**The loss**", 1)[1].split("```", 2)[1]
    readme = [ln.split("=")[0].strip() for ln in block.splitlines() if "=" in ln]

    def assigned(fn, skip=()):
        body = ast.parse(inspect.getsource(fn).strip()).body[0].body
        return [t.id for node in body if isinstance(node, ast.Assign) for t in node.targets
                if isinstance(t, ast.Name) and t.id not in skip]
    # ppo_token_loss's `a` is adv along T; token_loss's first line calls the objective (its first three lines)
    code = assigned(brorl.ppo_token_loss, skip=("a",)) + assigned(brorl.token_loss)
    assert readme == code, (readme, code)
    cfg = brorl.Config()
    assert f"clamp(ratio, 1 - {cfg.clip_low:g}, 1 + {cfg.clip_high:g})" in block and f"min(pg, {cfg.clip_ratio_c:g} |A|)" in block


def test_readme_objective_figures_are_the_notebooks():
    """The pass@1 figures README's Objectives paragraph quotes are its results page's; that page's table of
    the arms says what each shared and kept, its flags each that arm's."""
    md, notes = (ROOT / "README.md").read_text(), (ROOT / RESULTS / "objectives.md").read_text()
    paragraph = md.split("**Objectives**", 1)[1].split("\n\n", 1)[0]
    figures = re.findall(r"\b0\.\d{3}\b", paragraph)
    assert len(figures) >= 4 and [x for x in figures if x not in notes] == []
    header = "| arm | flags | advantage | aggregation | kept from PPO's recipe |"
    assert header in notes
    rows = re.findall(r"^\| ([^|]+) \| `([^`]+)` \|", notes.split(header, 1)[1].split("\n\n", 1)[0], flags=re.M)
    arms = {name.split(" (")[0]: brorl.parse_config(flags.split()) for name, flags in rows}
    assert arms["PPO"].loss == "ppo" and arms["GSPO"].loss == "gspo" and arms["CISPO"].loss == "cispo"
    assert arms["SAPO"].loss == "sapo" and arms["SAPO"].loss_agg == "sequence"
    assert arms["Dr. GRPO"].adv_norm == "none" and all(a.adv_norm == "batch" for n, a in arms.items() if n != "Dr. GRPO")


# ----------------------------------------------------------------------------
# The checks can fail: the same functions on a copy of the repository's text, broken on purpose


def copy_text(tmp_path: Path) -> Path:
    for f in text_files(ROOT):
        dest = tmp_path / f.relative_to(ROOT)
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, dest)
    for folder in ("assets", "tests"):  # paths the docs cite
        shutil.copytree(ROOT / folder, tmp_path / folder, dirs_exist_ok=True)
    return tmp_path


def test_checks_catch_broken_citations(tmp_path):
    root = copy_text(tmp_path)
    assert citation_problems(root) == [] and link_problems(root) == [] and path_problems(root) == []
    assert command_problems(root) == []
    (root / "x.py").write_text('"""See docs/paper.md §9, docs/results/README.md#no-such-heading and PAPER.md."""\n')
    found = citation_problems(root)
    assert len(found) == 3, found
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "\n[gone](docs/nothing.md) [bad](docs/results/README.md#nope) `assets/none.bin` "
                      "`python nothere.py` `python -m tools.nothere` `gone.py` `brorl.no_such_function`\n")
    assert len(link_problems(root)) == 2
    assert len(path_problems(root)) == 2  # assets/none.bin, gone.py
    assert len(command_problems(root)) == 2  # nothere.py, tools.nothere
    assert len(name_problems(root)) == 1
    assert code_name_problems(root) == []
    (root / "y.py").write_text('# brorl.step_metrics writes it (it is steplog.step_metrics); brorl.py\n'
                               'x = 1  # see sampler.generate\n"""config.no_such and config.json."""\n')
    found = code_name_problems(root)
    assert len(found) == 2 and "brorl.step_metrics" in found[0] and "config.no_such" in found[1], found


def test_checks_catch_stale_commands(tmp_path):
    """A command that names a file outside the folder it lives in fails, though the file exists: the
    programs are in tools/ (python -m tools.X), the machinery in lib/."""
    root = copy_text(tmp_path)
    assert command_problems(root) == []
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "\n`python bench.py --tiny` and `bash bench_trl.sh`\n\n```bash\n"
                      "OMP_NUM_THREADS=1 python ablate.py --grid lr=1e-4,2e-4\ntorchrun --standalone harness.py\n```\n")
    bench = root / "tools" / "bench.py"
    bench.write_text(bench.read_text().replace("python -m tools.bench --part gpu", "python memcheck.py --part gpu"))
    found = command_problems(root)
    stale = ("python bench.py", "bash bench_trl.sh", "python ablate.py", "harness.py", "python memcheck.py")
    assert len(found) == 5 and all(x in " ".join(found) for x in stale), found
    assert [x.split(":")[0] for x in found] == ["README.md"] * 4 + ["tools/bench.py"], found


def test_checks_catch_wrong_flags_defaults_and_presets(tmp_path):
    root = copy_text(tmp_path)
    readme, running = root / "README.md", root / "docs/running.md"
    before = [len(check(root)) for check in (flag_problems, default_problems, preset_problems)]
    md, table = readme.read_text(), running.read_text()
    assert "(`--n_rollouts`, default 512)" in md and "| 256 x 16 | 512 |" in table
    md = md.replace("(`--n_rollouts`, default 512)", "(`--n_rollouts`, default 16)")  # a stale default
    running.write_text(table.replace("| 256 x 16 | 512 |", "| 256 x 8 | 512 |"))  # a stale preset
    md += "\n`--no_such_flag` `python brorl.py --grid n_rollouts=16` `--preset nonesuch`\n"
    readme.write_text(md)
    after = [len(check(root)) for check in (flag_problems, default_problems, preset_problems)]
    # --no_such_flag anywhere; --grid is ablate's, not brorl.py's; a default; a table row and a name
    assert [a - b for a, b in zip(after, before)] == [2, 1, 2], (before, after)


def test_checks_catch_a_stale_log_line(tmp_path):
    root = copy_text(tmp_path)
    assert log_line_problems(root) == []
    readme = root / "README.md"
    line = readme_log_line(root)
    readme.write_text(readme.read_text().replace(line, line.replace(" | keep ", " | keep 1.00 | kept ")))
    assert "not steplog.log_line's format" in log_line_problems(root)[0]
    readme.write_text(readme.read_text().replace(line.replace(" | keep ", " | keep 1.00 | kept "),
                                                 line.replace(" Q 0.", " Q 1.")))
    assert "is not the run recorded in docs/results/default-run.md" in log_line_problems(root)[0]


# ----------------------------------------------------------------------------
# Facts stated in more than one place agree with each other and with the code


def test_readme_fits_in_12_kb():
    assert len((ROOT / "README.md").read_bytes()) <= 12 * 1024


def test_the_results_book_fits_in_120_kb():
    """The current pages of the results book (every docs/results/*.md but the archive, which holds
    what moved off them) are at most 120 KB together."""
    pages = [p for p in (ROOT / RESULTS).glob("*.md") if p.name != "archive.md"]
    total = sum(len(p.read_bytes()) for p in pages)
    assert pages and total <= 120 * 1024, f"{total} bytes: move detail into {RESULTS}/archive.md"


def readme_legend() -> dict:
    """README's legend of the step line: field -> its row's text."""
    md = (ROOT / "README.md").read_text()
    table = md.split("| field | what it is", 1)[1].split("\n\n", 1)[0]
    rows = re.findall(r"^\| `([^`]+)`(?:, `([^`]+)`)? \| (.+)$", table, flags=re.M)
    return {name: text for a, b, text in rows for name in (a, b) if name}


def test_readme_legend_explains_every_field_of_the_step_line():
    """Every field of steplog.log_line has a legend row naming the metrics.jsonl key that log_line
    prints for it; the shares say so; a field the legend calls 0 in fp32 is 0 in the example."""
    import inspect
    line, legend = import_module("steplog").log_line(AnyMetrics()), readme_legend()
    fields = []
    for segment in line.split(" | "):  # a segment: labels, each followed by its number
        label = []
        for word in segment.split():
            if re.fullmatch(r"[\d.e+-]+s?", word):
                fields.append(" ".join(label))
                label = []
            else:
                label.append(word)
        fields += [" ".join(label)] if label else []
    fields = [f.replace("|r-1|", "\\|r-1\\|") for f in fields if f not in ("", "step")]
    assert set(fields) <= set(legend), (fields, sorted(legend))
    source = inspect.getsource(import_module("steplog").log_line)
    for text in legend.values():
        assert all(key in source for key in re.findall(r"`(\w+(?:@\w+)?)`", text.split("|")[0])
                   if key.islower() and "_" in key or "@" in key), text
    assert "share" in legend["keep"] and "share" in legend["clip"]
    example = dict(re.findall(r"(\|r-1\||drift) ([\d.e+-]+)", readme_log_line(ROOT)))
    for name, text in legend.items():
        if "0 in fp32" in text:
            assert float(example[name.replace("\\|", "|")]) == 0, (name, example)


def test_probe_q_and_exact_q_are_named_apart():
    """The log line, the README and every page call the sampled mass the probe's Q and the computed
    one the exact Q; no text calls mass_mean anything but the probe's."""
    line = import_module("steplog").log_line(AnyMetrics())
    assert " probe Q " in line and " exact Q " in line and " | Q " not in line
    legend = readme_legend()
    assert "sampled" in legend["probe Q"] and "computed" in legend["exact Q"]
    for doc in DOCS:
        for ln in (ROOT / doc).read_text().splitlines():
            assert "mass_mean`" not in ln or "probe" in ln, (doc, ln)


def test_the_plateau_figure_is_the_same_everywhere():
    """data.py's comment quotes the plateau's median exact Q as its results page measured it."""
    page = (ROOT / RESULTS / "plateau.md").read_text()
    measured = float(re.search(r"never\s+right have a median log10 Q of (-[\d.]+)", page)[1])
    quoted = re.search(r"median Q ~ 1e-(\d+): docs/results/plateau.md", (ROOT / "data.py").read_text())
    assert quoted and int(quoted[1]) == round(-measured), (measured, quoted)


def test_the_map_names_every_log_prob_function_in_use():
    """brorl.py's docstring names every function of kernels.py that our modules import."""
    used = set()
    for f in [*ROOT.glob("*.py"), *ROOT.glob("lib/*.py")]:
        if f.name.startswith("test_"):
            continue
        for names in re.findall(r"^from kernels import (.+)$", f.read_text(), flags=re.M):
            used |= {n.strip() for n in names.split("#")[0].split(",")}
    assert used and [n for n in used if f"kernels.{n}" not in brorl.__doc__] == []


def test_the_theorem_is_read_by_analogy():
    """Theorem 1 is about one softmax over free logits: no text says it is about a prompt's Q(x), or
    that it applies to the simulation or a policy directly; the probe's rose/fell are shares."""
    wrong = re.compile(r"Theorem 1( and Lemma 2)? (is|are) about (Q\(x\)|a prompt's)|Theorem 1 applies"
                       r"|how many probe prompts")
    found = [(f.relative_to(ROOT).as_posix(), m[0]) for f in text_files(ROOT) if f.name != "test_docs.py"
             for m in wrong.finditer(" ".join(f.read_text().split()))]
    assert found == []


def test_supported_versions_say_what_ci_tests():
    """CI's oldest end installs no torch (the pinned one serves both ends): wherever the range is
    stated, it says torch 2.11 and 2.12 are untested in CI."""
    ci = (ROOT / ".ci/run").read_text()
    assert not re.search(r"--target \S+ [^\n]*torch==", ci)
    for doc in ("requirements.txt", "docs/running.md", f"{RESULTS}/versions.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert "torch 2.11 and 2.12" in text and ("not tested in CI" in text or "untested in CI" in text), doc


def test_no_session_words_in_the_product():
    """A run is a run, or a segment of one; 'session' names nothing of ours."""
    files = [*ROOT.glob("*.py"), *ROOT.glob("lib/*.py"), *ROOT.glob("tools/*.py"),
             *[ROOT / d for d in DOCS]]
    assert [f.name for f in files if re.search(r"\bsessions?\b", f.read_text())] == []


def test_assets_record_their_own_path():
    """Every shipped warm start records its own relative path (or none), never a build machine's."""
    import json
    for f in ROOT.glob("assets/*/warmstart.json"):
        out = json.loads(f.read_text())["config"].get("out")
        assert out in (None, f.parent.relative_to(ROOT).as_posix()), (f, out)


def test_results_book_pages_open_with_answer_command_commit_machine():
    """Each page: a question, its answer, the command in a code block, the commit and the machine;
    the index links every page, and the archive holds what was superseded."""
    pages = sorted((ROOT / RESULTS).glob("*.md"))
    index = (ROOT / RESULTS / "README.md").read_text()
    for p in pages:
        if p.name in ("README.md", "archive.md"):
            continue
        head = p.read_text().split("\n## ", 1)[0]
        assert head.startswith("# ") and "\n**Answer.** " in head, p.name
        assert "```bash\n" in head and "Commit:" in head and "Machine:" in head, p.name
        assert f"]({p.name})" in index, f"the index does not link {p.name}"
    assert "](archive.md)" in index


# Every Python file is held to 100 columns (CONTRIBUTING.md, rule 1) but these, written before the
# rule reached tools/ and tests/: held to 150, and taken off this list when reflowed. A new file
# is not added here.
WIDE_LIMIT = 150  # columns a WIDE_FILES entry may use (CONTRIBUTING.md, rule 1, says so)
WIDE_FILES = (".ci/padded_logprobs.py", "tools/ablate.py", "tools/bench.py",
              "tools/bench_kernels.py", "tools/bench_trl.py", "tools/breadth_study.py",
              "tools/massbalance.py", "tools/memcheck.py",
              *(f"tests/test_{name}.py" for name in (
                  "ablate", "bad_inputs", "cli", "data", "distributed", "docs",
                  "kernels", "linear_logprobs", "lora", "mass", "objectives", "onegpu",
                  "readme_commands", "recipe", "rehearsal", "report", "revival_study", "sampler",
                  "tasks", "theorem1_study", "update")))


def python_files(root: Path) -> list:
    """Every Python file of the repository (at the top, lib/, tools/, tests/, .ci/), relative."""
    return sorted(p.relative_to(root).as_posix() for folder in ("", "lib/", "tools/", "tests/", ".ci/")
                  for p in root.glob(f"{folder}*.py"))


def width_problems(root: Path) -> list:
    """Lines wider than their file's limit: 100 columns, WIDE_LIMIT for WIDE_FILES; and any entry of
    WIDE_FILES that no longer needs it (reflowed: take it off the list)."""
    problems = []
    for name in python_files(root):
        lines = (root / name).read_text().splitlines()
        limit = WIDE_LIMIT if name in WIDE_FILES else 100
        problems += [f"{name}:{i}: {len(line)} columns (at most {limit})"
                     for i, line in enumerate(lines, 1) if len(line) > limit]
        if name in WIDE_FILES and all(len(line) <= 100 for line in lines):
            problems.append(f"{name}: fits 100 columns now: take it off WIDE_FILES")
    return problems


def test_python_files_fit_their_columns():
    """A file is not made short by making its lines wide: every Python file at most 100 columns,
    the older wide ones (WIDE_FILES) at most 150, and none of those already narrow."""
    assert width_problems(ROOT) == []


LIB_LINES = 400  # lines a file of lib/ may hold (CONTRIBUTING.md, rule 1)


def long_lib_files(root: Path) -> list:
    """The files of root/lib/ longer than LIB_LINES, each named with its length."""
    return [f"lib/{p.name}: {n} lines (at most {LIB_LINES}: split it by its ideas)"
            for p in sorted((root / "lib").glob("*.py"))
            if (n := len(p.read_text().splitlines())) > LIB_LINES]


def test_lib_files_are_read_in_one_sitting(tmp_path):
    """Every file of lib/ at most LIB_LINES lines; a file one line over is caught, one at the cap
    is not."""
    assert long_lib_files(ROOT) == []
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "at_cap.py").write_text("x = 1\n" * LIB_LINES)
    (tmp_path / "lib" / "over.py").write_text("x = 1\n" * (LIB_LINES + 1))
    assert long_lib_files(tmp_path) == [f"lib/over.py: {LIB_LINES + 1} lines (at most {LIB_LINES}: "
                                        "split it by its ideas)"]


# Numbers the text quotes, held against the raw files they come from


def report_p_values(report: str) -> list:
    """Every p-value a study's report writes: `p 0.0131`, `, 0.002 |` in its tests' tables."""
    ps = re.findall(r"\bp (\d[\d.]*(?:e-\d+)?)", report)
    ps += re.findall(r"\| -?[\d.]+, (\d[\d.]*) \| (\d[\d.]*) \|", report)  # (Welch p, MW p)
    # (paired t p, sign p) of a paired table: | arm | measure | pairs | +difference | t p | sign p |
    ps += re.findall(r"^\| [\w-]+ \| \w+ \| \d+ \| [+-][\d.]+ \| (\d[\d.]*) \| (\d[\d.]*) \|",
                     report, flags=re.M)
    flat = [x for p in ps for x in (p if isinstance(p, tuple) else (p,))]
    return [float(x) for x in flat]


def page_p_values(page: str) -> list:
    """The p-values a page quotes in its prose (its appendix is the report's own text)."""
    prose = page.split("## Appendix", 1)[0]
    return re.findall(r"\bp(?: =|) (\d\.\d+)", " ".join(prose.split()))


def quoted_in(value: str, written: list) -> bool:
    """A quoted p (0.008, 0.0005) is a written one rounded to the quoted digits."""
    digits = len(value.split(".")[1])
    return any(round(w, digits) == float(value) for w in written)


def test_study_pages_quote_only_what_their_report_writes():
    """Every p-value on the Theorem 1, allocation, revival and SmolLM2 breadth pages is one their
    --report writes (the revival and SmolLM2 pages quote the revival study's early branches)."""
    for page, reports in (("theorem1.md", ["assets/theorem1/report.md"]),
                          ("allocation.md", ["assets/allocation-1call/report.md"]),
                          ("revival.md", ["assets/revival/report.md",
                                          "assets/revival/early/report.md"]),
                          ("smollm2-breadth.md", ["assets/smollm2-breadth/report.md",
                                                  "assets/revival/early/report.md"])):
        written = [p for r in reports for p in report_p_values((ROOT / r).read_text())]
        quoted = page_p_values((ROOT / RESULTS / page).read_text())
        assert quoted and written, page
        assert [p for p in quoted if not quoted_in(p, written)] == [], page


def report_table(report: str, title: str) -> dict:
    """{config: {column: mean}} from one table of a study's report (cells `mean (sd)`)."""
    block = report.split(f"### {title}", 1)[1].split("\n\n", 2)[1]
    rows = [[c.strip() for c in ln.strip("|").split("|")] for ln in block.splitlines()]
    head = rows[0]
    return {r[0]: {k: float(v.split()[0]) for k, v in zip(head[1:], r[1:]) if k != "seeds"}
            for r in rows[2:]}


def test_theorem1_sizes_are_the_reports():
    """The folds the pages quote (U_pos2 890-fold, the unsampled right mass 22-fold, its loss
    16-fold, the predicted loss 45-fold, N = 4 against 512) are the report's sizes table."""
    sizes = report_table((ROOT / "assets/theorem1/report.md").read_text(), "nalone: sizes")
    fold = {k: sizes["N=4,B=8"][k] / sizes["N=512,B=8"][k] for k in sizes["N=4,B=8"]}
    page = " ".join((ROOT / RESULTS / "theorem1.md").read_text().split())
    for key, quoted in (("u_pos2", 890), ("u_pos", 22), ("du_pos_loss", 16),
                        ("pred_du_pos_loss", 45)):
        assert round(fold[key], -1 if quoted > 100 else 0) == quoted, (key, fold[key])
        assert f"{quoted}-fold" in page, key
    for doc in ("README.md", f"{RESULTS}/breadth.md"):
        text = " ".join((ROOT / doc).read_text().split())
        assert "22-fold" in text and "16-fold" in text and "900-fold" not in text, doc


def test_allocation_ratios_are_the_reports():
    """Optimizer steps per rollout (3.3x on keys, 2.7x on sets) and exact Q per 1,000 rollouts
    (1.2x, 1.4x), the adaptive arm against uniform N = 16, and the adaptive arm's rollouts per CPU
    second against its control (0.99x, 0.97x), from the allocation report's tables; every such
    ratio the page or the index gives a task, "2.7x (sets)", is one of its own."""
    report = (ROOT / "assets/allocation-1call/report.md").read_text()
    allowed, speed = {}, {}
    for task in ("keys", "sets"):
        rows = report_table(report, task)
        a, u, c = rows["adaptive"], rows["N=16"], rows["N=16-one-round"]
        allowed[task] = {f"{a['steps'] / a['rollouts'] / (u['steps'] / u['rollouts']):.1f}x",
                         f"{a['dQ_per_1k'] / u['dQ_per_1k']:.1f}x"}
        speed[task] = f"{a['rollouts'] / a['cpu_s'] / (c['rollouts'] / c['cpu_s']):.2f}x"
    assert allowed == {"keys": {"3.3x", "1.2x"}, "sets": {"2.7x", "1.4x"}}, allowed
    assert speed == {"keys": "0.99x", "sets": "0.97x"}, speed
    page = " ".join((ROOT / RESULTS / "allocation.md").read_text().split())
    assert "drew 0.99x (keys) and 0.97x (sets) the rollouts per training CPU second" in page
    for doc in (f"{RESULTS}/allocation.md", f"{RESULTS}/README.md", f"{RESULTS}/breadth.md"):
        text = " ".join((ROOT / doc).read_text().split())
        quoted = re.findall(r"(\d\.\dx) \((keys|sets)\)", text)
        quoted += [(x, t) for x, t in re.findall(r"(\d\.\dx) N = 16's on (keys|sets)", text)]
        assert quoted and [(x, t) for x, t in quoted if x not in allowed[t]] == [], doc


def default_runs() -> list:
    """Each default run's evaluations (seeds 0, 1, 2), from assets/default-run/seed<S>.jsonl."""
    import json
    runs = []
    for seed in range(3):
        rows = [json.loads(ln) for ln in (ROOT / f"assets/default-run/seed{seed}.jsonl").open()]
        runs.append([r for r in rows if "eval_pass@1" in r])
    return runs


def test_default_run_numbers_are_its_raw_files():
    """The README's and its page's held-out pass@1 (start -> end) and pass@32 at the end, and the
    README's example line's eval fields, are the committed runs' metrics.jsonl."""
    runs = default_runs()
    readme = " ".join((ROOT / "README.md").read_text().split())
    page = " ".join((ROOT / RESULTS / "default-run.md").read_text().split())
    f = lambda x: f"{x:.3f}"
    p1 = [f"{f(e[0]['eval_pass@1'])} -> {f(e[-1]['eval_pass@1'])}" for e in runs]
    assert f"pass@1 {p1[0]} (seed 0; {p1[1]}, {p1[2]})" in readme, p1
    ends = [f(e[-1]["eval_pass@32"]) for e in runs]
    assert f"ended at {ends[0]}, {ends[1]} and {ends[2]}" in readme, ends
    assert f"ended at {' / '.join(ends)}" in page, ends
    last = runs[0][-1]
    line = readme_log_line(ROOT)
    assert (f"eval pass@1 {f(last['eval_pass@1'])} pass@k {f(last['eval_pass@k'])} "
            f"probe Q {f(last['mass_mean'])} exact Q {f(last['mass_exact_mean'])}") in line


def test_simulation_wall_time_is_its_results_file():
    import json
    wall = json.loads((ROOT / "assets/massbalance/results.json").read_text())["wall_s"]
    quoted = f"{int(wall // 60)} min {round(wall % 60)} s"
    page = " ".join((ROOT / RESULTS / "massbalance.md").read_text().split())
    assert quoted in page and "2 min 51 s" not in page, quoted


def test_the_harder_models_share_is_its_warm_starts():
    """The harder model's right answers at temperature 1, as its warmstart.json measured them."""
    import json
    w = json.loads((ROOT / "assets/tiny-arith-harder/warmstart.json").read_text())
    share = f"{100 * w['heldout']['temp1']['pass@1']:.2f}%"
    assert share == "0.06%"
    for doc in ("data.py", *DOCS):
        text = (ROOT / doc).read_text()
        assert "0.1%" not in text, doc


def test_lists_of_the_embedded_tasks_name_them_all():
    """A list of the embedded tasks in prose ("arith, keys and sets") names every one data.py
    builds (a task of data.TASKS without a source), or exactly those whose training set is their
    eval set."""
    tasks = {name for name, t in data.TASKS.items() if not t.source}
    same = {name for name, t in data.TASKS.items() if t.train_is_eval}
    assert tasks == {"arith", "keys", "sets"} and same == {"keys", "sets"}
    names = "|".join(sorted(tasks))
    listed = re.compile(rf"\b(?:{names})\b(?:(?:,| or| and|, or|, and) (?:the )?(?:{names})\b)+")
    code = [*ROOT.glob("lib/*.py"), *ROOT.glob("tools/*.py")]
    files = ["README.md", "data.py", *DOCS[1:], *[p.relative_to(ROOT).as_posix() for p in code]]
    found = [(f, m[0]) for f in files
             for m in listed.finditer(" ".join((ROOT / f).read_text().split()))
             if set(re.findall(names, m[0])) not in (tasks, same)]
    assert found == []


def imported_roots(path: Path) -> set:
    """The top-level names of the modules a Python file imports (lib of `from lib import x`)."""
    import ast
    tree = ast.parse(path.read_text())
    return ({a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
            | {n.module.split(".")[0] for n in ast.walk(tree)
               if isinstance(n, ast.ImportFrom) and n.module and not n.level})


def test_the_design_files_import_nothing_of_lib():
    """The top level is the design's, lib/ the machinery beneath brorl.py (STYLE.md, the house):
    sampler.py, kernels.py, verify.py and data.py import nothing of lib/ (nor tools/), and
    kernels.py, verify.py and data.py nothing of ours at all. Arrows point down only."""
    ours = {p.stem for p in ROOT.glob("*.py")} | {"lib", "tools"}
    imports = {name: imported_roots(ROOT / f"{name}.py")
               for name in ("sampler", "kernels", "verify", "data")}
    assert {name: got & {"lib", "tools"} for name, got in imports.items()} == dict.fromkeys(imports, set())
    assert {name: got & ours for name, got in imports.items() if name != "sampler"} == dict.fromkeys(
        ("kernels", "verify", "data"), set())
    assert "lib" in imported_roots(ROOT / "brorl.py") and "kernels" in imports["sampler"]  # it sees them


def prose_problems(root: Path) -> list:
    """Prose lines (not tables, not code blocks) wider than 100 columns in the README, CONTRIBUTING.md
    and the docs; a link's target counts as one column, since it cannot be wrapped."""
    problems = []
    for doc in ["CONTRIBUTING.md", *DOCS]:
        for line in FENCE.sub("", (root / doc).read_text()).splitlines():
            if len(re.sub(r"\]\([^)\s]+\)", "](.)", line)) > 100 and not line.startswith("|"):
                problems.append(f"{doc}: {line[:60]}... ({len(line)} columns)")
    return problems


def test_prose_fits_100_columns():
    assert prose_problems(ROOT) == []


def test_every_page_names_its_commit():
    """Every page's Commit: names a commit: the one it was measured on, or, where that was not
    recorded, those it was written and last revised at; the index says which it is."""
    index = " ".join((ROOT / RESULTS / "README.md").read_text().split())
    assert "written and last revised at" in index
    for p in sorted((ROOT / RESULTS).glob("*.md")):
        if p.name in ("README.md", "archive.md"):
            continue
        commit = p.read_text().split("Commit:", 1)[1].split("\n\n", 1)[0]
        assert re.search(r"\b[0-9a-f]{7}\b", commit), p.name


def test_the_breadth_page_leads_the_book():
    """One page on breadth, first in the index, at most 150 lines, with one glossary of the measures
    and a link to each study page it answers for."""
    page = (ROOT / RESULTS / "breadth.md").read_text()
    index = (ROOT / RESULTS / "README.md").read_text()
    assert len(page.splitlines()) <= 150
    assert re.findall(r"\]\((\w[\w-]*\.md)\)", index.split("| page |", 1)[1])[0] == "breadth.md"
    glossary = page.split("## The measures", 1)[1].split("\n## ", 1)[0]
    for term in ("exact Q", "gate", "reach window", "Below the gate at the start",
                 "Never sampled right", "Never drawn", "Answer distributions"):
        assert f"**{term}**" in glossary, term
    for study in ("theorem1.md", "breadth-keys.md", "allocation.md", "equal-compute.md",
                  "plateau.md", "revival.md", "smollm2-breadth.md"):
        assert f"]({study})" in page, study
    readme = (ROOT / "README.md").read_text().split("## Results", 1)[1].split("\n## ", 1)[0]
    assert "docs/results/breadth.md" in readme


def test_the_kernels_docstring_names_what_the_backward_saves():
    """kernels.py's map names every tensor its autograd Function saves for the backward."""
    import inspect
    import kernels
    saved = re.search(r"ctx\.save_for_backward\(([^)]*)\)", inspect.getsource(kernels))[1]
    said = " ".join(kernels.__doc__.split()).split("Saved for the backward:", 1)[1].split(".")[0]
    assert [n.strip() for n in saved.split(",") if n.strip() not in said] == [], said


def test_keep_is_counted_before_the_cut_to_b():
    """keep_rate counts the groups that survived dynamic sampling, before the cut to B, over the
    groups generated; the README's legend says so."""
    import inspect
    source = inspect.getsource(import_module("steplog"))
    assert "stats.groups_survived / max(stats.groups_generated, 1)" in source
    assert "before the cut to B" in readme_legend()["keep"]


# ----------------------------------------------------------------------------
# What the text says of the code, its commits and its machines, said once and alike


def unskippable_parts(doc: str, row: str) -> tuple:
    """The parts of lib/ a reader cannot skip, as brorl.py's map names them ("which a reader may
    skip but for A (why) and B;") and as the README's lib/ row does ("skippable but `A` and `B`:")."""
    doc = " ".join(doc.split())
    said = re.search(r"which a reader may skip but for (.+?);", doc)[1]
    said = re.sub(r"\([^()]*\)", "", said)  # the reasons in brackets
    in_doc = {n.strip(" .") for n in re.split(r",| and ", said) if n.strip(" .")}
    in_row = set(re.findall(r"`([^`]+)`", row.split("skippable but", 1)[1].split(":", 1)[0]))
    return in_doc, in_row


def test_what_a_reader_of_lib_cannot_skip_is_said_alike():
    """brorl.py's map and the README's file table name the same parts of lib/ a reader cannot skip,
    every one of them, and neither calls the algorithm one file (sampler.py, kernels.py and
    verify.py run it too)."""
    readme = (ROOT / "README.md").read_text()
    row = next(ln for ln in readme.splitlines() if ln.startswith("| `lib/` |"))
    in_doc, in_row = unskippable_parts(brorl.__doc__, row)
    assert in_doc and in_doc == in_row, (in_doc, in_row)
    assert "in one file" not in brorl.__doc__ and "in one file" not in readme
    # one name dropped from either side is caught
    assert unskippable_parts(brorl.__doc__, row.replace(" and `logprobs.response_logprobs`", ""))[1] != in_doc


def test_the_flag_rule_places_its_examples_where_they_are():
    """CONTRIBUTING.md's rule for a new flag: each flag it names for brorl.Config is one of Config's
    own fields, each it names for lib/config.RunOptions one of RunOptions'."""
    rule = " ".join((ROOT / "CONTRIBUTING.md").read_text().split("7. **A new flag**", 1)[1].split())
    into_config, into_options = rule.split("In `brorl.Config` if", 1)[1].split(
        "In `lib/config.RunOptions` if", 1)
    into_options = into_options.split("*Its check*", 1)[0]
    options = {f.name for f in dataclasses.fields(config.RunOptions)}
    own = {f.name for f in dataclasses.fields(brorl.Config)} - options
    named = [FLAG.findall(part) for part in (into_config, into_options)]
    assert all(named), rule
    assert [f for f in named[0] if f not in own] == [] and [f for f in named[1] if f not in options] == []


def test_config_holds_the_recipe_within_the_flag_rules_bound():
    """Rule 7's bound on brorl.Config's own fields (those not RunOptions'), and each field declared
    once: by Config, RunOptions, LoRAFlags or one loss's entry of OBJECTIVES (a field declared twice
    would be one flag, the later class's, silently)."""
    from lib.objectives import OBJECTIVES
    rule = " ".join((ROOT / "CONTRIBUTING.md").read_text().split("7. **A new flag**", 1)[1]
                    .split("8. **", 1)[0].split())
    bound = int(re.search(r"at most (\d+) fields of its own", rule)[1])
    options = {f.name for f in dataclasses.fields(config.RunOptions)}
    own = [f.name for f in dataclasses.fields(brorl.Config) if f.name not in options]
    assert len(own) <= bound, f"brorl.Config has {len(own)} fields of its own; rule 7: {bound}"
    classes = [brorl.Config, config.RunOptions, config.LoRAFlags,
               *[o.options for o in OBJECTIVES.values() if o.options]]
    declared = [name for cls in classes for name in config.own_fields(cls)]
    assert sorted(declared) == sorted(f.name for f in dataclasses.fields(brorl.Config))


def brorl_functions_handed_to_lib() -> list:
    """(lib/'s function, its parameter, its annotation) for each argument of a call in brorl.py to
    a function of lib/ that names one of brorl.py's own functions (a call of one hands its result,
    not the function, and is not counted)."""
    import ast
    import inspect
    tree = ast.parse((ROOT / "brorl.py").read_text())
    own = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}

    def names_own(expr) -> bool:  # names one of brorl.py's functions, other than to call it
        called = {id(n.func) for n in ast.walk(expr) if isinstance(n, ast.Call)}
        return any(isinstance(n, ast.Name) and n.id in own and id(n) not in called
                   for n in ast.walk(expr))
    # A name bound to one (`sample = ... else sample_step_groups`) hands it on where it is passed.
    own |= {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and names_own(n.value)
            for t in n.targets if isinstance(t, ast.Name)}
    handed = []
    for call in [n for n in ast.walk(tree) if isinstance(n, ast.Call)]:
        f = call.func
        target = (getattr(getattr(brorl, f.value.id, None), f.attr, None)
                  if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name)
                  else getattr(brorl, f.id, None) if isinstance(f, ast.Name) else None)
        module = getattr(target, "__module__", None) or ""
        if not callable(target) or not module.startswith("lib."):
            continue
        params = inspect.signature(target).parameters
        called = {id(n.func) for n in ast.walk(call) if isinstance(n, ast.Call)}
        for param, arg in [*zip(params, call.args), *((k.arg, k.value) for k in call.keywords)]:
            if any(isinstance(n, ast.Name) and n.id in own and id(n) not in called
                   for n in ast.walk(arg)):
                handed.append((f"{target.__module__}.{target.__name__}", param,
                               params[param].annotation))
    return handed


def test_lib_never_imports_brorl_and_takes_its_functions_as_a_step_signature():
    """Rule 8: no module of lib/ imports brorl.py, and where brorl.py hands lib/ one of its
    functions, lib/ takes it as a signature lib/step.py declares (the sampling phase, SampleStep:
    lib/diagnostics.watch_sampling wraps brorl.sample_step_groups as it does --alloc adaptive's)."""
    import ast
    imports = [(p.name, n.lineno) for p in sorted((ROOT / "lib").glob("*.py"))
               for n in ast.walk(ast.parse(p.read_text()))
               if isinstance(n, ast.Import) and any(a.name == "brorl" for a in n.names)
               or isinstance(n, ast.ImportFrom) and n.module == "brorl"]
    assert imports == []
    handed = brorl_functions_handed_to_lib()
    assert handed, "the check found no function of brorl.py handed to lib/: it reads nothing"
    untyped = [h for h in handed if getattr(h[2], "__module__", None) != "lib.step"]
    assert untyped == [], untyped
    # The rule names each function of lib/ that takes one, and the signature it takes.
    rule = " ".join((ROOT / "CONTRIBUTING.md").read_text().split("8. **", 1)[1].split())
    said = [h for h in handed if f"`{h[0].replace('lib.', 'lib/', 1)}`" not in rule
            or f"`{h[2].__name__}`" not in rule]
    assert said == [], (said, rule)


def test_every_test_file_keeps_a_fast_test():
    """pytest.ini and rule 5: every topic (a test file) keeps a test that is not marked slow, so
    that `python -m pytest -q` runs something of each; a module's pytestmark, a class's mark and a
    test's own count."""
    files = [ROOT / "test_brorl.py", *sorted((ROOT / "tests").glob("test_*.py"))]
    assert [f.name for f in files if not fast_tests(f.read_text())] == []
    # The reading sees each way of marking a test slow, and a fast test among slow ones.
    marked = ("import pytest\n@pytest.mark.slow\ndef test_a():\n    pass\n"
              "@pytest.mark.slow\nclass TestB:\n    def test_b(self):\n        pass\n")
    fast = "def test_c():\n    pass\n"
    assert fast_tests(marked) == [] and fast_tests(marked + fast) == ["test_c"]
    assert fast_tests("import pytest\npytestmark = [pytest.mark.slow]\n" + fast) == []


def fast_tests(source: str) -> list:
    """The names of a test file's tests that are not marked slow (pytest.mark.slow on the test, on
    its class, or in the module's pytestmark)."""
    import ast
    tree = ast.parse(source)
    slow = lambda nodes: any(isinstance(n, ast.Attribute) and n.attr == "slow"
                             for d in nodes for n in ast.walk(d))
    module = [n.value for n in tree.body if isinstance(n, ast.Assign)
              and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    if slow(module):
        return []
    tests = [(n, []) for n in tree.body if isinstance(n, ast.FunctionDef)]
    tests += [(m, n.decorator_list) for n in tree.body if isinstance(n, ast.ClassDef)
              and n.name.startswith("Test") for m in n.body if isinstance(m, ast.FunctionDef)]
    return [n.name for n, outer in tests if n.name.startswith("test")
            and not slow([*n.decorator_list, *outer])]


def test_the_readme_gives_the_objectives_their_budget():
    """The README's Objectives figures are 3 seeds of a CPU-second budget: it says which, as the
    objectives page's command sets it."""
    page = (ROOT / RESULTS / "objectives.md").read_text()
    budget = re.search(r"--time_budget (\d+) --budget_clock cpu", page)[1]
    paragraph = " ".join((ROOT / "README.md").read_text().split("**Objectives**", 1)[1]
                         .split("\n\n", 1)[0].split())
    assert f"{budget} CPU s" in paragraph, paragraph


def test_the_speed_answer_quotes_the_later_runs_ratios():
    """The speed page's answer quotes, beside its first table's sampler ratios, those of its later
    run against the matmul floor (smaller at 16-token prompts), each as that run's table has it."""
    page = (ROOT / RESULTS / "speed.md").read_text()
    answer = " ".join(page.split("**Answer.**", 1)[1].split("\n\n", 1)[0].split())
    floor = page.split("## Against the matmul floor", 1)[1].split("\n## ", 1)[0]
    later = [re.search(r"\((\d+\.\d+x)\)", ln)[1] for ln in floor.splitlines()
             if "brorl / `generate`" in ln]
    assert len(later) == 3 and [x for x in later if x not in answer] == [], (later, answer)


def test_pages_name_commits_not_the_current_code():
    """A page says which commit's code or recipe it ran ("870fb6b's recipe"), never "the current"
    one, which a later commit silently changes."""
    current = re.compile(r"\b(?:the|this repository's) current (?:code|recipe|form)\b")
    found = [(doc, m[0]) for doc in DOCS if not doc.endswith("archive.md")
             for m in current.finditer(" ".join((ROOT / doc).read_text().split()))]
    assert found == []


def test_no_machine_of_ours_in_the_text():
    """A figure's machine is said by what it is (2 cores, torch's build, the load), never by its
    own paths or how it was had: no absolute home or work path, no GPU "lent"."""
    words = re.compile(r"(?<![\w.])/(?:work|home|root)/|\b(?:lent|lend|borrowed)\b")
    found = [(f.relative_to(ROOT).as_posix(), m[0]) for f in text_files(ROOT)
             if f.name != "test_docs.py" for m in words.finditer(f.read_text())]
    assert found == []


def test_the_fast_tests_then_the_slow_ones_as_the_readme_says():
    """pytest.ini leaves the slow tests out of `python -m pytest -q`; CI runs that, then `-m slow`, so
    that every test runs there; the README says how to run the rest and all."""
    import configparser
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    assert ini["pytest"]["addopts"].strip() == '-m "not slow"'
    assert ini["pytest"]["markers"].strip().startswith("slow:")
    ci = [ln.split("#")[0].split() for ln in (ROOT / ".ci/run").read_text().splitlines()]
    runs = [ln[ln.index("pytest"):] for ln in ci if "pytest" in ln and "-m" in ln[:ln.index("pytest")]]
    assert runs[:2] == [["pytest", "-q"], ["pytest", "-q", "-m", "slow"]], runs
    two = (ROOT / "README.md").read_text().split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert "`python -m pytest -q -m slow`" in two and '`-m ""`' in two


# ----------------------------------------------------------------------------
# The rules, the archive and the pages' dates, held where a check can hold them


def test_the_archive_is_a_dated_log_within_60_kb():
    """docs/results/archive.md is a log of short dated entries, in the order its opening says (oldest
    or newest first), each opening with its date and commit, at most 60 KB."""
    md = (ROOT / RESULTS / "archive.md").read_text()
    assert len(md.encode()) <= 60 * 1024, f"{len(md.encode())} bytes: shorten the archive's entries"
    opening = " ".join(md.split("\n## ", 1)[0].split())
    order = re.search(r"\b(oldest|newest) first\b", opening)
    assert order, "the archive's opening says neither 'oldest first' nor 'newest first'"
    entries = md.split("\n## ")[1:]
    dates = [re.match(r"[^\n]+\n\n\*(\d{4}-\d{2}-\d{2}), [0-9a-f]{7,40}\.\*\n", e) for e in entries]
    assert entries and all(dates), [e.split("\n")[0] for e, d in zip(entries, dates) if not d]
    dates = [d[1] for d in dates]
    assert dates == sorted(dates, reverse=order[1] == "newest"), dates


def test_contributing_says_what_pytest_marks_slow():
    """Rule 5 says what is marked slow in pytest.ini's own words, that the README's command leaves it
    out, and that runs compared bit for bit share a thread count."""
    import configparser
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    what = ini["pytest"]["markers"].split(":", 1)[1].split(":")[0].strip()  # trains a run, ...
    rule = " ".join((ROOT / "CONTRIBUTING.md").read_text().split("5. **", 1)[1].split("6. **")[0].split())
    assert "`@pytest.mark.slow`" in rule and f"that {what} is" in rule, (what, rule)
    assert "`python -m pytest -q` does not" in rule and "one thread count" in rule


def test_contributing_states_the_wide_files_exemption():
    """Rule 1 names the exemption test_python_files_fit_their_columns grants: WIDE_FILES, at
    WIDE_LIMIT columns."""
    rule = " ".join((ROOT / "CONTRIBUTING.md").read_text().split("1. **", 1)[1].split("2. **")[0].split())
    assert "`WIDE_FILES`" in rule and f"held to {WIDE_LIMIT}" in rule, rule


def test_planned_figures_in_running_name_their_commit():
    """A memory plan quoted in docs/running.md (a sentence with "plan" and a GB figure) names the
    commit it was planned at: the planner changes, and an undated plan goes stale unseen."""
    text = " ".join(FENCE.sub("", (ROOT / "docs/running.md").read_text()).split())
    sentences = [x for x in re.split(r"(?<=[.)])\s+(?=[A-Z`(])", text)
                 if "plan" in x and re.search(r"\d GB\b", x)]
    assert sentences and [x for x in sentences if not re.search(r"\b[0-9a-f]{7}\b", x)] == []


def test_the_index_names_every_objective():
    """The index's objectives row names every objective --loss offers (PPO and each
    objectives.*_token_loss) in its question and its headline."""
    objectives = import_module("objectives")
    names = {"PPO"} | {n[:-len("_token_loss")].upper() for n in dir(objectives)
                       if n.endswith("_token_loss") and not n.startswith("_")}
    index = (ROOT / RESULTS / "README.md").read_text()
    row = next(ln for ln in index.splitlines() if ln.endswith("[objectives.md](objectives.md) |"))
    question, headline = row.split(" | ")[:2]
    assert [n for n in names if n not in question or n not in headline] == [], (names, row)


def test_the_breadth_pages_commits_are_its_raw_files():
    """breadth.md's Commit: paragraph names the raw folders of its newest answers (the revival study's
    early branches, the real model's), each beside a commit that wrote to that folder."""
    import subprocess
    page = (ROOT / RESULTS / "breadth.md").read_text()
    commit = " ".join(page.split("Commit:", 1)[1].split("\n\n", 1)[0].split())
    pairs = re.findall(r"\b([0-9a-f]{7})\b[^,`(]*\(`(assets/[\w/-]+)/`", commit)
    assert {f for _, f in pairs} >= {"assets/revival/early", "assets/smollm2-breadth"}, commit
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        return  # an exported tree: no history to hold the commits against
    for sha, folder in pairs:
        log = subprocess.run(["git", "log", "--format=%h", "--abbrev=7", "--", folder], cwd=ROOT,
                             capture_output=True, text=True).stdout.split()
        assert not log or sha in log, (sha, folder, log[:3])


def test_loss_agg_help_says_what_auto_runs():
    """--loss_agg's help names, after "auto: sequence with", exactly the losses objectives.aggregation
    runs per sequence at auto, and every --loss is one the help of --loss lists."""
    helps = config.table_help(brorl.Config, {})
    losses = set(re.search(r"; one of (.+)$", helps["loss"])[1].split(", "))
    said = re.search(r"auto: .*sequence with (.+?), else token", " ".join(helps["loss_agg"].split()))[1]
    said = set(re.findall(r"--loss (\w+)|or (\w+)", said))
    said = {a or b for a, b in said}
    aggregation = import_module("objectives").aggregation
    assert losses and said == {x for x in losses if aggregation(x, "auto") == "sequence"}, (said, losses)


def test_the_smollm2_form_figures_are_the_raw_files():
    """smollm2.md's form against arithmetic: the stored held-out responses of the three fp32 seeds
    rescored by the rules and leniently (verify.lenient_rewards), at the first and last step."""
    import verify
    rows = [json.loads(x) for s in range(3) for x in
            (ROOT / "assets" / "smollm2" / f"seed{s}-samples.jsonl").read_text().splitlines()]
    evals = [r for r in rows if r["kind"] == "eval"]
    share = {}
    for step in (0, 8):
        at = [r for r in evals if r["step"] == step]
        lenient = verify.lenient_rewards([r["response"] for r in at], [r["answer"] for r in at])
        share[step] = (len(at), sum(r["reward"] for r in at) / len(at), sum(lenient) / len(at))
    flat = " ".join((ROOT / RESULTS / "smollm2.md").read_text().split())
    assert share[0][0] == share[8][0] == 48
    assert (f"right {share[0][2]:.3f} -> {share[8][2]:.3f} against the rules' {share[0][1]:.3f} -> "
            f"{share[8][1]:.3f}") in flat


def test_the_smollm2_bf16_figures_are_the_raw_files():
    """smollm2.md's bf16 table, its paired test and its side-by-side CPU ratio recompute from
    assets/smollm2's raw files (each run's metrics.jsonl)."""
    from tools import stats
    raw = ROOT / "assets" / "smollm2"
    rows = lambda name: [json.loads(x) for x in (raw / name).read_text().splitlines()]
    page = (ROOT / RESULTS / "smollm2.md").read_text().split("## bf16 on this CPU")[1]
    cpu = lambda r: f"{r[-1]['time_train_cpu'] / r[-1]['step']:.1f}"
    at = lambda r, step: next(x["eval_pass@1"] for x in r if x["step"] == step)
    bf16, fp32 = [], []
    for s in range(3):
        b, f = rows(f"bf16-seed{s}.jsonl"), rows(f"seed{s}.jsonl")
        bf16.append(at(b, 8))
        fp32.append(at(f, 8))
        curve = " / ".join(f"{at(b, k):.3f}" for k in (0, 4, 8))
        assert f"| {s} | {curve} | {fp32[-1]:.3f} | {cpu(b)} ({cpu(f)}) |" in page, s
    test = stats.paired(bf16, fp32)
    assert f"+{test['mean']:.3f} (paired t, 3 seeds, p {test['p']:.2f}" in page
    beside, b0 = rows("fp32-beside-bf16-seed0.jsonl"), rows("bf16-seed0.jsonl")
    flat = " ".join(page.split())
    assert f"rerun of seed 0 ended at {beside[-1]['eval_pass@1']:.3f}" in flat
    wall = lambda r: sum(x.get("time_rollout", 0) + x.get("time_update", 0) for x in r)
    ratio = float(cpu(b0)) / float(cpu(beside))
    archive = " ".join((ROOT / RESULTS / "archive.md").read_text().split())
    assert f"{cpu(b0)} against {cpu(beside)} CPU s a step, **{ratio:.2f}x** (wall " \
           f"{wall(b0) / wall(beside):.2f}x)" in archive
    # the pair at 5e6132c: CPU a step, the phases' wall ratios, and the floors' bound
    pb, pf = rows("pair-bf16-seed0.jsonl"), rows("pair-fp32-seed0.jsonl")
    phase = lambda r, k: sum(x.get(k, 0) for x in r)
    assert (f"{cpu(pb)} against {cpu(pf)} CPU s a step, **{float(cpu(pb)) / float(cpu(pf)):.2f}x** "
            f"(wall: rollout {phase(pb, 'time_rollout') / phase(pf, 'time_rollout'):.2f}x, update "
            f"{phase(pb, 'time_update') / phase(pf, 'time_update'):.2f}x)") in flat
    floors = {}
    for line in (raw / "pair-floors.txt").read_text().splitlines()[1:]:
        dtype, rate = line.split()
        floors[dtype] = max(floors.get(dtype, 0), float(rate))
    f32, b16 = floors["torch.float32"], floors["torch.bfloat16"]
    assert (f"{f32:.1f} GFLOP/s in fp32 and {b16:.1f} in bf16 (`pair-floors.txt`), {b16 / f32:.1f}x, "
            f"so a step of matmuls alone at the floor would cost {f32 / b16:.2f}x") in flat
    assert [x["eval_pass@1"] for x in pb if "eval_pass@1" in x] == [
        x["eval_pass@1"] for x in b0 if "eval_pass@1" in x]  # its seed's run to the bit
    # freed memory kept: the runs' training CPU, and /usr/bin/time's system time and peak RSS
    keep = {n: (rows(f"keep-freed-memory/{n}.jsonl")[-1]["time_train_cpu"], dict(
        line.strip().rsplit(": ", 1) for line in
        (raw / "keep-freed-memory" / f"{n}-time.txt").read_text().splitlines())) for n in ("on", "off")}
    (on, t_on), (off, t_off) = keep["on"], keep["off"]
    gb = lambda t: int(t["Maximum resident set size (kbytes)"]) * 1024 / 1e9  # GNU time's KiB
    assert (f"{on:.1f} against {off:.1f} CPU s, system {float(t_on['System time (seconds)']):.1f} "
            f"against {float(t_off['System time (seconds)']):.1f} s, peak RSS {gb(t_on):.2f} against "
            f"{gb(t_off):.2f} GB") in flat
