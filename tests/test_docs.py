"""The docs cannot drift from the code.

* docs/cli.md is what ``scripts/gen_cli_docs.py`` makes from the CLI's own help;
* every code block of docs/guide.md runs, in order, in one empty directory: bash
  blocks through ``bash -e`` (with ``opforge`` a shell function for ``python -m
  opforge``, exported variables carried from block to block), Python blocks
  through this interpreter; blocks marked ``<!-- gpu -->`` only on a GPU,
  ``<!-- norun -->`` never; a block marked ``<!-- excerpt: PATH -->`` must still
  be in PATH (relative to that directory, or ``repo:PATH`` to this repository);
* every ``opforge <subcommand>`` that README.md and docs/*.md mention exists;
* every entry of docs/troubleshooting.md is headed by an error message in backticks;
* relative links between them resolve, anchors included.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .conftest import cache_with_library

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
DOCS = ROOT / "docs"
GUIDE = DOCS / "guide.md"
TROUBLESHOOTING = DOCS / "troubleshooting.md"
GEN_CLI_DOCS = ROOT / "scripts" / "gen_cli_docs.py"
MARKDOWN = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]

RUNNABLE = {"bash": "bash", "sh": "bash", "python": "python", "py": "python"}
# A block's source line that stands for lines left out of an excerpt.
ELISIONS = {"...", "// ...", "# ..."}
BLOCK_TIMEOUT_S = 1200  # one block; a cold build of opforge's op library is the longest


# --------------------------------------------------------------- parsing


@dataclass(frozen=True)
class Block:
    lang: str
    code: str
    line: int  # of the opening fence, 1-based
    markers: frozenset[str] = frozenset()
    excerpt: str | None = None

    @property
    def where(self) -> str:
        return f"{GUIDE.name}:{self.line} ({self.lang or 'no language'})"


_FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*(.*?)\s*-->\s*$")


def parse_blocks(text: str) -> list[Block]:
    """The fenced code blocks of a Markdown text, each with the marker comments right above its fence."""
    blocks: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        opening = i + 1
        markers: set[str] = set()
        excerpt = None
        j = i - 1
        while j >= 0 and (mm := _MARKER.match(lines[j])):
            word = mm.group(1)
            if word.startswith("excerpt:"):
                excerpt = word.removeprefix("excerpt:").strip()
                markers.add("excerpt")
            else:
                markers.add(word)
            j -= 1
        body: list[str] = []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence) and lines[i].strip().strip(fence[0]) == ""):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        blocks.append(Block(lang.lower(), "\n".join(body) + "\n", opening, frozenset(markers), excerpt))
        i += 1
    return blocks


def block_problems(blocks: list[Block]) -> list[str]:
    """What is wrong with the guide's blocks as a test script: unknown markers, a block that
    neither runs nor says why, contradictory markers."""
    problems = []
    for b in blocks:
        unknown = b.markers - {"gpu", "cpu", "norun", "excerpt"}
        if unknown:
            problems.append(f"{b.where}: unknown marker(s) {sorted(unknown)}; use gpu, cpu, norun or excerpt: PATH")
        if "norun" in b.markers and ({"gpu", "cpu", "excerpt"} & b.markers):
            problems.append(f"{b.where}: norun with {sorted({'gpu', 'cpu', 'excerpt'} & b.markers)}: a norun block is never run nor read")
        if {"gpu", "cpu"} <= b.markers:
            problems.append(f"{b.where}: gpu and cpu: a block runs on one kind of machine or on both (no marker)")
        if "excerpt" in b.markers and not b.excerpt:
            problems.append(f"{b.where}: excerpt without a path")
        if not ({"norun", "excerpt"} & b.markers) and b.lang not in RUNNABLE:
            problems.append(
                f"{b.where}: a {b.lang or 'plain'} block is not run: mark it <!-- norun --> (output, an error message) "
                "or <!-- excerpt: PATH --> (a part of a file), or write it in bash or python"
            )
    return problems


# --------------------------------------------------------------- running


def _normal(line: str) -> str:
    return " ".join(line.split())


def _common_prefix(a: list[str], b: list[str]) -> int:
    n = 0
    while n < len(a) and n < len(b) and a[n] == b[n]:
        n += 1
    return n


def excerpt_problem(block: Block, workdir: Path) -> str | None:
    """None if the block's lines are in its file: each run of lines between elisions
    (``...``, ``// ...``, ``# ...``) contiguous, ignoring blank lines and indentation, in order."""
    assert block.excerpt is not None
    path = ROOT / block.excerpt.removeprefix("repo:") if block.excerpt.startswith("repo:") else workdir / block.excerpt
    if not path.is_file():
        return f"{block.where}: excerpt of {block.excerpt}, which does not exist ({path})"
    have = [n for n in (_normal(x) for x in path.read_text().splitlines()) if n]
    chunks: list[list[str]] = [[]]
    for raw in block.code.splitlines():
        n = _normal(raw)
        if n in ELISIONS:
            chunks.append([])
        elif n:
            chunks[-1].append(n)
    pos = 0
    for chunk in (c for c in chunks if c):
        found = next((k for k in range(pos, len(have) - len(chunk) + 1) if have[k : k + len(chunk)] == chunk), None)
        if found is None:
            # The longest run of the chunk's first lines that is there, to name the line after it.
            longest = max((_common_prefix(have[k:], chunk) for k in range(pos, len(have))), default=0)
            first_missing = chunk[min(longest, len(chunk) - 1)]
            return (
                f"{block.where}: excerpt of {block.excerpt} no longer matches the file (after its non-blank line {pos}); "
                f"the first line not found where the lines before it are: {first_missing!r}"
            )
        pos = found + len(chunk)
    return None


@dataclass
class GuideShell:
    """The guide's blocks run as one shell in ``workdir``: what a block exports
    is seen by the next ones (through ``export -p``), files stay, each block is its own
    ``bash -e`` process so that a failure names its block."""

    workdir: Path
    scratch: Path
    env: dict[str, str]
    timings: list[tuple[str, float]] = field(default_factory=list)

    @classmethod
    def start(cls, tmp: Path) -> GuideShell:
        workdir, scratch, bindir = tmp / "work", tmp / "scratch", tmp / "bin"
        for d in (workdir, scratch, bindir):
            d.mkdir()
        # `python` and `python3` are this interpreter (a wrapper, not a link: a link would lose its virtualenv).
        for name in ("python", "python3"):
            wrapper = bindir / name
            wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
            wrapper.chmod(0o755)
        env = dict(os.environ)
        for var in ("OPFORGE_NO_AUTOLOAD", "OPFORGE_FAST", "OPFORGE_LIBRARY", "PYTHONSTARTUP", "COLUMNS"):
            env.pop(var, None)
        env.update(
            PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}",
            PYTHONPATH=os.pathsep.join([str(SRC), *filter(None, [os.environ.get("PYTHONPATH")])]),
            OPFORGE_CACHE_DIR=str(cache_with_library(tmp / "opforge-cache")),
            PYTHONUNBUFFERED="1",
            PYTHONDONTWRITEBYTECODE="1",
        )
        (scratch / "exports.sh").write_text("")
        return cls(workdir, scratch, env)

    def run(self, index: int, block: Block) -> None:
        if block.excerpt is not None:
            problem = excerpt_problem(block, self.workdir)
            assert problem is None, problem
            return
        kind = RUNNABLE[block.lang]
        if kind == "python":
            script = self.scratch / f"block{index:02d}.py"
            script.write_text(block.code)
            body = f"python {shlex.quote(str(script))}\n"
        else:
            body = block.code
        exports = shlex.quote(str(self.scratch / "exports.sh"))
        shell = self.scratch / f"block{index:02d}.sh"
        shell.write_text(
            f"source {exports}\n"
            # The `opforge` command as its console script runs it: opforge's op library is loaded by the commands that need it.
            'opforge() { OPFORGE_NO_AUTOLOAD=1 python -m opforge "$@"; }\n'
            f"cd {shlex.quote(str(self.workdir))}\n"
            f"{body}\n"
            f"export -p > {exports}\n"
        )
        start = time.perf_counter()
        # Each block's start and time in the scratch folder as it happens: a run killed from outside still says where it was.
        with open(self.scratch / "timings.txt", "a") as log:
            log.write(f"{block.where}: started\n")
        try:
            res = subprocess.run(
                ["bash", "-e", str(shell)], cwd=self.workdir, env=self.env, capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S
            )
        except subprocess.TimeoutExpired as exc:
            pytest.fail(f"{block.where} ran over {BLOCK_TIMEOUT_S} s:\n{block.code}\n--- output\n{exc.stdout}\n{exc.stderr}")
        self.timings.append((block.where, time.perf_counter() - start))
        with open(self.scratch / "timings.txt", "a") as log:
            log.write(f"{block.where}: {self.timings[-1][1]:.1f} s, exit {res.returncode}\n")
        if res.returncode != 0:
            out, err = res.stdout[-6000:], res.stderr[-6000:]
            pytest.fail(f"{block.where} exited {res.returncode}:\n{block.code}\n--- stdout (end)\n{out}\n--- stderr (end)\n{err}")


