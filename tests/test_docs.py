"""The text keeps up with the code: every citation resolves, the README's example log line is the
code's own format, and the product speaks of itself.

Citation formats (strict, so that they can be checked):
  docs/paper.md §N        a numbered section: docs/paper.md has a heading "## N. ..."
  NOTES.md#anchor         a heading of NOTES.md (GitHub's anchor of the heading text)
  [text](path#anchor)     a Markdown link in README.md, NOTES.md, docs/*.md: the file, and the heading
  `path`                  a backticked repository path in the docs (`tests/`, `assets/tiny-arith`, `kernels.py`)
  `module.name`           a backticked function or constant of one of our modules: it exists
  python X.py / bash X    a command in the docs: X exists
"""

import re
import shutil
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parent.parent
DOCS = ["README.md", "NOTES.md", "docs/paper.md"]
MODULES = ("brorl", "sampler", "kernels", "verify", "data", "tasks", "harness", "massbalance", "bench")
FENCE = re.compile(r"^```.*?^```", flags=re.M | re.S)


def text_files(root: Path) -> list:
    """Every file whose text ships: code, CI scripts, docs."""
    files = [*root.glob("*.py"), *root.glob("*.sh"), *root.glob("*.md"), *root.glob("tests/*.py"),
             *root.glob(".ci/*"), *root.glob("docs/*.md"), *root.glob("assets/**/*.md")]
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
    """`X.md §N` and `X.md#anchor` anywhere in the shipped text, each checked against its file."""
    cite = re.compile(r"(?<![\w/.-])((?:[\w-]+/)*[\w-]+\.md)(?:#([\w-]+)|\s§(\d+))?")
    problems = []
    for f in text_files(root):
        if f.name == "test_docs.py":
            continue
        for lineno, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in cite.finditer(line):
                path, anchor, section = m.groups()
                where = f"{f.relative_to(root)}:{lineno}: {m.group(0)}"
                target = root / path
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


def path_problems(root: Path) -> list:
    """Backticked repository paths and `python X.py` / `bash X` commands in the docs exist.
    A backticked path counts when it names a root file (x.py, x.sh, x.md) or starts with a
    folder the repository has; run outputs (`runs/...`, `metrics.jsonl`) are not repository paths."""
    problems = []
    folders = {p.name for p in root.iterdir() if p.is_dir()}
    for doc in DOCS:
        md = (root / doc).read_text()
        for span in re.findall(r"`([^`\n]+)`", md):
            for cmd in re.findall(r"(?:python|bash)\s+((?:\.ci/)?[\w.-]+\.(?:py|sh)|\.ci/\w+)", span):
                if not (root / cmd).exists():
                    problems.append(f"{doc}: command names {cmd}, which does not exist")
            if " " in span or "<" in span:
                continue
            top = span.split("/")[0]
            is_root_file = "/" not in span and re.fullmatch(r"[\w-]+\.(py|sh|md)", span)
            if (is_root_file or ("/" in span and top in folders)) and not (root / span).exists():
                problems.append(f"{doc}: `{span}` does not exist")
        for cmd in re.findall(r"^(?:python|bash)\s+((?:\.ci/)?[\w.-]+\.(?:py|sh)|\.ci/\w+)", "\n".join(
                FENCE.findall(md)), flags=re.M):
            if not (root / cmd).exists():
                problems.append(f"{doc}: command names {cmd}, which does not exist")
    return problems


def name_problems(root: Path) -> list:
    """Backticked `module.name` in the docs: that module has that name (functions named in the
    README's step, constants cited by docs/paper.md)."""
    import importlib
    problems = []
    for doc in DOCS:
        for mod, name in re.findall(rf"`({'|'.join(MODULES)})\.(\w+)`", (root / doc).read_text()):
            if name in ("py", "md"):
                continue
            if not hasattr(importlib.import_module(mod), name):
                problems.append(f"{doc}: `{mod}.{name}`: {mod}.py has no {name}")
    return problems


FORBIDDEN = re.compile(r"\bissues? \d+|\bthe issue's\b|\bsessions?\b|\blent\b|\blend(?:ing)?\b", flags=re.I)


def process_word_problems(root: Path) -> list:
    """Words about how the work was organised, not about the product."""
    problems = []
    for f in text_files(root):
        if f.name == "test_docs.py":
            continue
        for lineno, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            if m := FORBIDDEN.search(line):
                problems.append(f"{f.relative_to(root)}:{lineno}: {m.group(0)!r} in {line.strip()[:80]!r}")
    return problems


