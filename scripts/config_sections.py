"""The configuration reference's sections beyond the settings tables: the site policy
file, the rank sources, the environment variables and the command lines, each read
from the code (scripts/gen-config-docs.py imports this; so does
python/tests/test_config_reference.py, which checks the page against the same code by
other routes: the binaries' ``--help``, a grep of the sources).

Why a module of its own: the generator was near the size of one file. Caveats: the
Rust command line is read from the built binary (``target/release/rankexec``, what the
Python tests drive), so the page follows the last ``cargo build --release``; the Python
command lines are read by calling each ``main`` with ``parse_args`` replaced by a
function that hands back the parser, so a ``main`` that does work before it parses
would do that work here (none does).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import re
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RUST_CLI = ROOT / "target" / "release" / "rankexec"

# The Python command lines a user (or an executor) starts: (how it is typed, module).
PY_CLIS = [
    ("python -m rankexec.flare", "rankexec.flare.__main__"),
    ("python -m rankexec.flower.host", "rankexec.flower.host"),
]

# Where the code reads or sets a RANKEXEC_ variable; the test greps the same folders.
SOURCES = [
    "python/rankexec",
    "python/src",
    "src",
    "executor/src",
    "sub_worker/src",
    "protocol/src",
]

# Variables that are not in protocol/src/env.rs (the executor-rank contract), with who
# reads them. The test fails on a variable of the code missing here or in env.rs.
OTHER_VARS = {
    "RANKEXEC_LOG": (
        "you",
        (
            "The `rankexec` binary's and the ranks' log filter (`tracing`'s `EnvFilter` syntax,"
            " e.g. `info`, `rankexec_executor=debug`); `RUST_LOG` when unset."
        ),
    ),
    "RANKEXEC_FLOWER_SITE": (
        "you (the SuperNode's environment)",
        "The Flower site file, when the SuperNode's `--node-config` names no `rankexec-site`.",
    ),
    "RANKEXEC_FLOWER_DIR": (
        "you (the SuperNode's environment)",
        (
            "The base folder of the Flower node's host sockets and state (default:"
            " `$XDG_RUNTIME_DIR`); set it to a folder that outlives a login session."
        ),
    ),
    "RANKEXEC_GPU_INVENTORY": (
        "you, or `GpuResourceManager(inventory=)`",
        (
            "Declares the host's GPUs instead of asking NVML: `2x16GiB`, `80GiB,2x24GiB`, `none`;"
            " every rankexec process that inherits it (jobs, ranks, `rankexec gpus`) sees those."
        ),
    ),
    "RANKEXEC_FLOWER_NODE_DIR": (
        "you (the SuperNode's environment)",
        (
            "The node folder of a Flower host the site runs as its own service user: a ClientApp"
            " then connects to that host and never starts one."
        ),
    ),
    "RANKEXEC_FLOWER_HOST_UID": (
        "you (the SuperNode's environment)",
        "The uid (a name or a number) that host must run as; default the ClientApp's own.",
    ),
    "RANKEXEC_PIN_HOST": (
        "you (the ranks' environment)",
        (
            "`0`: `rankexec.tensors.to_device` copies to the GPU from pageable memory instead of"
            " registering the host memory as pinned for the copy."
        ),
    ),
    "RANKEXEC_GPU_GRANT": (
        "`GpuResourceConsumer` (FLARE's job process)",
        (
            "The GPU ledger entry a job's reserved GPUs belong to; a group inside that grant does"
            " not count it against itself."
        ),
    ),
}
# env.rs's variables that a user may set (the rest the executor sets for its ranks).
USER_SET = {"RANKEXEC_RANK_SOURCE", "RANKEXEC_CONNECT_TIMEOUT_MS"}


class SectionError(Exception):
    """The code has a shape or a gap these sections refuse to paper over."""


def _docstring_list(doc: str, keys: set[str], where: str) -> list[str]:
    """The ``- ``key``: text`` items of a docstring, checked against ``keys``."""
    items = re.findall(
        r"^- ``(\w+)``: (.*?)(?=^- ``|^\S|\Z)", doc, re.MULTILINE | re.DOTALL
    )
    found = {k for k, _ in items}
    if found != keys:
        raise SectionError(
            f"{where} documents {sorted(found)}, the code accepts {sorted(keys)}"
        )
    return [f"- `{k}`: " + " ".join(t.split()).replace("``", "`") for k, t in items]


def policy_section() -> list[str]:
    policy = importlib.import_module("rankexec.flare.policy")
    body = (policy.__doc__ or "").split("code the site decides", 1)[1]
    return [
        "## FLARE site policy file",
        "",
        "`<site workspace>/local/rankexec.json`, which the site's admin writes (`python -m",
        "rankexec.flare policy`, or `allow-list --script`): what a FLARE job without custom",
        'code (or every job, with `byoc_jobs` `"restricted"`) may make',
        "`rankexec.flare.MultiProcessExecutor` and `ScriptExecutor` run. Unknown keys or",
        "wrong types refuse every job. All keys are optional. From",
        "`python/rankexec/flare/policy.py`.",
        "",
        *_docstring_list(body, set(policy._KEYS), "rankexec.flare.policy's docstring"),
    ]


def rank_sources() -> list[tuple[str, str]]:
    """``(value, doc)`` of every ``rank_source`` value, from protocol/src/env.rs."""
    text = (ROOT / "protocol/src/env.rs").read_text()
    enum = text.split("pub enum RankSource {", 1)[1].split("\n}", 1)[0]
    docs = {v: d for d, v in re.findall(r"///\s*(.+?)\n\s*(\w+),", enum)}
    names = dict(re.findall(r"RankSource::(\w+) => \"(\w+)\",", text))
    if set(docs) != set(names):
        raise SectionError(
            f"RankSource variants {sorted(docs)} vs names {sorted(names)}"
        )
    out = [
        (
            "auto",
            "The default: the first of the others, in this order, whose variables are set.",
        )
    ]
    return out + [(names[v], docs[v].replace("`", "`")) for v in docs]


def rank_source_section() -> list[str]:
    out = [
        "## `rank_source` values",
        "",
        "Which launcher's variables hold each rank's number: a command launcher's",
        "`rank_source`, or `RANKEXEC_RANK_SOURCE` in the ranks' environment. From",
        "`protocol/src/env.rs`.",
        "",
        "| value | the variables read |",
        "|---|---|",
    ]
    return out + [f"| `{v}` | {d} |" for v, d in rank_sources()]


def env_vars() -> list[tuple[str, str, str]]:
    """``(name, who sets it, meaning)``: env.rs's variables, then the others."""
    text = (ROOT / "protocol/src/env.rs").read_text()
    mod = text.split("pub mod vars {", 1)[1].split("\n}", 1)[0]
    out = []
    for doc, name in re.findall(
        r"((?:\s*///[^\n]*\n)+)\s*pub const \w+: &str = \"(\w+)\";", mod
    ):
        if not name.startswith("RANKEXEC_"):
            continue
        text_ = " ".join(x.strip()[3:].strip() for x in doc.strip().split("\n"))
        who = (
            "you (the ranks' environment)"
            if name in USER_SET
            else "the executor, for its ranks"
        )
        out.append((name, who, text_))
    return out + [(n, who, d) for n, (who, d) in OTHER_VARS.items()]


