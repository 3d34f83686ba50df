"""The README and the guide (docs/) cannot go stale: every fenced block is a test of
itself; the links into the guide resolve; the configuration reference is what the code
generates; every typed error has a troubleshooting entry; the guide builds with no
warning.

Why: most commands and code in the old README were run by nothing, and markers that
only named a test let a block drift from what the test did. The kinds a block can be
(docs/CONVENTIONS.md, "Fenced blocks"; the rules are in ``docblocks.py``): run as shown
with its output compared (```console, ```python with an ```text output block after it),
run in a fresh copy of the checkout, run by ``tests/tour.rs`` (the README's tour),
written to a file that a run block then uses (config blocks), included from a file a
named test runs (``--8<--``), an excerpt checked verbatim against its file, or a diagram.

Caveats: commands run from the repository root with `target/release` and this venv's
`bin` first on PATH (`scripts/test.sh` builds the release binaries before pytest); each
command has 120 s. A page's Python blocks run in one interpreter, in order, sharing one
namespace. The Rust errors are read from the source text (the enums listed in
RUST_ERRORS); a new enum users can meet must be added there.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import itertools
import json
import os
import pkgutil
import re
import signal
import subprocess
import sys
import tomllib
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docrun
import pytest
import yaml
from docblocks import (
    DATA_LANGS,
    DOCS,
    DRIVER,
    REPO,
    SNIPPET,
    Block,
    blocks,
    check_excerpt,
    check_include,
    check_output,
    check_run_in,
    copy_of_the_checkout,
    excerpt_parts,
    excerpt_source,
    kind,
    parse_console,
)
from docrun import execute, missing_lines, substitute

TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
PAGES = [REPO / "README.md", *sorted(DOCS.glob("*.md"))]
COMMAND_TIMEOUT_S = 120
# Set in the docs test that test_the_commands_before_a_commit_run_as_shown starts.
NESTED = "RANKEXEC_DOCS_TEST_NESTED"

ALL = [b for p in PAGES for b in blocks(p)]


def _kind_or_none(b: Block) -> str | None:
    try:
        return kind(b)
    except AssertionError:
        return None


def _of(k: str, lang: str | None = None) -> list[Block]:
    return [b for b in ALL if _kind_or_none(b) == k and (lang is None or b.lang == lang)]


CONSOLE = _of("run", "console") + _of("fresh-clone")
PY_PAGES = sorted({b.page for b in _of("run", "python")})


def counts() -> dict[str, int]:
    """How many blocks of README.md and docs/*.md are of each kind: `executed` (run as
    shown, output compared where shown: console, python, their output blocks, config
    files a run uses, the README tour, run-in blocks a named test runs), `included` (from a file a test runs),
    `excerpts` (checked verbatim), `diagrams`, `unchecked` (each with its reason)."""
    c = Counter(_kind_or_none(b) for b in ALL)
    return {
        "executed": c["run"] + c["fresh-clone"] + c["tour"] + c["file"] + c["run-in"],
        "included": c["include"],
        "excerpts": c["excerpt"],
        "diagrams": c["diagram"],
        "unchecked": c["unchecked"],
        "total": len(ALL),
    }


def test_every_block_is_of_a_kind() -> None:
    bad = []
    for b in ALL:
        try:
            kind(b)
        except AssertionError as e:
            bad.append(str(e))
    assert not bad, "\n".join(bad)
    print(f"\nfenced blocks: {counts()}")


INDEX_CLAIM = re.compile(
    r"Of the (\d+) fenced blocks.*?(\d+) are run as shown.*?(\d+) are included"
    r".*?(\d+) are excerpts.*?(\d+) are diagrams.*?(\d+) are not checked",
    re.DOTALL,
)


def test_the_index_states_the_counts() -> None:
    """docs/index.md says how many blocks are of each kind: the figures are the ones
    this test computes (`counts()`)."""
    m = INDEX_CLAIM.search((DOCS / "index.md").read_text())
    assert m, f"docs/index.md must state the counts as {INDEX_CLAIM.pattern!r}"
    c = counts()
    want = (
        c["total"],
        c["executed"],
        c["included"],
        c["excerpts"],
        c["diagrams"],
        c["unchecked"],
    )
    said = tuple(int(x) for x in m.groups())
    assert said == want, f"docs/index.md says {said}, the blocks are {want}: {c}"


def test_output_blocks_follow_a_python_block() -> None:
    bad = []
    for p in PAGES:
        bs = blocks(p)
        for prev, b in zip([None, *bs], bs):
            if (
                b.marker
                and b.marker[0] == "output"
                and (prev is None or _kind_or_none(prev) != "run" or prev.lang != "python")
            ):
                bad.append(f"{b.where}: an output block must follow a run ```python block")
    assert not bad, "\n".join(bad)


def test_excerpts_are_verbatim() -> None:
    bad = []
    for b in _of("excerpt"):
        for rel, text in excerpt_parts(b):
            path = REPO / rel
            if not path.is_file():
                bad.append(f"{b.where}: excerpt of {rel}, which does not exist")
            elif why := check_excerpt(text, excerpt_source(b, rel, path.read_text())):
                bad.append(f"{b.where}: not an excerpt of {rel}: {why}")
    assert not bad, "\n\n".join(bad)


def test_includes_are_files_a_test_runs() -> None:
    console = [b for b in ALL if b.lang == "console"]
    bad = [f"{b.where}: {why}" for b in _of("include") if (why := check_include(b, console))]
    assert not bad, "\n".join(bad)


def test_run_in_blocks_are_read_by_their_test() -> None:
    """A `run-in` block's test reads it from the page (its source calls
    `docrun.console(PAGE, ID)` or `log_lines(PAGE, ID)`), so renaming the test,
    dropping the call or the block fails here; the test then runs what it read."""
    bad = [f"{b.where}: {why}" for b in _of("run-in") if (why := check_run_in(b))]
    assert not bad, "\n".join(bad)


def _parse(b: Block) -> None:
    if b.lang == "json":
        json.loads(b.text)
    elif b.lang == "toml":
        tomllib.loads(b.text)
    else:
        yaml.safe_load(b.text)


def test_config_blocks_parse() -> None:
    bad = []
    for b in ALL:
        if b.lang in DATA_LANGS and not SNIPPET.match(b.text.strip()):
            try:
                _parse(b)
            except ValueError as e:
                bad.append(f"{b.where}: ```{b.lang} does not parse ({e})")
    assert not bad, "\n".join(bad)


def test_file_blocks_are_used_by_a_run_block() -> None:
    """A config block written to a file is used by a command or Python block of the
    same page that runs it through the tool it configures."""
    bad = []
    for b in _of("file"):
        assert b.marker
        users = [
            u
            for u in blocks(b.page)
            if _kind_or_none(u) in ("run", "fresh-clone") and b.marker[1] in u.text
        ]
        if not users:
            bad.append(f"{b.where}: no run block of the page uses {b.marker[1]}")
    assert not bad, "\n".join(bad)


def test_the_tour_blocks_are_the_readmes_tour() -> None:
    """`tests/tour.rs` runs the ```console blocks of the README's tour section: the
    blocks marked for it are exactly those."""
    readme = (REPO / "README.md").read_text()
    start = readme.index("## A five-minute tour")
    end = readme.find("\n## ", start + 3)
    first = readme[:start].count("\n") + 1
    last = readme[: end if end > 0 else len(readme)].count("\n") + 1
    in_tour = [
        b for b in blocks(REPO / "README.md") if b.lang == "console" and first <= b.line <= last
    ]
    assert in_tour, "the README's tour has no ```console block"
    assert {b.where for b in in_tour} == {b.where for b in _of("tour")}


def _write_files(page: Path) -> None:
    """The page's `file` blocks, written where their markers say (absolute paths)."""
    for b in blocks(page):
        if _kind_or_none(b) == "file":
            assert b.marker
            path = Path(b.marker[1])
            assert path.is_absolute() and str(path).startswith("/tmp/"), (
                f"{b.where}: a file block is written under /tmp/"
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(b.text.rstrip("\n") + "\n")


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


def _run(
    argv: list[str], env: dict[str, str], stdin: str | None = None, cwd: Path = REPO
) -> tuple[int, str]:
    """Runs in a session of its own; on timeout the whole session is killed."""
    p = subprocess.Popen(
        argv,
        cwd=cwd,
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
        pytest.fail(f"{argv!r} ran past {COMMAND_TIMEOUT_S} s; make the block an excerpt\n{out}")
    return p.returncode, out


def test_the_notation() -> None:
    steps = parse_console("$ a \\\n  b\n? 1\nx [..] y\n...\n$ c\n")
    assert steps == [("a \n  b", 1, ["x [..] y", "..."]), ("c", 0, [])]
    assert check_output(["x [..] y", "...", "z"], "x 1 2 y\nw\nz\n") is None
    assert check_output(["x [..] y", "z"], "x 1 2 y\nw\nz\n") is not None  # w is not shown
    assert check_output(["z", "...", "x [..] y"], "x 1 2 y\nz\n") is not None
    assert check_output(["a(b)"], "a(b)\n") is None
    assert check_output(["...", "b"], "a\nb\n") is None
    assert check_output([], "anything\n") is not None  # output the page does not show
    src = "def f():\n    a = 1\n\n    b = 2\n    c = 3\n"
    assert check_excerpt("a = 1\n\nb = 2", src) is None
    assert check_excerpt("a = 1\n...\nc = 3", src) is None
    assert check_excerpt("a = 1\nc = 3", src) is not None
    assert check_excerpt("c = 3\n...\na = 1", src) is not None
    # An excerpt of its own page is looked for in the page's other lines, never in itself.
    own = Block(REPO / "README.md", 3, "console", "$ x", ("excerpt", "README.md"))
    page = "a\n\n```console\n$ x\n```\nb\n"
    assert check_excerpt(own.text, excerpt_source(own, "README.md", page)) is not None
    assert check_excerpt(own.text, excerpt_source(own, "README.md", page + "$ x\n")) is None
    assert excerpt_source(own, "docs/index.md", page) == page
    # run-in: log lines match within a line; the substitutions are made once.
    assert missing_lines(["a [..] c"], "2026 INFO a b c\n") == []
    assert missing_lines(["a [..] d"], "2026 INFO a b c\n") == ["a [..] d"]
    assert substitute("/tmp/x /opt/s", Path("/tmp/p"), None, {"/opt/s": Path("/tmp/p/w")}) == (
        "/tmp/p/x /tmp/p/w"
    )
    whl = "pip install 'rankexec-0.1.0-...whl[flare]' rankexec-0.1.0-cp311-abi3-x.whl"
    assert substitute(whl, None, Path("/w/r.whl"), None) == "pip install '/w/r.whl[flare]' /w/r.whl"
    # A run-in block whose test does not read it is refused (this test reads none).
    page = REPO / "docs" / "index.md"
    marker = ("run-in", "x by python/tests/test_docs.py::test_the_notation")
    why = check_run_in(Block(page, 1, "console", "$ true", marker))
    assert why is not None and "does not read this block" in why, why
    no_test = ("run-in", "x by python/tests/test_docs.py::no_such_test")
    assert check_run_in(Block(page, 1, "console", "$ true", no_test)) is not None
    # A ```python run-in block (a deployment's admin API) is one too, refused the same way;
    # its test executes its statements one by one, an expression's value returned.
    assert kind(Block(page, 1, "python", "x = 1", marker)) == "run-in"
    assert check_run_in(Block(page, 1, "python", "x = 1", marker)) is not None
    ns: dict = {}
    assert execute("x = 2", ns, "here") is None and execute("x + 1", ns, "here") == 3
    # A console run-in step: `cd DIR &&`, then `NAME=value` words (its env), then argv.
    b = Block(page, 1, "console", "$ cd x && A=1 B='c d' python y.py /tmp/z  # or w\n...", None)
    (step,) = docrun.steps(b, tmp=Path("/w"))
    assert step.argv == [sys.executable, "y.py", "/w/z"] and step.cwd == REPO / "x", step
    assert step.env == {"A": "1", "B": "c d"} and step.expected == ["..."], step
    # shell=True: the command whole, as shown (its `\` line ends kept), through bash -e.
    loop = "$ for x in 1 2; do \\\n  echo $x; \\\ndone\n1\n2"
    (step,) = docrun.steps(Block(page, 1, "console", loop, None), shell=True)
    assert step.argv == ["bash", "-e", "-c", "for x in 1 2; do \\\n  echo $x; \\\ndone"], step
    assert step.cmd == step.argv[3] and step.expected == ["1", "2"], step
    # A Rust test reads a block through its own `console("PAGE", "ID")` call.
    mpi = ("run-in", "mpi by tests/mpi.rs::the_guides_mpi_command_runs_as_shown")
    assert check_run_in(Block(REPO / "docs" / "gpus-launchers.md", 1, "console", "", mpi)) is None
    other = ("run-in", "mpi by tests/mpi.rs::mpirun_trains_to_the_stated_accuracy_and_tears_down")
    assert check_run_in(Block(REPO / "docs" / "gpus-launchers.md", 1, "console", "", other))
    assert check_run_in(Block(page, 1, "console", "", mpi)) is not None  # another page
    # A run-in config block (a part of a file the reader writes) is one too.
    assert kind(Block(page, 1, "toml", "[dependencies]", marker)) == "run-in"


@pytest.mark.parametrize("block", CONSOLE, ids=[b.where for b in CONSOLE])
def test_console_block(block: Block, tmp_path: Path) -> None:
    if os.environ.get(NESTED):
        pytest.skip("run by the suite that started this nested docs test already")
    env = _env(tmp_path)
    cwd = REPO
    if kind(block) == "fresh-clone":
        cwd = copy_of_the_checkout(tmp_path / "rankexec")
    _write_files(block.page)
    for cmd, code, expected in parse_console(block.text):
        rc, out = _run(["bash", "-c", cmd], env, cwd=cwd)
        assert rc == code, f"{block.where}: `{cmd}` exited {rc}, the page says {code}:\n{out}"
        why = check_output(expected, out)
        assert why is None, f"{block.where}: `{cmd}`: {why}; it printed:\n{out}"


@pytest.mark.parametrize("page", PY_PAGES, ids=[str(p.relative_to(REPO)) for p in PY_PAGES])
def test_python_blocks(page: Path, tmp_path: Path) -> None:
    if os.environ.get(NESTED):
        pytest.skip("run by the suite that started this nested docs test already")
    bs = blocks(page)
    runs = [b for b in bs if b.lang == "python" and _kind_or_none(b) == "run"]
    _write_files(page)
    rc, out = _run(
        [sys.executable, "-c", DRIVER],
        _env(tmp_path),
        stdin=json.dumps([(b.where, b.text) for b in runs]),
    )
    assert rc == 0, f"{page.relative_to(REPO)}: a block failed:\n{out}"
    printed = dict(re.findall(r"\x00([^\x00]+)\x00\n?([^\x00]*)", out))
    for prev, b in itertools.pairwise(bs):
        if b.marker and b.marker[0] == "output" and prev in runs:
            why = check_output(b.text.split("\n"), printed.get(prev.where, ""))
            assert why is None, (
                f"{b.where}: the output {prev.where} printed is not the one shown: {why}; "
                f"it printed:\n{printed.get(prev.where, '')}"
            )


def test_a_crate_of_your_own_resolves_the_guides_dependencies(tmp_path: Path) -> None:
    """docs/development.md's `[dependencies]` for a worker binary of your own, as shown:
    in a crate beside a checkout of rankexec (`../rankexec`, here a link to this one),
    cargo resolves them offline (the crates' names, their paths and versions, serde's
    feature), and the crates it finds are this checkout's."""
    deps = docrun.config("docs/development.md", "your-crate")
    crate = tmp_path / "my-worker"
    (crate / "src").mkdir(parents=True)
    (tmp_path / "rankexec").symlink_to(REPO)
    (crate / "src" / "main.rs").write_text("fn main() {}\n")
    (crate / "Cargo.toml").write_text(
        '[package]\nname = "my-worker"\nversion = "0.1.0"\nedition = "2021"\n\n' + deps
    )
    argv = ["cargo", "metadata", "--offline", "--format-version", "1"]
    p = subprocess.run(
        [*argv, "--manifest-path", str(crate / "Cargo.toml")],
        check=False,
        cwd=REPO,  # rust-toolchain.toml's toolchain
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT_S,
    )
    assert p.returncode == 0, f"cargo metadata refused the guide's [dependencies]:\n{p.stderr}"
    found = {
        pkg["name"]: Path(pkg["manifest_path"]).resolve().parent
        for pkg in json.loads(p.stdout)["packages"]
    }
    assert found.get("rankexec-protocol") == REPO / "protocol", found
    assert found.get("rankexec-sub-worker") == REPO / "sub_worker", found
    assert "serde" in found, found


def test_the_gpu_check_runs_as_shown(tmp_path: Path) -> None:
    """docs/testing.md's `scripts/gpu-check.sh` command, as shown (its `/tmp/` is the
    test's): it prints what the page shows and writes its summary where `OUT` says.
    Without a GPU it takes seconds (every GPU check is SKIPPED); with one, minutes."""
    (step,) = docrun.console("docs/testing.md", "gpu-check", tmp=tmp_path)
    rc, out = docrun.run(step, tmp_path / "gpu-check.out", timeout=600)
    assert (why := step.check(rc, out)) is None, f"{why}; it printed:\n{out}"
    assert (Path(step.env["OUT"]) / "gpu-check" / "summary.txt").is_file(), step.env


def test_a_short_flake_check_runs_as_shown(tmp_path: Path) -> None:
    """docs/testing.md's short `scripts/flake-check.sh` run, as shown: one Python file
    once idle and once loaded, and the table it ends with (about 10 s)."""
    (step,) = docrun.console("docs/testing.md", "short-check")
    rc, out = docrun.run(step, tmp_path / "flake-check.out", timeout=300)
    assert (why := step.check(rc, out)) is None, f"{why}; it printed:\n{out}"


# The guide's commands that take minutes to hours, by page and block: each script they
# run plans without running when RANKEXEC_DRY_RUN=1 (its header says what it checks).
DRY_RUN = {"RANKEXEC_DRY_RUN": "1"}


def _run_steps(where: str, steps: list[docrun.Step], log: Path, env: dict[str, str]) -> None:
    for i, step in enumerate(steps):
        rc, out = docrun.run(step, log.with_suffix(f".{i}.out"), timeout=COMMAND_TIMEOUT_S, env=env)
        assert (why := step.check(rc, out)) is None, (
            f"{where}: `{step.cmd}`: {why}; it printed:\n{out}"
        )


def test_the_long_commands_run_dry_as_shown(tmp_path: Path) -> None:
    """The benchmarks behind BENCHMARKS.md (docs/benchmarks.md's `scripts/bench-all.sh`
    and `benchmarks/tables.py`, docs/large-models-scripts.md's loop, docs/sharded-training.md's
    three runs) and docs/testing.md's three flake checks, each command read from the page
    and run as shown (`bash -c`, from the repository root, the loop included) with
    RANKEXEC_DRY_RUN=1: each script parses and checks its arguments as for a real run,
    prints what it would run and exits 0, so a flag, a choice or a file a page names that
    is gone fails here (tables.py runs for real, on the committed records). The four blocks
    run at once (each script imports torch: about 3 s a command). Skipped in the nested docs
    test: the outer one runs it."""
    if os.environ.get(NESTED):
        pytest.skip("inside the docs test that the guide's own block started: the outer runs it")
    blocks = {
        "docs/benchmarks.md": docrun.console("docs/benchmarks.md", "bench-all", shell=True),
        "docs/large-models-scripts.md": docrun.console(
            "docs/large-models-scripts.md", "large-model-runs", shell=True
        ),
        "docs/sharded-training.md": docrun.console(
            "docs/sharded-training.md", "fsdp-runs", shell=True
        ),
        "docs/testing.md": docrun.console("docs/testing.md", "flake-checks", shell=True),
    }
    env = dict(os.environ) | DRY_RUN
    with ThreadPoolExecutor(len(blocks)) as pool:
        done = [
            pool.submit(_run_steps, page, steps, tmp_path / Path(page).stem, env)
            for page, steps in blocks.items()
        ]
    for f in done:
        f.result()


def test_the_flare_test_commands_run_as_shown(tmp_path: Path) -> None:
    """docs/flare-jobs.md's commands for the FLARE tests by hand, read from the page and
    run as shown in this environment (cargo's toolchain is found through HOME, which a
    ```console block of the docs test does not keep): the release build (nothing to do
    after scripts/test.sh's) and one file of python/tests/flare, whose tests must pass
    (about 5 s; the whole folder is what scripts/test.sh runs). Skipped in the nested
    docs test: the outer one runs it."""
    if os.environ.get(NESTED):
        pytest.skip("inside the docs test that the guide's own block started: the outer runs it")
    steps = docrun.console("docs/flare-jobs.md", "flare-tests")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    _run_steps("docs/flare-jobs.md", steps, tmp_path / "flare", env)


def test_installing_from_a_checkout_runs_as_shown(tmp_path: Path) -> None:
    """docs/rank-code.md's install from a checkout, read from the page and run as shown in
    this venv: both `pip install` commands with pip's own dry run (`PIP_DRY_RUN=1`: pip
    resolves and says what it would install, and builds `./python`'s metadata with the
    venv's maturin, `PIP_NO_BUILD_ISOLATION=0`, so nothing is fetched or installed), the
    cargo build for real (nothing to do after scripts/test.sh's). Skipped in the nested
    docs test: the outer one runs it."""
    if os.environ.get(NESTED):
        pytest.skip("inside the docs test that the guide's own block started: the outer runs it")
    steps = docrun.console("docs/rank-code.md", "from-a-checkout")
    pip = {"PIP_DRY_RUN": "1", "PIP_NO_BUILD_ISOLATION": "0"}
    assert [s.argv[1:2] for s in steps] == [["install"], ["install"], ["build"]], steps
    env = dict(os.environ) | pip
    _run_steps("docs/rank-code.md", steps, tmp_path / "install", env)


def test_the_commands_before_a_commit_run_as_shown(tmp_path: Path) -> None:
    """The commands docs/CONVENTIONS.md and docs/development.md give for checking the
    guide by hand, read from the pages and run as shown (their `target/site` in the
    test's folder): `mkdocs build --strict`, this very file's `python -m pytest ... -q`,
    run for real once (in that run this test skips, or it would start itself again
    without end, and so do the guide's console and Python blocks, which the suite that
    started it runs already: about 10 s), and `python scripts/gen-config-docs.py`, in a copy of the
    checkout, where the page it writes must be the committed one."""
    if os.environ.get(NESTED):
        pytest.skip("inside the docs test that the guide's own block started: not again")
    paths = {"target/site": tmp_path / "site"}
    conv = docrun.console("docs/CONVENTIONS.md", "before-a-commit", paths=paths)
    dev = docrun.console("docs/development.md", "by-hand", paths=paths)
    assert [s.argv for s in conv] == [s.argv for s in dev[:2]], "the pages' two commands differ"
    assert conv[1].argv[1:4] == ["-m", "pytest", "python/tests/test_docs.py"], conv[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")} | {NESTED: "1"}
    for i, (step, same) in enumerate(zip(conv, dev)):
        rc, out = docrun.run(step, tmp_path / f"step-{i}.out", timeout=900, env=env)
        for where, s in (("docs/CONVENTIONS.md", step), ("docs/development.md", same)):
            assert (why := s.check(rc, out)) is None, f"{where}: {why}; it printed:\n{out[-4000:]}"
    copy = copy_of_the_checkout(tmp_path / "rankexec")
    (copy / "target").symlink_to(TARGET)  # the release build the script reads the schema from
    (gen,) = dev[2:]
    gen = dataclasses.replace(gen, cwd=copy)
    rc, out = docrun.run(gen, tmp_path / "gen.out", timeout=COMMAND_TIMEOUT_S, env=env)
    assert (why := gen.check(rc, out)) is None, f"docs/development.md: {why}; it printed:\n{out}"
    page = "docs/configuration.md"
    assert (copy / page).read_text() == (REPO / page).read_text(), f"{page} is not what it writes"


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
    # Without -q: mkdocs 1.6 exits 0 under `-q --strict` even when it warned; the
    # WARNING lines are checked too, should a plugin log one that --strict does not count.
    rc, out = _run(
        [str(mkdocs), "build", "--strict", "-d", str(tmp_path / "site")], dict(os.environ)
    )
    warned = [x for x in out.splitlines() if x.startswith(("WARNING", "ERROR"))]
    assert rc == 0 and not warned, f"mkdocs build --strict failed (exit {rc}):\n{out}"
