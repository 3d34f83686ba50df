"""What the guide's fenced blocks are, and the checks that make each one true: the
parser, the kinds, the console notation and the excerpt and include checks that
``test_docs.py`` runs (docs/CONVENTIONS.md, "Fenced blocks", is the reader's version),
and which test reads a `run-in` block (the API such a test calls is ``docrun.py``).

Why a module of its own: ``test_docs.py`` holds the tests; this holds the rules, small
enough to read in one sitting and unit-tested there (``test_the_notation``).

Caveats: an include's "a test runs this file" is read from the test's source (its
function, the module-level names it uses and its fixtures' functions must name the
file's path, or every part of it as string literals); a test that builds the path
some other way is not recognised and the include is refused, never wrongly accepted.
A run-in block's "the test reads it" is read from the test's source the same way (a
``console(PAGE, ID)``/``log_lines(PAGE, ID)``/``statements(PAGE, ID)``/``config(PAGE,
ID)`` call with literal arguments; for a Rust test, a ``console("PAGE", "ID")`` call in
the body of its ``#[test] fn``, found by matching braces, so a brace inside a string
literal of that function can hide or misplace its end); that the
test then runs every step is the test's part, not checked here.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)[^\n]*$")
MARKER = re.compile(r"^\s*<!--\s*([a-z-]+)(?::\s*(.*?))?\s*-->\s*$")
SNIPPET = re.compile(r'^--8<-- "([^"]+)"$')
# `<!-- run-in: ID by path/to/test.py::test_name -->` (or a Rust test: `tests/x.rs::name`)
RUN_IN = re.compile(r"([a-z0-9-]+) by (\S+\.(?:py|rs))::(\w+)")

#: What each kind means (the names `counts()` uses).
KINDS = {
    "run": "executed as shown, its shown output compared (console, python, output)",
    "fresh-clone": "a console block run in a fresh copy of the checkout's tracked files",
    "tour": "a console block of the README's tour, run in a fresh clone by tests/tour.rs",
    "file": "a config block written where its marker says, then used by a run block",
    "include": "included from a file (--8<--) that a named test executes",
    "run-in": "read from the page and run by the named test, which CI runs anyway",
    "excerpt": "lines of a file, checked verbatim against it",
    "diagram": "a picture in text (no command, no code, no output)",
    "unchecked": "not checked: the marker says why (a template, a deployment, a GPU machine)",
}

DATA_LANGS = ("json", "toml", "yaml")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: tuple[str, str] | None

    @property
    def rel(self) -> str:
        return str(self.page.relative_to(REPO))

    @property
    def where(self) -> str:
        return f"{self.rel}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, with the marker on the last non-blank line before it."""
    lines = page.read_text().split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.group(1), m.group(2), m.group(3)
        j = i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence[0] * len(fence)):
            j += 1
        if j >= len(lines):
            raise AssertionError(f"{page.relative_to(REPO)}:{i + 1}: unclosed fence")
        body = "\n".join(
            x[len(indent) :] if x.startswith(indent) else x.lstrip() for x in lines[i + 1 : j]
        )
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        mk = MARKER.match(lines[k]) if k >= 0 else None
        marker = (mk.group(1), mk.group(2) or "") if mk else None
        out.append(Block(page, i + 1, lang, body, marker))
        i = j + 1
    return out


def kind(b: Block) -> str:
    """The block's kind (a key of KINDS); AssertionError naming the block when it has none."""
    mk, arg = b.marker or (None, "")
    if mk is None:
        if b.lang in ("console", "python"):
            return "run"
        raise AssertionError(
            f"{b.where}: ```{b.lang or '(no language)'} has no marker and is not run "
            "(console, python): mark it excerpt, run-by (an include), file or diagram"
        )
    if mk == "output":
        if b.lang != "text":
            raise AssertionError(f"{b.where}: an output block is ```text")
        return "run"
    if mk == "fresh-clone" and b.lang == "console" and not arg:
        return "fresh-clone"
    if mk == "fresh-clone" and b.lang == "console" and arg == "tests/tour.rs":
        return "tour"
    if mk == "excerpt" and arg:
        return "excerpt"
    if (
        mk == "run-in"
        and RUN_IN.fullmatch(arg)
        and b.lang in ("console", "text", "python", *DATA_LANGS)
    ):
        return "run-in"
    if mk == "run-by" and arg and SNIPPET.match(b.text.strip()):
        return "include"
    if mk == "file" and arg and b.lang in DATA_LANGS:
        return "file"
    if mk == "diagram" and b.lang == "text":
        return "diagram"
    if mk == "unchecked" and arg:
        return "unchecked"
    raise AssertionError(
        f"{b.where}: ```{b.lang} with <!-- {mk}: {arg} --> is none of the kinds "
        f"({', '.join(KINDS)}) of docs/CONVENTIONS.md"
    )


# --- console notation ------------------------------------------------------------------------