# The guide's sections as independent runs on a GPU machine, each in its own shell and
# directory, so that its many cores run them side by side (pytest-xdist): every part
# after the first starts from section 1's package, which is all later sections use.
GUIDE_PARTS: dict[str, tuple[int, ...]] = {
    "write-an-operator": (1, 2, 3, 4, 5, 6),
    "build-routes": (1, 7),
    "verify-and-fast-path": (1, 8, 11),
    "benchmark": (1, 9),
    "profile": (10,),
    "bring-your-own": (12,),
    "at-scale": (1, 12, 13),
    "deploy": (14,),
}


def guide_sections(text: str, blocks: list[Block]) -> list[int | None]:
    """Each block's section number (``## N.``); None before the first and under unnumbered headings."""
    starts = []
    for n, line in enumerate(text.splitlines(), 1):
        m = re.match(r"## (\d+)\. ", line)
        if m or line.startswith("## "):
            starts.append((n, int(m[1]) if m else None))
    out: list[int | None] = []
    for b in blocks:
        out.append(next((sec for start, sec in reversed(starts) if start <= b.line), None))
    return out


def run_guide(tmp: Path, *, gpu: bool, part: str | None = None) -> GuideShell:
    text = GUIDE.read_text()
    blocks = parse_blocks(text)
    problems = block_problems(blocks)
    assert not problems, "\n".join(problems)
    sections = guide_sections(text, blocks)
    wanted = None if part is None else set(GUIDE_PARTS[part])
    shell = GuideShell.start(tmp)
    for index, block in enumerate(blocks):
        if wanted is not None and sections[index] not in wanted:
            continue
        # cpu: the CPU run's alone (a CPU-only command; on a GPU machine its
        # CPU torch.compile checks took a minute a block and said nothing new).
        if "norun" in block.markers or ("gpu" in block.markers and not gpu) or ("cpu" in block.markers and gpu):
            continue
        shell.run(index, block)
    summary = ", ".join(f"{where.split(' ')[0]} {s:.0f} s" for where, s in shell.timings)
    print(f"guide: {len(shell.timings)} blocks run: {summary}")
    return shell


