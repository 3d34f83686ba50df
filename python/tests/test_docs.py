"""The README and the guide (docs/) cannot go stale: every fenced block is run, checked
or marked; the links into the guide resolve; the configuration reference is what the
code generates; every typed error has a troubleshooting entry; the guide builds with
no warning.

Why: most commands and code in the old README were run by nothing, and its
configuration tables were written by hand beside the schema. The conventions this test
enforces are in docs/CONVENTIONS.md: ```console blocks (`$ ` commands, `? N` exit
codes, expected lines with `[..]` wildcards) and ```python blocks run here; ```json
and ```toml blocks must parse; anything else carries `<!-- fragment: reason -->` or
`<!-- ran-by: path::test -->` (the named test must exist). Each command has 120 s; a
block that needs more names the test that runs it.

Caveats: commands run from the repository root with `target/release` and this venv's
`bin` first on PATH (`scripts/test.sh` builds the release binaries before pytest);
a console block's expected lines are matched in order, each against one whole output
line, others may come between. The Rust errors are read from the source text (the
enums listed in RUST_ERRORS); a new enum users can meet must be added there.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import pkgutil
import re
import signal
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
COMMAND_TIMEOUT_S = 120

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)[^\n]*$")
MARKER = re.compile(r"^\s*<!--\s*(fragment|ran-by):\s*(.*?)\s*-->\s*$")


@dataclass
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: tuple[str, str] | None

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


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
        marker = (mk.group(1), mk.group(2)) if mk else None
        out.append(Block(page, i + 1, lang, body, marker))
        i = j + 1
    return out


ALL = [b for p in PAGES for b in blocks(p)]
CONSOLE = [b for b in ALL if b.lang == "console" and b.marker is None]
PYTHON = [b for b in ALL if b.lang == "python" and b.marker is None]
DATA = [b for b in ALL if b.lang in ("json", "toml") and b.marker is None]


def test_every_block_is_run_checked_or_marked() -> None:
    bad = [
        f"{b.where}: ```{b.lang or '(no language)'} is neither run (console, python), checked (json, toml)"
        " nor marked (<!-- fragment: reason --> or <!-- ran-by: test -->)"
        for b in ALL
        if b.marker is None and b.lang not in ("console", "python", "json", "toml")
    ]
    bad += [f"{b.where}: a fragment needs a reason" for b in ALL if b.marker and not b.marker[1]]
    assert not bad, "\n".join(bad)
    assert CONSOLE and PYTHON, "the guide should run some console and python blocks"


def _test_exists(ref: str) -> str | None:
    path, _, name = ref.strip().partition("::")
    file = REPO / path
    if not file.is_file():
        return f"{path} does not exist"
    if name and not re.search(
        rf"^\s*(async )?(def|fn) {re.escape(name)}\b", file.read_text(), re.MULTILINE
    ):
        return f"{path} defines no test `{name}`"
    return None


def test_ran_by_names_tests_that_exist() -> None:
    bad = []
    for b in ALL:
        if b.marker and b.marker[0] == "ran-by":
            for ref in b.marker[1].split(","):
                if why := _test_exists(ref):
                    bad.append(f"{b.where}: ran-by {ref.strip()}: {why}")
                elif "::" not in ref and b.text.strip() not in (REPO / ref.strip()).read_text():
                    # A source file CI compiles or runs: the block is its text, verbatim.
                    bad.append(f"{b.where}: the block is not the text of {ref.strip()}")
    assert not bad, "\n".join(bad)


def test_json_and_toml_blocks_parse() -> None:
    bad = []
    for b in DATA:
        try:
            json.loads(b.text) if b.lang == "json" else tomllib.loads(b.text)
        except ValueError as e:
            bad.append(
                f"{b.where}: ```{b.lang} does not parse ({e}); mark a piece of a file as a fragment"
            )
    assert not bad, "\n".join(bad)


def _env(tmp: Path) -> dict[str, str]:
    env = dict(os.environ)
    home, tmpdir = tmp / "home", tmp / "tmp"
    home.mkdir()
    tmpdir.mkdir()
    env["PATH"] = os.pathsep.join(
        [str(TARGET / "release"), str(Path(sys.executable).parent), env.get("PATH", "")]
    )
    env.update(HOME=str(home), TMPDIR=str(tmpdir), XDG_RUNTIME_DIR=str(tmpdir))
    for noisy in ("RUST_LOG", "RANKEXEC_LOG", "VIRTUAL_ENV"):
        env.pop(noisy, None)
    return env


def _run(argv: list[str], env: dict[str, str], stdin: str | None = None) -> tuple[int, str]:
    """Runs in a session of its own; on timeout the whole session is killed."""
    p = subprocess.Popen(
        argv,
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = p.communicate(stdin, timeout=COMMAND_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)  # our own child's session: its pid is p.pid
        out, _ = p.communicate()
        pytest.fail(f"{argv!r} ran past {COMMAND_TIMEOUT_S} s; mark the block ran-by a test\n{out}")
    return p.returncode, out


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
        elif line.strip() and line.strip() != "...":
            steps[-1][2].append(line)
        i += 1
    return steps


def _line_pattern(expected: str) -> re.Pattern[str]:
    parts = expected.rstrip().split("[..]")
    return re.compile(".*".join(re.escape(p) for p in parts))


def check_output(expected: list[str], out: str) -> str | None:
    """None when every expected line matches a whole output line, in order."""
    got = [x.rstrip() for x in out.split("\n")]
    at = 0
    for want in expected:
        pat = _line_pattern(want)
        while at < len(got) and not pat.fullmatch(got[at]):
            at += 1
        if at == len(got):
            return f"no output line (in order) matches {want!r}"
        at += 1
    return None


def test_console_notation() -> None:
    steps = parse_console("$ a \\\n  b\n? 1\nx [..] y\n...\n$ c\n")
    assert steps == [("a \n  b", 1, ["x [..] y"]), ("c", 0, [])]
    assert check_output(["x [..] y", "z"], "x 1 2 y\nw\nz\n") is None
    assert check_output(["z", "x [..] y"], "x 1 2 y\nz\n") is not None
    assert check_output(["a(b)"], "a(b)\n") is None


@pytest.mark.parametrize("block", CONSOLE, ids=[b.where for b in CONSOLE])
def test_console_block(block: Block, tmp_path: Path) -> None:
    env = _env(tmp_path)
    for cmd, code, expected in parse_console(block.text):
        rc, out = _run(["bash", "-c", cmd], env)
        assert rc == code, f"{block.where}: `{cmd}` exited {rc}, the page says {code}:\n{out}"
        why = check_output(expected, out)
        assert why is None, f"{block.where}: `{cmd}`: {why}; it printed:\n{out}"


@pytest.mark.parametrize("block", PYTHON, ids=[b.where for b in PYTHON])
def test_python_block(block: Block, tmp_path: Path) -> None:
    rc, out = _run([sys.executable, "-"], _env(tmp_path), stdin=block.text)
    assert rc == 0, f"{block.where}: the block exited {rc}:\n{out}"


# --- links -----------------------------------------------------------------------------------


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug (what MkDocs makes a heading's anchor)."""
    from markdown.extensions.toc import slugify

    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    return slugify(text.replace("`", ""), "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text()
    text = re.sub(
        r"^(```|~~~).*?^\1", "", text, flags=re.MULTILINE | re.DOTALL
    )  # not headings inside blocks
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+?)\s*$", text, re.MULTILINE)}