def env_section() -> list[str]:
    out = [
        "## Environment variables",
        "",
        "Every `RANKEXEC_` variable the code reads or sets. Those the executor sets for its",
        "ranks are listed so that a rank program written by hand can read them; do not set",
        "them yourself. From `protocol/src/env.rs` and the modules that read the others.",
        "",
        "| variable | set by | meaning |",
        "|---|---|---|",
    ]
    return out + [f"| `{n}` | {who} | {d} |" for n, who, d in env_vars()]


def rust_commands() -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """``rankexec``'s subcommands: ``{name: (about, [(argument or flag, help)])}``."""

    def help_of(*args: str) -> str:
        r = subprocess.run(
            [str(RUST_CLI), *args, "--help"],
            check=False,
            capture_output=True,
            text=True,
            timeout=30,
        )
        if r.returncode != 0:
            raise SectionError(f"{RUST_CLI} {' '.join(args)} --help: {r.stderr}")
        return r.stdout

    if not RUST_CLI.exists():
        raise SectionError(f"{RUST_CLI} is not built (cargo build --release)")
    top = help_of()
    subs = re.findall(
        r"^  (\w+)\s+(.+)$", top.split("Commands:", 1)[1].split("\n\n")[0], re.MULTILINE
    )
    out: dict[str, tuple[str, list[tuple[str, str]]]] = {}
    for name, about in subs:
        if name == "help":
            continue
        rows: list[tuple[str, str]] = []
        text = help_of(name)
        for part in ("Arguments:", "Options:"):
            if part not in text:
                continue
            block = text.split(part, 1)[1].split("\n\n")[0]
            for line in block.strip("\n").split("\n"):
                m = re.match(
                    r"\s+((?:-\w, )?(?:--[\w-]+)?(?: ?<\w+>|\.\.\.|\[\w+\]\.\.\.)*)\s{2,}(.*)$",
                    line,
                )
                if not m or m.group(1) in ("-h, --help",):
                    continue
                rows.append((m.group(1).strip(), m.group(2).strip()))
        if "Options:" not in text:  # `worker` hands its arguments to the rank program
            usage, what = (text.strip().split("\n") + [""])[:2]
            rows.append((usage.removeprefix("usage: ").replace("|", "/"), what.strip()))
        out[name] = (about.strip(), rows)
    return out