# --------------------------------------------------------------- tests


def test_cli_reference_is_up_to_date():
    res = subprocess.run([sys.executable, str(GEN_CLI_DOCS), "--check"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, f"docs/cli.md is stale; run python scripts/gen_cli_docs.py\n{res.stdout}\n{res.stderr}"


def test_guide_blocks_run_or_say_why_not():
    blocks = parse_blocks(GUIDE.read_text())
    assert not block_problems(blocks), "\n".join(block_problems(blocks))
    runs = [b for b in blocks if "norun" not in b.markers and "excerpt" not in b.markers]
    assert {RUNNABLE[b.lang] for b in runs} == {"bash", "python"}
    assert any("gpu" in b.markers for b in blocks) and any("excerpt" in b.markers for b in blocks)


def test_parser_reads_markers_and_lines():
    text = "intro\n\n<!-- gpu -->\n```bash\necho hi\n```\n\n<!-- excerpt: repo:README.md -->\n```text\n# opforge\n```\n```\nplain\n```\n"
    blocks = parse_blocks(text)
    assert [(b.lang, b.line, set(b.markers), b.excerpt) for b in blocks] == [
        ("bash", 4, {"gpu"}, None),
        ("text", 9, {"excerpt"}, "repo:README.md"),
        ("", 12, set(), None),
    ]
    assert blocks[0].code == "echo hi\n"
    assert [p.split(": ", 1)[1][:26] for p in block_problems(blocks)] == ["a plain block is not run: "]


def test_excerpts_must_match_their_file(tmp_path):
    (tmp_path / "f.cpp").write_text("int a;\n\n  int b;\nint c;\nint d;\n")
    ok = Block("cpp", "int a;\nint b;\n// ...\nint d;\n", 1, frozenset({"excerpt"}), "f.cpp")
    assert excerpt_problem(ok, tmp_path) is None
    gap = Block("cpp", "int a;\nint c;\n", 1, frozenset({"excerpt"}), "f.cpp")  # a line left out without saying so
    assert "no longer matches" in (excerpt_problem(gap, tmp_path) or "")
    order = Block("cpp", "int d;\n// ...\nint a;\n", 1, frozenset({"excerpt"}), "f.cpp")
    assert "no longer matches" in (excerpt_problem(order, tmp_path) or "")


def test_guide_parts_cover_every_section():
    text = GUIDE.read_text()
    sections = {s for s in guide_sections(text, parse_blocks(text)) if s is not None}
    covered = {s for part in GUIDE_PARTS.values() for s in part}
    assert sections == covered, f"sections with blocks {sorted(sections)}, in GUIDE_PARTS {sorted(covered)}"


@pytest.mark.slow
def test_guide_runs_on_cpu(tmp_path):
    # One shell for the whole guide: on CI's two cores the parts would rebuild section 1's package
    # once each for no gain in time.
    run_guide(tmp_path, gpu=False)


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.parametrize("part", GUIDE_PARTS)
def test_guide_runs_on_gpu(tmp_path, part):
    run_guide(tmp_path, gpu=True, part=part)


def _command_tree() -> dict[str, set[str]]:
    spec = importlib.util.spec_from_file_location("gen_cli_docs", GEN_CLI_DOCS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.command_tree()


def _code_text(text: str) -> list[tuple[int, str]]:
    """(line, code) of every fenced block line and inline code span of a Markdown text."""
    found: list[tuple[int, str]] = []
    fence: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if fence is None and m:
            fence = m.group(2)
        elif fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
        elif fence is not None:
            found.append((n, line))
        else:
            found += [(n, span) for span in re.findall(r"`([^`\n]+)`", line)]
    return found


# `opforge WORD [WORD]` where a command starts: a line (after a `$ ` prompt, `usage: `, VAR=value
# assignments), after ; & | or $(, or as `python -m opforge`; not "opforge sets ..." in a message.
_COMMAND = re.compile(
    r"(?:^|[;&|]|\$\()\s*(?:\$\s+|usage:\s+)?(?:\w+=\S*\s+)*(?:python3?\s+-m\s+)?opforge[ \t]+([a-z][\w-]*)(?:[ \t]+([a-z][\w-]*))?"
)


def test_command_mentions_are_found_where_commands_start():
    found = [m.groups() for code in (
        "opforge check my_op --device cpu",
        "$ opforge new 2fast",
        "usage: opforge cache clean [-h]",
        "OPFORGE_NO_AUTOLOAD=1 python -m opforge doctor",
        "x=$(opforge list)",
        "opforge: add2: the module name (opforge sets it to the built file's name)",  # a message, not a command
        "import opforge  # builds the library",
    ) for m in _COMMAND.finditer(code)]  # fmt: skip
    assert found == [("check", "my_op"), ("new", None), ("cache", "clean"), ("doctor", None), ("list", None)]


def test_docs_mention_only_commands_that_exist():
    tree = _command_tree()
    assert {"build", "new", "check", "bench", "profile", "doctor", "cache"} <= set(tree)
    wrong = []
    for path in MARKDOWN:
        for n, code in _code_text(path.read_text()):
            for m in _COMMAND.finditer(code.strip()):
                command, sub = m.groups()
                if command not in tree:
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: opforge {command} (in {code.strip()!r})")
                elif tree[command] and sub is not None and sub not in tree[command]:
                    wrong.append(f"{path.relative_to(ROOT)}:{n}: opforge {command} {sub} (in {code.strip()!r})")
    assert not wrong, "no such subcommand:\n" + "\n".join(wrong)


def test_troubleshooting_entries_are_headed_by_error_messages():
    headings = []
    fence = None
    for n, line in enumerate(TROUBLESHOOTING.read_text().splitlines(), 1):
        m = _FENCE.match(line)
        if m:
            fence = None if fence else m.group(2)
            continue
        if fence is None and re.match(r"^#{2,6} ", line):
            headings.append((n, line.lstrip("#").strip()))
    assert len(headings) >= 10
    # The text as it is printed, in backticks first, so a search for the message finds the entry.
    bad = [f"troubleshooting.md:{n}: {h}" for n, h in headings if not re.match(r"^`[^`]+`", h)]
    assert not bad, "headings that do not start with the error message in backticks:\n" + "\n".join(bad)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, fence = set(), None
    for line in path.read_text().splitlines():
        m = _FENCE.match(line)
        if m:
            fence = None if fence else m.group(2)
        elif fence is None and (h := re.match(r"^#{1,6} (.*)$", line)):
            anchors.add(_slug(h.group(1)))
    return anchors


def test_links_between_the_docs_resolve():
    broken = []
    for path in MARKDOWN:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                broken.append(f"{path.relative_to(ROOT)}: {target} (no {dest})")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{path.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_work_tracking_words_reach_users():
    """Code, docs and tests speak to users: no tracker numbers, no work-log
    words, no tutorial source files users do not have."""
    words = re.compile("|".join([r"issue [0-9]", r"\bsess" + r"ion\b", r"seed 0?0[0-9]", r"shared/" + "seeds"]), re.IGNORECASE)
    roots = [ROOT / "src", ROOT / "csrc", ROOT / "docs", ROOT / "tests", ROOT / "README.md"]
    found = []
    for root in roots:
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if not path.is_file() or "egg-info" in str(path) or "__pycache__" in path.parts or path.suffix in (".so", ".pyc", ".o"):
                continue
            for n, line in enumerate(path.read_text(errors="ignore").splitlines(), 1):
                if words.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)


# --------------------------------------------------------------- the README

README = ROOT / "README.md"
README_MAX_BYTES = 10_500  # a README for users: the rest lives in docs/


def test_readme_is_short():
    size = len(README.read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move the detail to a page under docs/"


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section of a Markdown text (up to the next ``## ``), or ''."""
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == f"## {title}"), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join(lines[start + 1 : end])


def layout_paths(section: str) -> list[str]:
    """The paths a layout section names: the first word of every line of its fenced tree blocks (an
    indented entry is under the nearest entry above it that is less indented and ends with ``/``),
    and every inline code span outside them that holds a ``/`` and no space."""
    paths: list[str] = []
    fence: str | None = None
    stack: list[tuple[int, str]] = []  # (indent, folder path) of the open folders of the tree
    for line in section.splitlines():
        m = _FENCE.match(line)
        if fence is None and m:
            fence, stack = m.group(2), []
            continue
        if fence is not None and line.strip().startswith(fence) and not line.strip().strip(fence[0]):
            fence = None
            continue
        if fence is not None:
            if not line.strip():
                continue
            indent = len(line) - len(line.lstrip(" "))
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = (stack[-1][1] if stack else "") + line.split()[0]
            if path.endswith("/"):
                stack.append((indent, path))
            paths.append(path)
        else:
            paths += [span for span in re.findall(r"`([^`\n]+)`", line) if "/" in span and " " not in span]
    return paths


def _exists(path: str) -> bool:
    """Whether a named path is in the repository; ``<name>`` stands for any one name."""
    pattern = re.sub(r"<[^>/]+>", "*", path.rstrip("/"))
    found = list(ROOT.glob(pattern)) if "*" in pattern else [ROOT / pattern] if (ROOT / pattern).exists() else []
    return any(p.is_dir() for p in found) if path.endswith("/") else bool(found)


def test_layout_paths_are_read_from_the_tree_and_code_spans():
    section = "Intro `csrc/ops/` and `opforge new`.\n\n```text\na/        x\n  b/      y\n    c.py  z\n  d.py\ne.txt\n```\n"
    assert layout_paths(section) == ["csrc/ops/", "a/", "a/b/", "a/b/c.py", "a/d.py", "e.txt"]
    assert _exists("csrc/ops/<op>/") and _exists("src/opforge/ops/<op>.py") and not _exists("csrc/nowhere/")


def test_readme_layout_matches_the_tree():
    section = _section(README.read_text(), "Layout")
    assert section, "README.md has no '## Layout' section"
    paths = layout_paths(section)
    missing = [p for p in paths if not _exists(p)]
    assert not missing, "README.md's layout names paths that are not in the repository:\n" + "\n".join(missing)
    res = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"not a git checkout: {res.stderr.strip()}")
    tracked = res.stdout.splitlines()
    top = {f.split("/", 1)[0] for f in tracked if "/" in f and not f.startswith(".")}
    named = {p.split("/", 1)[0] for p in paths}
    assert top <= named, f"top-level folders missing from README.md's layout: {sorted(top - named)}"