def test_readme_links_resolve() -> None:
    readme = REPO / "README.md"
    bad = []
    for target in re.findall(r"\]\(([^)\s]+)\)", readme.read_text()):
        if re.match(r"[a-z]+://", target):
            continue
        path, _, anchor = target.partition("#")
        file = (REPO / path) if path else readme
        if not file.exists():
            bad.append(f"README.md links to {target}: {path} does not exist")
        elif anchor and anchor not in anchors(file):
            bad.append(
                f"README.md links to {target}: {path or 'README.md'} has no heading #{anchor}"
            )
    assert not bad, "\n".join(bad)


def test_readme_is_a_door() -> None:
    n = len((REPO / "README.md").read_text().split("\n"))
    assert n < 200, f"README.md has {n} lines; the guide (docs/) is where detail goes"


def test_figures_are_those_of_benchmarks_md() -> None:
    """The README's bold figures and the benchmarks page's table rows are quoted from
    BENCHMARKS.md, so they change when it does."""
    bench = (REPO / "BENCHMARKS.md").read_text()
    bad = [
        f"README.md: **{f}** is not in BENCHMARKS.md"
        for f in re.findall(
            r"\*\*([\d.,]+ ?(?:x|ms|s|µs|MiB|GiB))\*\*", (REPO / "README.md").read_text()
        )
        if f"**{f}**" not in bench
    ]
    bad += [
        f"docs/benchmarks.md: row not in BENCHMARKS.md: {row[:80]}"
        for row in (DOCS / "benchmarks.md").read_text().split("\n")
        if row.startswith("| ") and row not in bench
    ]
    assert not bad, "\n".join(bad)


