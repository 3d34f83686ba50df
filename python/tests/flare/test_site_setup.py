"""The site steps on real provisioned kits (`nvflare poc prepare`, `nvflare provision`
of a small project.yml): `python -m rankexec.flare allow-list` edits the file FLARE
reads (resources.json, else resources.json.default), keeps every key, writes with a
backup, prints the change, writes nothing with --dry-run, and refuses a file that does
not parse without touching it. (That the site still runs jobs afterwards, FLARE's own
among them, is test_poc.py's part: a real deployment.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rankexec.flare.__main__ import CLASSES

from .flare_helpers import NVFLARE
from .poc import Poc

PROJECT_YML = """\
api_version: 3
name: rxprov
description: a small production project
participants:
- name: server1.example.com
  type: server
  org: acme
  fed_learn_port: 18102
  admin_port: 18103
- name: hospital-a
  type: client
  org: acme
- name: admin@acme.com
  type: admin
  org: acme
  role: project_admin
builders:
- path: nvflare.lighter.impl.workspace.WorkspaceBuilder
  args:
    template_file: [master_template.yml]
- path: nvflare.lighter.impl.static_file.StaticFileBuilder
  args:
    config_folder: config
- path: nvflare.lighter.impl.cert.CertBuilder
- path: nvflare.lighter.impl.signature.SignatureBuilder
"""


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rankexec.flare", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def poc_kit(tmp_path_factory) -> Poc:
    d = Poc(tmp_path_factory.mktemp("pockit"))
    d.prepare()
    return d


@pytest.fixture(scope="module")
def prod_kit(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("provision")
    (root / "project.yml").write_text(PROJECT_YML)
    r = subprocess.run(
        [str(NVFLARE), "provision", "-p", "project.yml", "-w", str(root / "ws"), "--force"],
        check=False,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(root)},
    )
    assert r.returncode == 0, f"{r.stdout}\n{r.stderr}"
    kits = list((root / "ws").glob("rxprov/prod_*"))
    assert len(kits) == 1, list((root / "ws").rglob("*"))[:50]
    return kits[0]


def _kits(poc_kit: Poc, prod_kit: Path) -> list[Path]:
    return [poc_kit.site("site-1"), poc_kit.site("server"), prod_kit / "hospital-a"]


def test_allow_list_keeps_every_key_of_the_file_flare_reads(poc_kit, prod_kit, tmp_path):
    for kit in _kits(poc_kit, prod_kit):
        local = kit / "local"
        present = local / "resources.json"
        source = present if present.exists() else local / "resources.json.default"
        before = json.loads(source.read_text())
        assert before.get("components"), f"{source} has no components: not a real kit?"
        had_present = present.exists()
        old_text = present.read_text() if had_present else None

        dry = cli("allow-list", str(kit), "--dry-run")
        assert dry.returncode == 0, dry.stderr
        assert '+    "rankexec.flare.MultiProcessExecutor",' in dry.stdout, dry.stdout
        assert "dry run" in dry.stdout
        assert present.exists() == had_present
        if had_present:
            assert present.read_text() == old_text

        r = cli("allow-list", str(kit))
        assert r.returncode == 0, r.stderr
        print(r.stdout[-600:])
        after = json.loads(present.read_text())
        for key, value in before.items():
            if key != "class_allow_list":
                assert after[key] == value, (kit, key)
        ids = [c["id"] for c in after["components"]]
        assert ids == [c["id"] for c in before["components"]], ids
        if kit.name != "server":
            assert {"resource_manager", "resource_consumer", "process_launcher"} <= set(ids)
        allow = after["class_allow_list"]
        assert allow[: len(before.get("class_allow_list", []))] == before.get(
            "class_allow_list", []
        )
        assert [c for c in allow if c.startswith("rankexec")] == list(CLASSES)
        backup = local / "resources.json.bak"
        if had_present:
            assert backup.read_text() == old_text, "the replaced file is kept as a backup"
            assert "backup of the previous file" in r.stdout
        else:
            assert not backup.exists()
            assert (local / "resources.json.default").exists()

        again = cli("allow-list", str(kit))
        assert again.returncode == 0 and "no change" in again.stdout, again.stdout
        assert json.loads(present.read_text()) == after


def test_a_file_that_does_not_parse_is_refused_untouched(tmp_path):
    local = tmp_path / "local"
    local.mkdir()
    bad = local / "resources.json"
    bad.write_text('{"format_version": 2, "components": [}\n')
    r = cli("allow-list", str(tmp_path))
    assert r.returncode == 1
    assert str(bad) in r.stderr and "not valid JSON" in r.stderr, r.stderr
    assert bad.read_text() == '{"format_version": 2, "components": [}\n'
    assert sorted(p.name for p in local.iterdir()) == ["resources.json"]
    # A .default that does not parse (and no resources.json) is refused the same way.
    bad.unlink()
    (local / "resources.json.default").write_text("[1, 2]")
    r = cli("allow-list", str(tmp_path))
    assert r.returncode == 1 and "not a JSON object" in r.stderr, r.stderr
    assert not bad.exists()


def test_a_kit_without_resources_files_is_refused(poc_kit, tmp_path):
    kit = tmp_path / "kit"
    (kit / "startup").mkdir(parents=True)
    (kit / "startup" / "fed_client.json").write_text("{}")
    r = cli("allow-list", str(kit))
    assert r.returncode == 1 and "provisioned FLARE kit" in r.stderr, r.stderr
    assert not (kit / "local" / "resources.json").exists()


def test_a_simulator_workspace_gets_a_new_file(tmp_path):
    r = cli("allow-list", str(tmp_path / "ws"))
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "ws" / "local" / "resources.json").read_text())
    assert set(CLASSES) <= set(doc["class_allow_list"]) and len(doc["class_allow_list"]) > 2