def parse_console(text: str) -> list[tuple[str, int, list[str]]]:
    """(command, expected exit code, expected lines) for each `$ ` command."""
    steps: list[tuple[str, int, list[str]]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            cmd = line[2:]
            while cmd.endswith("\\") and i + 1 < len(lines):
                i += 1
                cmd = cmd[:-1] + "\n" + lines[i]
            steps.append((cmd, 0, []))
        elif not steps:
            if line.strip():
                raise AssertionError(f"output before the first `$ ` command: {line!r}")
        elif (m := re.fullmatch(r"\? (\d+)", line.strip())) and not steps[-1][2]:
            steps[-1] = (steps[-1][0], int(m.group(1)), [])
        else:
            steps[-1][2].append(line)
        i += 1
    for _, _, want in steps:
        while want and not want[-1].strip():
            want.pop()
    return steps


def line_pattern(expected: str) -> re.Pattern[str]:
    return re.compile(".*".join(re.escape(p) for p in expected.rstrip().split("[..]")))


def check_output(expected: list[str], out: str) -> str | None:
    """None when the output is the expected lines: each line matches one whole output
    line (`[..]` is any text in it), in order, with nothing between them except where
    a line `...` stands (any lines, none included). Blank lines are not compared."""
    got = [x.rstrip() for x in out.split("\n") if x.strip()]
    want = [x for x in expected if x.strip()]

    def match(i: int, j: int) -> bool:  # want[i:] against got[j:]
        while i < len(want):
            if want[i].strip() == "...":
                return any(match(i + 1, k) for k in range(j, len(got) + 1))
            if j >= len(got) or not line_pattern(want[i]).fullmatch(got[j]):
                return False
            i, j = i + 1, j + 1
        return j == len(got)

    if match(0, 0):
        return None
    # Name the first line that has no match, for the message.
    for w in want:
        if w.strip() != "..." and not any(line_pattern(w).fullmatch(g) for g in got):
            return f"no output line matches {w!r}"
    return "the lines are there but not in this order, or there are others (write `...`)"


# --- excerpts and includes -------------------------------------------------------------------


def check_excerpt(text: str, source: str) -> str | None:
    """None when the block's lines are lines of the source, contiguous, each with the
    same extra indentation; a line `...` or `# ...` alone marks lines left out (the
    parts must then come in the file's order)."""
    src = [x.rstrip() for x in source.split("\n")]
    parts: list[list[str]] = [[]]
    for line in text.rstrip("\n").split("\n"):
        if line.strip() in ("...", "# ..."):
            parts.append([])
        else:
            parts[-1].append(line.rstrip())
    parts = [p for p in parts if p]
    at = 0
    for part in parts:
        found = None
        for start in range(at, len(src) - len(part) + 1):
            first = src[start]
            if not first.endswith(part[0]) or first[: len(first) - len(part[0])].strip():
                continue
            pad = first[: len(first) - len(part[0])]
            if all(
                (s == "" and w == "") or s == pad + w
                for s, w in zip(src[start : start + len(part)], part)
            ):
                found = start
                break
        if found is None:
            return "these lines are not in the file, contiguous and in order:\n" + "\n".join(part)
        at = found + len(part)
    return None


def _function_text(path: Path, name: str) -> str | None:
    """The test function's source, with the module-level assignments and the fixture
    functions it uses (one level deep), or None when the file defines no such function."""
    source = path.read_text()
    tree = ast.parse(source)
    top = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top[node.name] = node
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Name):
                    top[t.id] = node
    fn = top.get(name)
    if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None
    used = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
    used |= {a.arg for a in fn.args.args}  # fixtures
    parts = [ast.get_source_segment(source, fn) or ""]
    for u in sorted(used):
        if u in top and top[u] is not fn:
            parts.append(ast.get_source_segment(source, top[u]) or "")
    return "\n".join(parts)


def names_file(test_text: str, rel: str) -> bool:
    """Whether a test's text names the file: its repository path as one string, or
    each part of it as a string literal (`REPO / "examples" / "x" / "y.py"`)."""
    if rel in test_text:
        return True
    literals = set(re.findall(r"[\"']([^\"'\n]+)[\"']", test_text))
    pieces = {q for lit in literals for q in lit.split("/")}
    return all(p in pieces for p in Path(rel).parts[1:])


def check_include(b: Block, console_blocks: list[Block]) -> str | None:
    """None when the included file exists and the marker's test runs it: `path::name`
    (a test whose source names the file) or `console` (a console block of the guide
    whose command names it, or names a JSON file that names it)."""
    m = SNIPPET.match(b.text.strip())
    assert m
    rel = m.group(1)
    if not (REPO / rel).is_file():
        return f"includes {rel}, which does not exist"
    assert b.marker
    for ref in (r.strip() for r in b.marker[1].split(",")):
        if ref == "console":
            for c in console_blocks:
                for cmd, _, _ in parse_console(c.text):
                    if rel in cmd:
                        return None
                    for cfg in re.findall(r"--config (\S+\.json)", cmd):
                        if (REPO / cfg).is_file() and Path(rel).name in (REPO / cfg).read_text():
                            return None
            continue
        path, _, name = ref.partition("::")
        if not name or not (REPO / path).is_file():
            return f"run-by {ref}: name a test as path::function"
        text = _function_text(REPO / path, name)
        if text is None:
            return f"run-by {ref}: {path} defines no test `{name}`"
        if names_file(text, rel):
            return None
    return f"includes {rel}, but no test it names runs that file"


