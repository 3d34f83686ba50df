"""The API through which a slow test runs a guide block it reads from the page (a
`run-in` block, docs/CONVENTIONS.md): ``console()`` gives a ```console block's commands
as argv with the test's declared substitutions, ``run()`` runs one with a deadline,
``Step.check()`` compares what it printed with the console notation, and
``log_lines()``/``missing_lines()`` check a ```text block of log lines against a run's
logs, ``statements()`` gives a ```python block's top-level statements for the test
to execute in order (a deployment's admin-API block), and ``config()`` gives a config
block (a part of a file the reader writes) for the test to write and use.

Why: a FLARE simulation or a torch job takes a minute; CI runs it once, in the test
that checks what it does, and that test runs the page's commands, so the page cannot
drift from what CI ran (``test_docs.py`` checks that the named test reads the block).

Caveats: only one program per command (no pipes, `&&` except a leading `cd DIR &&`,
no shell variables; leading `NAME=value` words are the step's `env`), unless the test
asks for ``console(..., shell=True)``: then each command, a loop included, is run
whole by ``bash -c`` as the page shows it; substitutions are made once, in one pass; a
log line matches anywhere within one line of the log (what comes before it is not
compared).
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from docblocks import (
    DATA_LANGS,
    REPO,
    RUN_IN,
    Block,
    blocks,
    check_output,
    line_pattern,
    parse_console,
)

# Substitutions are declared by the test and are the only ones: `tmp=` moves every
# `/tmp/NAME` path of the block into the test's folder, `wheel=` stands for the wheel's
# file name (`rankexec-0.1.0-...whl` on the page), and `paths=` maps a path the page
# shows (`/opt/flare`, an example job) to the test's.

TARGET = Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
WHEEL_NAME = re.compile(r"rankexec-[0-9.]+-[\w.-]*\.whl")


def run_in_block(page: str, block_id: str) -> Block:
    """The block of `page` (a path from the repository root) marked `run-in: ID by ...`."""
    found = [
        b
        for b in blocks(REPO / page)
        if b.marker
        and b.marker[0] == "run-in"
        and (m := RUN_IN.fullmatch(b.marker[1]))
        and m.group(1) == block_id
    ]
    assert len(found) == 1, f"{page} has {len(found)} blocks marked run-in: {block_id} by ..."
    return found[0]


def substitute(
    text: str, tmp: Path | None, wheel: Path | None, paths: dict[str, Path] | None
) -> str:
    """One pass (a replacement is never replaced again): each of `paths` (a path the
    page shows) by the test's, the wheel's file name by `wheel`, `/tmp/` by `tmp`."""
    subs: list[tuple[str, str]] = [
        (re.escape(k), str(v)) for k, v in sorted((paths or {}).items(), key=lambda kv: -len(kv[0]))
    ]
    if wheel is not None:
        subs.append((WHEEL_NAME.pattern, str(wheel)))
    if tmp is not None:
        subs.append((r"(?<![\w./])/tmp/", str(tmp).rstrip("/") + "/"))
    if not subs:
        return text
    pattern = re.compile("|".join(f"({p})" for p, _ in subs))
    return pattern.sub(lambda m: subs[m.lastindex - 1][1] if m.lastindex else m.group(0), text)


@dataclass
class Step:
    """One `$ ` command of a block: its argv (`shlex` split; `python` and the venv's
    tools resolved to the test's interpreter), the folder it runs in (the repository
    root, or where a leading `cd DIR &&` goes), its exit code, its expected lines and
    the variables its leading `NAME=value` words set (the test adds them to its env);
    `cmd` is the command as the page shows it (its `\\` line ends kept), substitutions
    made. With `shell=True` the argv is `bash -e -c CMD` and the env empty (bash reads
    the `NAME=value` words itself)."""

    argv: list[str]
    cwd: Path
    code: int
    expected: list[str]
    env: dict[str, str] = field(default_factory=dict)  # its leading `NAME=value` words
    cmd: str = ""

    def check(self, rc: int, out: str) -> str | None:
        """None when the exit code and the output are the ones the page shows."""
        if rc != self.code:
            return f"`{' '.join(self.argv)}` exited {rc}, the page says {self.code}"
        return check_output(self.expected, out)


def console(
    page: str,
    block_id: str,
    *,
    tmp: Path | None = None,
    wheel: Path | None = None,
    paths: dict[str, Path] | None = None,
    cwd: Path = REPO,
    shell: bool = False,
) -> list[Step]:
    """The commands of a run-in ```console block, with the test's substitutions; `cwd`:
    the folder the page says they run from (the repository root unless it says);
    `shell`: each command whole through `bash -c` (a loop, a `;`), as the docs test runs
    a ```console block."""
    b = run_in_block(page, block_id)
    return steps(b, tmp=tmp, wheel=wheel, paths=paths, cwd=cwd, shell=shell)


def steps(
    b: Block,
    *,
    tmp: Path | None = None,
    wheel: Path | None = None,
    paths: dict[str, Path] | None = None,
    cwd: Path = REPO,
    shell: bool = False,
) -> list[Step]:
    """The steps of a ```console block (what `console()` gives for the page's block)."""
    assert b.lang == "console", f"{b.where} is not a ```console block"
    bindir = Path(sys.executable).parent
    out = []
    for cmd, code, expected in parse_console(b.text):
        want = [substitute(x, tmp, wheel, paths) for x in expected]
        # As shown: parse_console joined a `\` line end and the next line with a newline.
        shown = substitute(cmd, tmp, wheel, paths).replace("\n", "\\\n")
        if shell:
            # -e: a failing command inside a loop fails the step (the loop's status is its
            # last command's alone).
            out.append(Step(["bash", "-e", "-c", shown], cwd, code, want, {}, shown))
            continue
        argv = shlex.split(substitute(cmd, tmp, wheel, paths), comments=True)
        where = cwd
        if argv[:1] == ["cd"]:
            assert argv[2:3] == ["&&"], f"{b.where}: `cd DIR && COMMAND`, or no cd"
            where, argv = cwd / argv[1], argv[3:]
        env = {}
        while argv and re.fullmatch(r"[A-Za-z_]\w*=.*", argv[0]):  # `NAME=value COMMAND`
            name, _, value = argv.pop(0).partition("=")
            env[name] = value
        assert argv, f"{b.where}: no command after the variables: {cmd!r}"
        assert not {"&&", "||", ";", "|", ">", "<"} & set(argv), (
            f"{b.where}: a run-in command is one program and its arguments: {cmd!r}"
        )
        if argv[0] == ".":  # `. VENV/bin/activate`: the test that runs the block activates it
            pass
        elif argv[0] == "python":
            argv[0] = sys.executable
        elif "/" not in argv[0] and (bindir / argv[0]).exists():
            argv[0] = str(bindir / argv[0])
        elif argv[0].startswith("target/"):  # the build's, wherever CARGO_TARGET_DIR puts it
            argv[0] = str(TARGET / argv[0].removeprefix("target/"))
        out.append(Step(argv, where, code, want, env, shown))
    return out