# --- Python signatures ---------------------------------------------------------------


def _args_section(fn: Any) -> dict[str, str]:
    doc = inspect.getdoc(fn) or ""
    if "\nArgs:\n" not in "\n" + doc:
        raise SectionError(
            f"{fn.__module__}.{fn.__qualname__} has no `Args:` section in its docstring"
        )
    part = doc.split("Args:\n", 1)[1]
    out: dict[str, str] = {}
    names: list[str] = []
    firsts: dict[str, str] = {}
    for line in part.split("\n"):
        if not line.strip():
            if names:
                continue
            break
        if not line.startswith(" "):
            break
        m = re.match(r"    ([\w, ]+?): (.*)$", line)
        if m and not line.startswith("     "):
            names = [n.strip() for n in m.group(1).split(",")]
            for n in names:
                out[n] = m.group(2).strip()
                firsts[n] = names[0]
        elif names:
            for n in names:
                out[n] += " " + line.strip()
    # One entry for several args: the first carries the text, the others point at it.
    return {
        n: (t if firsts[n] == n else f"as for `{firsts[n]}`") for n, t in out.items()
    }


def _py_default(p: inspect.Parameter) -> str:
    if p.default is inspect.Parameter.empty:
        return "required"
    d = getattr(p.default, "value", p.default)
    if d is None:
        return "none"
    return f"`{d!r}`".replace("'", '"')


def python_section(path: str) -> list[str]:
    module, name = path.rsplit(".", 1)
    obj = getattr(importlib.import_module(module), name)
    fn = obj.__init__ if inspect.isclass(obj) else obj
    args = _args_section(fn)
    params = [p for p in inspect.signature(fn).parameters.values() if p.name != "self"]
    missing = [p.name for p in params if p.name not in args]
    extra = sorted(set(args) - {p.name for p in params})
    if missing or extra:
        raise SectionError(f"{path}: `Args:` lacks {missing} and names unknown {extra}")
    out = ["| arg | type | default | meaning |", "|---|---|---|---|"]
    for p in params:
        ann = (
            p.annotation
            if isinstance(p.annotation, str)
            else getattr(p.annotation, "__name__", "")
        )
        ann = (ann or "any").replace(" | ", " or ")
        star = "**" if p.kind is inspect.Parameter.VAR_KEYWORD else ""
        default = "`{}`" if star else _py_default(p)
        out.append(f"| `{star}{p.name}` | `{ann}` | {default} | {args[p.name]} |")
    return out


