"""The release pipeline (.github/workflows/release.yml), checked as far as can be done
offline: it parses; it builds the wheel matrix (manylinux2014 x86_64 and aarch64) and
the sdist and publishes only on a tag, by trusted publishing; every action is pinned;
every path, package and binary it names exists; and the wheel it builds is the one
scripts/wheel.sh builds (the same cargo packages, binaries, features and profile, the
same staging folder as python/pyproject.toml's `include`, the same manylinux policy and
maturin manifest, the toolchain of rust-toolchain.toml). A second copy of the build
that drifted from the first would ship a different wheel than the one the tests ran.

Caveats: nothing here runs GitHub Actions; the actions' own inputs are not checked
against their schemas (no network). Well under a second.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW = ROOT / ".github" / "workflows" / "release.yml"
WHEEL_SH = (ROOT / "scripts" / "wheel.sh").read_text()


def workflow() -> dict[str, Any]:
    doc = yaml.safe_load(WORKFLOW.read_text())
    assert isinstance(doc, dict) and "jobs" in doc, "release.yml is not a workflow"
    return doc


def steps(job: str) -> list[dict[str, Any]]:
    return workflow()["jobs"][job]["steps"]


def maturin_step(job: str) -> dict[str, Any]:
    (step,) = [s for s in steps(job) if str(s.get("uses", "")).startswith("PyO3/maturin-action@")]
    return step["with"]


def wheel_sh_var(name: str) -> str:
    m = re.search(rf"^{name}=(\S+)$", WHEEL_SH, re.MULTILINE)
    assert m, f"scripts/wheel.sh no longer sets {name}"
    return m.group(1).strip('"')


def test_it_builds_the_matrix_and_publishes_only_on_a_tag() -> None:
    doc = workflow()
    on = doc[True] if True in doc else doc["on"]  # YAML 1.1 reads `on` as true
    assert on["push"]["tags"] == ["v*"]
    targets = {m["target"] for m in doc["jobs"]["wheels"]["strategy"]["matrix"]["include"]}
    assert targets == {"x86_64", "aarch64"}
    assert maturin_step("sdist")["command"] == "sdist"
    publish = doc["jobs"]["publish"]
    assert set(publish["needs"]) == {"wheels", "sdist"}
    assert publish["if"] == "startsWith(github.ref, 'refs/tags/v')"
    assert publish["permissions"] == {"id-token": "write"}  # trusted publishing, no token
    assert doc["permissions"] == {"contents": "read"}
    (upload,) = [s for s in publish["steps"] if "gh-action-pypi-publish" in s.get("uses", "")]
    assert "password" not in upload.get("with", {})


def test_every_action_is_pinned() -> None:
    for job in workflow()["jobs"].values():
        for step in job["steps"]:
            if "uses" in step:
                assert re.fullmatch(r"[\w.-]+/[\w.-]+@(v\d+|release/v\d+)", step["uses"]), step


def test_the_wheel_is_the_one_scripts_wheel_sh_builds() -> None:
    w = maturin_step("wheels")
    args = shlex.split(w["args"])
    # PROFILE="${RANKEXEC_WHEEL_PROFILE:-wheel}": the default the release builds.
    found = re.search(r"^PROFILE=\"?(?:\$\{RANKEXEC_WHEEL_PROFILE:-)?(\w+)", WHEEL_SH, re.MULTILINE)
    assert found, "scripts/wheel.sh sets no PROFILE"
    profile = found.group(1)
    assert args[args.index("--profile") + 1] == profile
    assert args[args.index("--compatibility") + 1] == wheel_sh_var("POLICY")
    assert f"manylinux{w['manylinux']}" == wheel_sh_var("POLICY")
    assert "--locked" in args
    manifest = args[args.index("-m") + 1]
    assert manifest in WHEEL_SH and (ROOT / manifest).is_file()
    # The binaries: the same cargo selection as wheel.sh's zigbuild.
    cargo = re.search(
        r"\"\$BIN_TARGET\" cargo zigbuild (.*?)\n(?!\s)", WHEEL_SH.replace("\\\n", " "), re.DOTALL
    )
    want = [a for a in shlex.split(cargo.group(1)) if a.startswith(("-p", "--bin", "--no-"))]
    want_args = shlex.split(cargo.group(1))
    script = w["before-script-linux"]
    build = next(line for line in script.splitlines() if line.startswith("cargo build"))
    got = shlex.split(build)
    for flag in ("-p", "--bin"):
        assert [got[i + 1] for i, a in enumerate(got) if a == flag] == [
            want_args[i + 1] for i, a in enumerate(want_args) if a == flag
        ], f"{flag} differs from scripts/wheel.sh"
    assert [a for a in got if a.startswith("--no-")] == [a for a in want if a.startswith("--no-")]
    assert got[got.index("--profile") + 1] == profile
    # Staged where pyproject.toml's `include` takes them from.
    pyproject = tomllib.loads((ROOT / "python" / "pyproject.toml").read_text())
    (include,) = pyproject["tool"]["maturin"]["include"]
    stage = "python/" + include["path"].rsplit("/", 1)[0]
    assert stage == wheel_sh_var("BIN_STAGE") and f"mkdir -p {stage}" in script
    assert re.search(rf"install -m 0755 .*/rankexec .*/rankexec-worker {stage}/", script)
    toolchain = tomllib.loads((ROOT / "rust-toolchain.toml").read_text())
    assert w["rust-toolchain"] == toolchain["toolchain"]["channel"]


def test_every_package_binary_and_path_it_names_exists() -> None:
    text = WORKFLOW.read_text()
    members = {
        tomllib.loads(p.read_text())["package"]["name"]: p.parent
        for p in [
            ROOT / "Cargo.toml",
            *ROOT.glob("*/Cargo.toml"),
            *ROOT.glob("python/*/Cargo.toml"),
        ]
        if "package" in tomllib.loads(p.read_text())
    }
    build = next(x for x in text.splitlines() if x.strip().startswith("cargo build"))
    for package in re.findall(r" -p ([\w-]+)", build):
        assert package in members, f"release.yml builds the package {package}, which is not here"
    bins = {
        b["name"]
        for d in members.values()
        for b in tomllib.loads((d / "Cargo.toml").read_text()).get("bin", [])
    } | {"rankexec"}  # the root package's src/main.rs
    for binary in re.findall(r"--bin ([\w-]+)", build):
        assert binary in bins, f"release.yml builds the binary {binary}, which is not here"
    for path in re.findall(r"(?<![\w/.$-])((?:python|scripts|src|docs)/[\w./-]+)", text):
        if "_bin" in path:  # made by the build itself
            continue
        assert (ROOT / path).exists(), f"release.yml names {path}, which is not here"
