"""docs/configuration.md says it lists every file, key, argument, command line,
environment variable and enumerated value a user can set. These tests hold it to that
by routes other than its generator's (scripts/gen-config-docs.py reads schema.rs as
text and the docstrings): what the built `rankexec` binary refuses and lists when given
an unknown key in an executor configuration or a job folder's files (serde's ``expected
one of``) or a bad `rank_source`, the binaries' and
the Python command lines' own `--help`, the Python signatures, the keys the policy and
Flower site parsers accept, and a grep of the sources for `RANKEXEC_` variables. Each
failure names what is missing from the page and what it lists that the code lacks.

Caveats: the Rust binary is target/release's (what every Python test drives); a stale
build fails here as it would elsewhere. About 5 s idle: some twenty short runs of the
binary and of Python's `--help`.
"""

from __future__ import annotations

import importlib
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
RANKEXEC = ROOT / "target" / "release" / "rankexec"
SOURCES = ["python/rankexec", "python/src", "src", "executor/src", "sub_worker/src", "protocol/src"]


def page() -> str:
    return PAGE.read_text()


def section(title: str) -> str:
    """The text of the page's ``## `` or ``### `` section whose heading contains
    ``title``, up to the next heading of that level or above."""
    text = page()
    m = re.search(rf"^(#{{2,3}}) [^\n]*{re.escape(title)}[^\n]*\n", text, re.MULTILINE)
    assert m, f"docs/configuration.md has no section named like {title!r}"
    level = len(m.group(1))
    rest = text[m.end() :]
    end = re.search(rf"^#{{2,{level}}} ", rest, re.MULTILINE)
    return rest[: end.start()] if end else rest


def first_column(text: str) -> list[str]:
    return re.findall(r"^\| `([^`]+)` \|", text, re.MULTILINE)


def same(what: str, page_has: set[str], code_has: set[str]) -> None:
    missing, extra = sorted(code_has - page_has), sorted(page_has - code_has)
    assert not missing and not extra, (
        f"{what}: the page lacks {missing} and lists {extra}, which the code does not have"
    )