def _descendants(root: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def start(argv: list[str], log: Path, *, cwd: Path, env: dict[str, str]) -> subprocess.Popen:
    """`argv` in a session of its own, no stdin, its stdout and stderr into `log`."""
    with log.open("w") as f:
        return subprocess.Popen(
            argv,
            cwd=cwd,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


def finish(p: subprocess.Popen, log: Path, timeout: float, what: str, grace: float = 0) -> int:
    """`p`'s exit code (started by `start`). Past `timeout` it gets SIGTERM and `grace`
    seconds first when `grace` is given (a script whose trap stops what it started), then
    its session's group and every process descended from it get SIGKILL, and the test
    fails naming `what` and the end of `log`."""
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    if grace:
        p.terminate()
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    kids = _descendants(p.pid)
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for pid in kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(timeout=30)
    raise AssertionError(f"{what} ran past {timeout} s:\n{log.read_text()[-4000:]}")


def run(
    step: Step, log: Path, timeout: float, env: dict[str, str] | None = None
) -> tuple[int, str]:
    """Runs a step in a session of its own, its output (stdout and stderr) into `log`;
    past `timeout` it and every process descended from it are SIGKILLed and the test
    fails. Returns the exit code and the output."""
    env = dict(os.environ if env is None else env) | step.env
    env["PATH"] = os.pathsep.join(
        [str(TARGET / "release"), str(Path(sys.executable).parent), env.get("PATH", "")]
    )
    p = start(step.argv, log, cwd=step.cwd, env=env)
    rc = finish(p, log, timeout, f"`{' '.join(step.argv)}`")
    return rc, log.read_text(errors="replace")


def log_lines(
    page: str, block_id: str, *, tmp: Path | None = None, paths: dict[str, Path] | None = None
) -> list[str]:
    """The lines of a run-in ```text block of log lines (blank lines left out)."""
    b = run_in_block(page, block_id)
    assert b.lang == "text", f"{b.where} is not a ```text block"
    return [substitute(x, tmp, None, paths).strip() for x in b.text.split("\n") if x.strip()]


def statements(
    page: str, block_id: str, *, tmp: Path | None = None, paths: dict[str, Path] | None = None
) -> list[str]:
    """The top-level statements of a run-in ```python block, each as its source text,
    with the test's substitutions (`paths=` maps a path the page shows, a string literal
    such as a startup kit's folder or a job's, to the test's). The test executes them in
    order in one namespace (``execute(stmt, ns, where)``), doing its own waits and
    checks between them, so every statement of the page runs as shown."""
    b = run_in_block(page, block_id)
    assert b.lang == "python", f"{b.where} is not a ```python block"
    text = substitute(b.text, tmp, None, paths)
    return [ast.get_source_segment(text, node) or "" for node in ast.parse(text).body]


def config(
    page: str, block_id: str, *, tmp: Path | None = None, paths: dict[str, Path] | None = None
) -> str:
    """The text of a run-in config block (```toml, ```json or ```yaml: a part of a file the
    reader writes, such as their crate's `[dependencies]`), with the test's substitutions;
    the test writes it where the page says it goes and runs the tool it configures."""
    b = run_in_block(page, block_id)
    assert b.lang in DATA_LANGS, f"{b.where} is not a config block ({', '.join(DATA_LANGS)})"
    return substitute(b.text, tmp, None, paths)


def execute(stmt: str, ns: dict, where: str) -> object:
    """Executes one statement of `statements()` in `ns`; an expression's value is
    returned (the test compares it with what the page's comment says), else None."""
    try:
        code = compile(stmt, where, "eval")
    except SyntaxError:
        exec(compile(stmt, where, "exec"), ns)  # noqa: S102 (the guide's own block)
        return None
    return eval(code, ns)


def missing_lines(lines: list[str], log: str) -> list[str]:
    """The shown log lines that are not in the log: each must match within one line of
    it (`[..]` any text), so a timestamp and a logger's prefix may come before it."""
    got = log.split("\n")
    return [
        w
        for w in lines
        if not any(line_pattern(w).search(g) for g in got)  # search: prefixes vary
    ]