# --- generated and checked pages -------------------------------------------------------------


def test_the_configuration_reference_is_what_the_code_generates() -> None:
    rc, out = _run([sys.executable, "scripts/gen-config-docs.py", "--check"], dict(os.environ))
    assert rc == 0, f"docs/configuration.md is stale or the code lacks a doc:\n{out}"


# The Rust error enums a user can meet, by file (None: every `...Error` enum in it).
# Not listed: the wire's own errors (CodecError, FrameError, HandshakeError, DialError,
# PackError, UnpackError, ShmError, SecretError, RankEnvError), which reach a user only
# as the cause inside a listed one (a protocol violation, a refused connection, a rank
# that fails to start), the rank side's private StartupError and SendError, DurError and
# the examples' DataError (inside a ConfigError or BuildError message).
RUST_ERRORS: dict[str, list[str] | None] = {
    "executor/src/error.rs": None,
    "executor/src/admission/mod.rs": ["AdmissionError"],
    "executor/src/admission/ledger.rs": ["LedgerError"],
    "executor/src/gpu/placement.rs": ["PlacementError"],
    "protocol/src/registry.rs": ["BuildError"],
    "protocol/src/value.rs": ["ValueError"],
    "protocol/src/component.rs": ["FireEventError"],
    "src/sim/run.rs": ["SimError"],
    "src/host/client.rs": ["ClientError"],
}


def rust_error_variants() -> list[str]:
    """`Enum::Variant` for each variant of the listed enums (FailureCause included)."""
    out: list[str] = []
    for rel, names in RUST_ERRORS.items():
        text = (REPO / rel).read_text()
        for m in re.finditer(r"pub enum (\w+)[^{]*\{", text):
            name = m.group(1)
            if names is not None and name not in names:
                continue
            if names is None and not (name.endswith("Error") or name == "FailureCause"):
                continue
            depth, j, start = 1, m.end(), m.end()
            while depth:
                depth += (text[j] == "{") - (text[j] == "}")
                j += 1
            level = 0
            for line in text[start : j - 1].split("\n"):
                s = line.strip()
                if level == 0 and (v := re.match(r"([A-Z]\w*)\b", s)):
                    out.append(f"{name}::{v.group(1)}")
                level += line.count("{") + line.count("(") - line.count("}") - line.count(")")
    return out


def python_errors() -> dict[str, list[str]]:
    """Every exception class of the package, with each name it is reachable by."""
    skip = ("__main__", "run_script")
    import rankexec

    for mod in pkgutil.walk_packages(rankexec.__path__, "rankexec."):
        if mod.name.rsplit(".", 1)[-1] not in skip:
            importlib.import_module(mod.name)
    found: dict[type, list[str]] = {}
    for name, module in sorted(sys.modules.items()):
        if name == "rankexec" or name.startswith("rankexec."):
            for attr, obj in vars(module).items():
                if (
                    inspect.isclass(obj)
                    and issubclass(obj, BaseException)
                    and (obj.__module__ or "").startswith("rankexec")
                ):
                    found.setdefault(obj, []).append(f"{name}.{attr}")
    return {f"{c.__module__}.{c.__qualname__}": names for c, names in found.items()}


def troubleshooting_headings() -> str:
    return "\n".join(
        re.findall(r"^### .*$", (DOCS / "troubleshooting.md").read_text(), re.MULTILINE)
    )


def test_every_rust_error_has_a_troubleshooting_entry() -> None:
    variants = rust_error_variants()
    assert len(variants) > 50, variants
    headings = troubleshooting_headings()
    missing = [v for v in variants if f"`{v}`" not in headings]
    assert not missing, f"docs/troubleshooting.md has no `### ` entry naming: {missing}"


def test_every_python_error_has_a_troubleshooting_entry() -> None:
    errors = python_errors()
    assert len(errors) > 15, errors
    headings = troubleshooting_headings()
    missing = [
        names[0] for names in errors.values() if not any(f"`{n}`" in headings for n in names)
    ]
    assert not missing, f"docs/troubleshooting.md has no `### ` entry naming: {missing}"


def test_the_guide_builds_without_a_warning(tmp_path: Path) -> None:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    assert mkdocs.exists(), "mkdocs is missing: pip install -r python/requirements-test.txt"
    rc, out = _run(
        [str(mkdocs), "build", "--strict", "-q", "-d", str(tmp_path / "site")], dict(os.environ)
    )
    assert rc == 0, f"mkdocs build --strict failed:\n{out}"