def shape(line: str) -> str:
    """A log line with every number replaced by its format: integers -> 9, 0.980 -> 9.999,
    3.3e-06 -> 9.9e~; runs of spaces collapsed (the step is right-aligned)."""
    line = re.sub(r"e[+-]\d+", "e~", line)
    line = re.sub(r"\d+(\.\d+)?", lambda m: "9" + ("." + "9" * (len(m.group(1)) - 1) if m.group(1) else ""), line)
    return " ".join(line.split())


class AnyMetrics(dict):
    """A metrics dict that has every key (value 1), so harness.log_line prints all of its fields."""

    def __getitem__(self, key):
        return 1

    def get(self, key, default=None):
        return 1

    def __contains__(self, key):
        return True


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
    want = harness.log_line(AnyMetrics())
    if shape(line) != shape(want):
        problems.append(f"README.md's example log line is not harness.log_line's format:\n"
                        f"  README: {line}\n  code:   {want}")
    # the example comes from a recorded run: NOTES.md names it, with its eval numbers on one line
    m = re.search(r"eval pass@1 ([\d.]+) pass@k ([\d.]+) Q ([\d.]+)", line)
    notes = (root / "NOTES.md").read_text().splitlines()
    if not m:
        problems.append("README.md: the example log line has no eval part (pick an eval step)")
    elif not any(all(v in ln for v in m.groups()) for ln in notes):
        problems.append(f"README.md's example log line (pass@1 {m[1]}, pass@k {m[2]}, Q {m[3]}) is not the run "
                        f"recorded in NOTES.md: no line there has all three numbers")
    return problems


# ----------------------------------------------------------------------------
# The checks, on this repository


def test_citations_resolve():
    assert citation_problems(ROOT) == []


def test_markdown_links_resolve():
    assert link_problems(ROOT) == []


def test_paths_and_commands_in_docs_exist():
    assert path_problems(ROOT) == []


def test_named_functions_exist():
    assert name_problems(ROOT) == []


def test_readme_log_line_is_the_codes_format():
    assert log_line_problems(ROOT) == []


def test_the_product_speaks_of_itself():
    assert process_word_problems(ROOT) == []


def test_readme_lists_every_module():
    """The README's file table names every module at the root and the tests folder."""
    md = (ROOT / "README.md").read_text()
    assert "\n## Where to read on\n" in md, "README.md has no section '## Where to read on'"
    table = md.split("\n## Where to read on\n", 1)[1]
    missing = [p.name for p in ROOT.glob("*.py") if f"`{p.name}`" not in table and p.name != "bench_trl.py"]
    assert missing == [] and "`tests/`" in table, f"not in README's file table: {missing}"


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
    (root / "x.py").write_text('"""See docs/paper.md §9, NOTES.md#no-such-heading and PAPER.md."""\n')
    found = citation_problems(root)
    assert len(found) == 3, found
    readme = root / "README.md"
    readme.write_text(readme.read_text() + "\n[gone](docs/nothing.md) [bad](NOTES.md#nope) `assets/none.bin` "
                      "`python nothere.py` `brorl.no_such_function`\n")
    assert len(link_problems(root)) == 2
    assert len(path_problems(root)) == 2
    assert len(name_problems(root)) == 1


def test_checks_catch_a_stale_log_line(tmp_path):
    root = copy_text(tmp_path)
    assert log_line_problems(root) == []
    readme = root / "README.md"
    line = readme_log_line(root)
    readme.write_text(readme.read_text().replace(line, line.replace(" | keep ", " | keep 1.00 | kept ")))
    assert "not harness.log_line's format" in log_line_problems(root)[0]
    readme.write_text(readme.read_text().replace(line.replace(" | keep ", " | keep 1.00 | kept "),
                                                 line.replace(" Q 0.", " Q 1.")))
    assert "not the run recorded in NOTES.md" in log_line_problems(root)[0]


def test_checks_catch_process_words(tmp_path):
    root = copy_text(tmp_path)
    assert process_word_problems(root) == []
    (root / "y.py").write_text("# the figure of issue 6, for a session that is lent a GPU\n")
    assert len(process_word_problems(root)) == 1