def face_settings(keys: list[str], path: str) -> list[str]:
    """Which of the group's settings a face takes as its own args, and which not."""
    module, name = path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    params = set(inspect.signature(cls.__init__).parameters)
    taken = [k for k in keys if k in params]
    filled = {"executor_id", "components", "worker", "num_of_processes"}
    missing = [k for k in keys if k not in params and k not in filled]
    return [
        "Of [the group's settings](#rankexecs-executor-arguments) it takes "
        + ", ".join(f"`{k}`" for k in taken)
        + "; it does not take "
        + ", ".join(f"`{k}`" for k in missing)
        + " (the face sets them, or their defaults apply).",
        "",
    ]


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser


def py_parser(module: str) -> argparse.ArgumentParser:
    """The argparse parser a module's ``main`` builds (its ``parse_args`` never runs)."""
    main = importlib.import_module(module).main
    real = argparse.ArgumentParser.parse_args

    def capture(self: argparse.ArgumentParser, *a: Any, **k: Any) -> Any:
        raise _Parsed(self)

    argparse.ArgumentParser.parse_args = capture  # type: ignore[method-assign]
    try:
        main([])
    except _Parsed as p:
        return p.parser
    finally:
        argparse.ArgumentParser.parse_args = real  # type: ignore[method-assign]
    raise SectionError(f"{module}.main parsed no arguments")


def py_commands() -> list[tuple[str, str, list[tuple[str, str]]]]:
    """``(command, help, [(argument or flag, help)])`` of every Python command line."""
    out = []
    for typed, module in PY_CLIS:
        parser = py_parser(module)
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        cmds = (
            [
                (f"{typed} {n}", h.help or "", subs[0].choices[n])
                for n, h in _sub_helps(subs[0])
            ]
            if subs
            else [
                (
                    typed,
                    (parser.description or "")
                    .strip()
                    .split("\n")[0]
                    .split(": ", 1)[-1],
                    parser,
                )
            ]
        )
        for name, about, p in cmds:
            rows = []
            for a in p._actions:
                if isinstance(a, argparse._HelpAction):
                    continue
                flag = ", ".join(a.option_strings) or a.dest.upper()
                if a.option_strings and a.nargs != 0:
                    flag += f" {a.metavar or a.dest.upper()}"
                help_ = (
                    " ".join((a.help or "").split()) or "(no help text in its `--help`)"
                )
                if not help_.endswith("."):
                    help_ += "."
                if a.choices:
                    help_ += " One of " + ", ".join(f"`{c}`" for c in a.choices) + "."
                rows.append((flag, help_))
            out.append((name, about, rows))
    return out


def _sub_helps(sub: argparse._SubParsersAction) -> list[tuple[str, Any]]:
    helps = {c.dest: c for c in sub._choices_actions}
    return [(n, helps[n]) for n in sub.choices]


def cli_section() -> list[str]:
    out = [
        "## Command lines",
        "",
        "Every command a user types, with every argument. `rankexec` is the Rust command",
        "line (the wheel's `rankexec` command runs it; from its `--help`).",
        "",
    ]
    for name, (about, rows) in rust_commands().items():
        out += [f"### `rankexec {name}`", "", about + ".", ""]
        if rows:
            out += ["| argument | meaning |", "|---|---|"]
            out += [f"| `{f}` | {h.replace('|', '/')} |" for f, h in rows]
            out.append("")
    for name, about, rows in py_commands():
        out += [
            f"### `{name}`",
            "",
            about[:1].upper() + about[1:].rstrip(".") + ".",
            "",
        ]
        out += ["| argument | meaning |", "|---|---|"]
        out += [f"| `{f}` | {h.replace('|', '/')} |" for f, h in rows]
        out.append("")
    out += [
        "### Rank programs",
        "",
        "Rank programs, which an executor starts and a user names only as a `worker`:",
        "`python -m rankexec.worker` and `rankexec-worker` (no arguments: serve as a rank;",
        "`--list-components`, `--check-components JSON|-`, `--version`, `--help`), and",
        "`python -m rankexec.flare.run_script [--cwd DIR] [--config JSON] SCRIPT [ARGS...]`",
        "(`ScriptExecutor`'s).",
    ]
    return out