def refused(config: dict, tmp_path: Path) -> str:
    """What `rankexec run --config` says of a configuration it refuses."""
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    r = subprocess.run(
        [str(RANKEXEC), "run", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode != 0, f"{config} was accepted"
    return r.stderr


def expected_fields(message: str) -> set[str]:
    m = re.search(r"expected (?:one of )?(.*?)(?: at line|$)", message, re.MULTILINE)
    assert m, message
    return set(re.findall(r"`(\w+)`", m.group(1)))


BASE = {"executor_id": "e", "components": [{"id": "e", "path": "Echo", "args": {}}]}


def test_every_key_of_the_executor_configuration(tmp_path: Path) -> None:
    rows = first_column(section("rankexec's executor arguments"))
    prefixes = sorted({r.rsplit(".", 1)[0] for r in rows if "." in r} | {""})
    for prefix in prefixes:
        config: dict = json.loads(json.dumps(BASE))
        at = config
        for part in prefix.split(".") if prefix else []:
            at = at.setdefault(part, {})
        at["bogus_key"] = 1
        code = expected_fields(refused(config, tmp_path))
        listed = {
            r[len(prefix) + 1 :] if prefix else r
            for r in rows
            if (r.rsplit(".", 1)[0] if "." in r else "") == prefix
        }
        same(f"executor config keys under `{prefix or '(top)'}`", listed, code)


def test_every_rank_source_value(tmp_path: Path) -> None:
    config = dict(BASE, launcher={"command": {"argv": ["{program}"], "rank_source": "bogus"}})
    message = refused(config, tmp_path)
    m = re.search(r"is not one of (.*)$", message, re.MULTILINE)
    assert m, message
    code = {v.strip() for v in m.group(1).split(",")}
    same("rank_source values", set(first_column(section("`rank_source` values"))), code)


def simulate_refuses(job: Path, files: dict[str, object], tmp_path: Path) -> str:
    """What `rankexec simulate` says of a job folder made of ``files``."""
    for rel, doc in files.items():
        (job / rel).parent.mkdir(parents=True, exist_ok=True)
        (job / rel).write_text(json.dumps(doc))
    r = subprocess.run(
        [str(RANKEXEC), "simulate", str(job), "-w", str(tmp_path / "ws")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert r.returncode != 0, f"{files} was accepted"
    return r.stderr


CLIENT = "app/config/config_fed_client.json"
SERVER = "app/config/config_fed_server.json"
ENTRY = {"tasks": ["train"], "executor": {"id": "e", "path": "Echo", "args": {}}}


@pytest.mark.parametrize(
    "title, files",
    [
        ("## `meta.json`", {"meta.json": {"name": "x", "bogus_key": 1}}),
        (
            "### `app/config/config_fed_client.json`",
            {"meta.json": {"name": "x"}, CLIENT: {"executors": [ENTRY], "bogus_key": 1}},
        ),
        (
            "### an entry of `executors`",
            {"meta.json": {"name": "x"}, CLIENT: {"executors": [dict(ENTRY, bogus_key=1)]}},
        ),
        (
            "### `app/config/config_fed_server.json`",
            {
                "meta.json": {"name": "x"},
                CLIENT: {"executors": [ENTRY]},
                SERVER: {"workflows": [], "bogus_key": 1},
            },
        ),
    ],
)
def test_every_key_of_a_job_folder(title: str, files: dict, tmp_path: Path) -> None:
    message = simulate_refuses(tmp_path / "job", files, tmp_path)
    text = section(title.split(" ", 1)[1]).split("\n### ")[0]
    same(f"{title} keys", set(first_column(text)), expected_fields(message))


def flags(help_text: str) -> set[str]:
    """The long options of a `--help` output (`--help` itself left out)."""
    return set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", help_text)) - {"--help", "--version"}


def run_help(*argv: str) -> str:
    r = subprocess.run(
        [*argv, "--help"], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_every_rust_command_and_flag() -> None:
    top = run_help(str(RANKEXEC))
    subs = re.findall(r"^  (\w+)\s", top.split("Commands:", 1)[1].split("\n\n")[0], re.MULTILINE)
    subs = [s for s in subs if s != "help"]
    documented = set(re.findall(r"^### `rankexec (\w+)`", page(), re.MULTILINE))
    same("rankexec subcommands", documented, set(subs))
    for sub in subs:
        options = run_help(str(RANKEXEC), sub).split("Options:", 1)[-1]
        same(f"`rankexec {sub}` flags", flags(section(f"`rankexec {sub}`")), flags(options))


@pytest.mark.parametrize(
    "argv",
    [
        ["-m", "rankexec.flare", "allow-list"],
        ["-m", "rankexec.flare", "policy"],
        ["-m", "rankexec.flare", "gpus"],
        ["-m", "rankexec.flower.host"],
    ],
)
def test_every_python_command_flag(argv: list[str]) -> None:
    help_text = run_help(sys.executable, *argv)
    options = help_text.split("\noptions:\n", 1)[-1]
    name = "python " + " ".join(argv)
    same(f"`{name}` flags", flags(section(f"`{name}`")), flags(options))


def test_the_python_command_lines_are_all_there() -> None:
    """``python -m rankexec.flare``'s subcommands, from its usage line."""
    r = subprocess.run(
        [sys.executable, "-m", "rankexec.flare"], capture_output=True, text=True, check=False
    )
    subs = set(re.search(r"\{([\w,-]+)\}", r.stderr).group(1).split(","))
    documented = set(re.findall(r"^### `python -m rankexec\.flare ([\w-]+)`", page(), re.MULTILINE))
    same("`python -m rankexec.flare` subcommands", documented, subs)


@pytest.mark.parametrize(
    "path, title",
    [
        ("rankexec.flare.MultiProcessExecutor", "## `rankexec.flare.MultiProcessExecutor`"),
        ("rankexec.flare.ScriptExecutor", "## `rankexec.flare.ScriptExecutor`"),
        ("rankexec.flare.ScriptRunner", "## `rankexec.flare.ScriptRunner`"),
        ("rankexec.flare.use_rank_groups", "## `rankexec.flare.use_rank_groups`"),
        ("rankexec.flower.ClientApp", "## `rankexec.flower.ClientApp`"),
    ],
)
def test_every_argument_of_each_python_entry_point(path: str, title: str) -> None:
    module, name = path.rsplit(".", 1)
    obj = getattr(importlib.import_module(module), name)
    params = inspect.signature(obj).parameters.values()
    code = {("**" if p.kind is p.VAR_KEYWORD else "") + p.name for p in params}
    same(f"{path} arguments", set(first_column(section(title[3:]))), code)


def test_the_gpu_authority_arguments() -> None:
    from rankexec.flare.resources import GpuResourceConsumer, GpuResourceManager

    code = set(inspect.signature(GpuResourceManager).parameters) | set(
        inspect.signature(GpuResourceConsumer).parameters
    )
    same("GPU authority args", set(first_column(section("GpuResourceManager"))), code)


def test_what_the_faces_take_of_the_group_settings(tmp_path: Path) -> None:
    """Each face's sentence names the group settings it takes and those it does not; a
    setting it says it does not take is refused by the face's constructor."""
    from rankexec.flare import MultiProcessExecutor, ScriptExecutor
    from rankexec.flower import ClientApp

    top = expected_fields(refused(dict(BASE, bogus_key=1), tmp_path))
    faces = [
        ("`rankexec.flare.MultiProcessExecutor`", MultiProcessExecutor, {}),
        ("`rankexec.flare.ScriptExecutor`", ScriptExecutor, {"script": "s.py"}),
        ("`rankexec.flower.ClientApp`", ClientApp, {}),
    ]
    for title, cls, required in faces:
        text = " ".join(section(title).split())
        m = re.search(r"it takes (.*?); it does not take (.*?) \(", text)
        assert m, f"{title}: no sentence saying which group settings it takes"
        takes, not_takes = (set(re.findall(r"`(\w+)`", g)) for g in m.groups())
        params = set(inspect.signature(cls).parameters)
        same(f"{title}: the group settings it takes", takes, top & params)
        assert not (not_takes & params), f"{title} takes {not_takes & params}"
        for key in not_takes:
            with pytest.raises(TypeError):
                cls(**required, **{key: None})


def test_every_site_policy_key_and_flower_site_key() -> None:
    from rankexec.flare import policy
    from rankexec.flower import _site

    keys = set(re.findall(r"^- `(\w+)`:", section("FLARE site policy file"), re.MULTILINE))
    same("site policy keys", keys, set(policy._KEYS))
    bullets = re.findall(r"^- ([^:]*):", section("Flower site file"), re.MULTILINE)
    keys = {k for b in bullets for k in re.findall(r"`(\w+)`", b)}
    same("Flower site keys", keys, set(_site._SITE_KEYS))


def code_env_vars() -> set[str]:
    found: set[str] = set()
    for folder in SOURCES:
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".rs") or "tests" in path.parts:
                continue
            found |= set(re.findall(r"\bRANKEXEC_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return found


def test_every_environment_variable() -> None:
    same(
        "RANKEXEC_ environment variables",
        set(first_column(section("Environment variables"))),
        code_env_vars(),
    )