def excerpt_parts(b: Block) -> list[tuple[str, str]]:
    """(file, text) pairs to check: the block and its file; for a ```diff excerpt of
    `A, B`, its `-` and context lines against A and its `+` and context lines against B."""
    assert b.marker
    paths = [x.strip() for x in b.marker[1].split(",")]
    if b.lang != "diff":
        assert len(paths) == 1, f"{b.where}: an excerpt names one file (a ```diff two)"
        return [(paths[0], b.text)]
    assert len(paths) == 2, f"{b.where}: a ```diff excerpt names the old and the new file"
    lines = b.text.split("\n")
    old = [x[1:] for x in lines if x[:1] in ("-", " ") or x in ("...", "# ...")]
    new = [x[1:] for x in lines if x[:1] in ("+", " ") or x in ("...", "# ...")]
    return [(paths[0], "\n".join(old)), (paths[1], "\n".join(new))]


def excerpt_source(b: Block, rel: str, source: str) -> str:
    """The text an excerpt of `rel` is checked against: the file's, with the block's own
    lines (its fences included) blanked when `rel` is the block's own page, so that a
    block is never found as an excerpt of itself."""
    if rel != b.rel:
        return source
    lines = source.split("\n")
    first = b.line - 1
    last = first + len(b.text.split("\n")) + 1  # the closing fence
    return "\n".join("" if first <= i <= last else x for i, x in enumerate(lines))


def copy_of_the_checkout(dest: Path) -> Path:
    """The tracked files as they are in the working tree: what a fresh clone holds,
    with the edits not yet committed."""
    files = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    for f in filter(None, files):
        src = REPO / f.decode()
        if src.is_file():
            (dest / f.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / f.decode())
    return dest


# Runs a page's Python blocks in order in one namespace; before each, a line that says
# which block's output follows (so that each block's output is compared on its own).
DRIVER = r"""
import json, sys, traceback
ns = {"__name__": "__main__"}
for where, code in json.load(sys.stdin):
    print(f"\x00{where}\x00", flush=True)
    try:
        exec(compile(code, where, "exec"), ns)
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc(file=sys.stdout)
        sys.stdout.flush()
        sys.exit(f"{where}: the block raised")
    sys.stdout.flush()
    sys.stderr.flush()
"""


# --- run-in: which test reads a block (the API the tests call is docrun.py) -----------------


def run_in_calls(test_file: Path, test_name: str) -> set[tuple[str, str]]:
    """(page, id) of every `console(...)`/`log_lines(...)`/`statements(...)`/`config(...)`
    call with literal arguments in the test function and in the module-level names and fixtures
    it uses."""
    text = _function_text(test_file, test_name)
    if text is None:
        return set()
    out = set()
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
        if name in ("console", "log_lines", "statements", "config") and len(node.args) >= 2:
            a, b = node.args[:2]
            if isinstance(a, ast.Constant) and isinstance(b, ast.Constant):
                out.add((str(a.value), str(b.value)))
    return out


def rust_run_in_calls(test_file: Path, test_name: str) -> set[tuple[str, str]]:
    """(page, id) of every `console("PAGE", "ID")` call with literal arguments in the
    body of the Rust `#[test] fn test_name` (a Rust test parses the block itself)."""
    text = test_file.read_text()
    m = re.search(rf"#\[test\]\s*(?:#\[[^\]]*\]\s*)*fn {test_name}\s*\(", text)
    if not m:
        return set()
    start = text.index("{", m.end())
    depth, i = 0, start
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            break
        i += 1
    body = text[start : i + 1]
    return set(re.findall(r'\bconsole\(\s*"([^"]+)"\s*,\s*"([^"]+)"\s*\)', body))


def check_run_in(b: Block) -> str | None:
    """None when the test the marker names reads this block from the page."""
    assert b.marker
    m = RUN_IN.fullmatch(b.marker[1])
    assert m
    block_id, path, name = m.groups()
    if not (REPO / path).is_file():
        return f"run-in: {path} does not exist"
    calls = rust_run_in_calls if path.endswith(".rs") else run_in_calls
    if (b.rel, block_id) not in calls(REPO / path, name):
        return (
            f"run-in: {path}::{name} does not read this block "
            f'(docrun.console("{b.rel}", "{block_id}"), log_lines(...), statements(...) '
            "or config(...))"
        )
    return None
