#!/usr/bin/env python3
"""Writes docs/configuration.md, the configuration reference, from the code.

Why: the reference was a hand-written table beside the schema it described, and went
stale. Every row here comes from the code: the Rust configuration schema
(executor/src/config/schema.rs: fields, `///` docs, serde defaults and `Default`
impls), the `ScatterAndGather` workflow's args (src/job/model.rs), the signatures and
``Args:`` docstring sections of ``rankexec.flare.MultiProcessExecutor``,
``rankexec.flare.ScriptExecutor`` and ``rankexec.flower.ClientApp``, and the Flower site
file's keys (``rankexec.flower._site``: its docstring list, checked against the keys
the code accepts); and, through scripts/config_sections.py, the FLARE site policy's keys,
``meta.json``, the ``rank_source`` values, the ``RANKEXEC_`` environment variables and
every command line (the built ``target/release/rankexec``'s ``--help``, the Python
command lines' argparse parsers).

    python scripts/gen-config-docs.py            # writes docs/configuration.md
    python scripts/gen-config-docs.py --check    # exit 1 when the committed page differs

Run it in the test venv (it imports rankexec, nvflare and flwr). python/tests/test_docs.py
runs `--check`. Caveats: the Rust side is read as text with a small parser of the shapes
schema.rs uses (structs, enums with unit and struct variants, `default = "fn"`,
`#[serde(default)]` with a `Default` impl); a new shape it does not know is an error
here, not a silent gap. A Python parameter without an ``Args:`` entry is an error too.
"""

from __future__ import annotations

import argparse
import importlib
import re
import sys
from pathlib import Path
from typing import Any

import config_sections  # scripts/config_sections.py: the policy, env, CLI sections
from config_sections import face_settings, python_section

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "configuration.md"


class GenError(Exception):
    """The code has a shape or a gap this generator refuses to paper over."""


# --- Rust ------------------------------------------------------------------------------


def _body(text: str, start: int) -> tuple[str, int]:
    """The text between the brace at or after `start` and its match."""
    i = text.index("{", start) + 1
    depth, j = 1, i
    while depth:
        c = text[j]
        depth += (c == "{") - (c == "}")
        j += 1
    return text[i : j - 1], j


def _items(body: str) -> list[dict[str, Any]]:
    """Top-level fields or variants of a struct or enum body, with docs and attrs."""
    out: list[dict[str, Any]] = []
    docs: list[str] = []
    attrs: list[str] = []
    depth = 0
    cur: dict[str, Any] | None = None
    for line in body.split("\n"):
        s = line.strip()
        new_depth = depth + line.count("{") - line.count("}")
        if depth > 0 and new_depth == 0:
            if cur is not None:
                cur["fields"] = _items(cur["body"])
                cur["body"] = ""
            depth = new_depth
            continue
        if depth == 0:
            if s.startswith("///"):
                docs.append(s[3:].strip())
            elif s.startswith("#["):
                attrs.append(s)
            elif s:
                m = re.match(r"(?:pub(?:\([a-z]+\))? )?(\w+)\s*(:\s*(.+?),?$)?(.*)$", s)
                if not m:
                    raise GenError(f"cannot read `{s}`")
                cur = {
                    "name": m.group(1),
                    "type": (m.group(3) or "").rstrip(","),
                    "doc": " ".join(docs),
                    "attrs": attrs,
                    "fields": [],
                    "body": "",
                }
                out.append(cur)
                docs, attrs = [], []
        elif cur is not None:
            cur["body"] += line + "\n"
        depth = new_depth
    return out


class RustSchema:
    def __init__(self, *paths: Path) -> None:
        self.text = "\n".join(p.read_text() for p in paths)
        self.structs: dict[str, dict[str, Any]] = {}
        self.enums: dict[str, dict[str, Any]] = {}
        pat = (
            r"((?:\s*///[^\n]*\n)*)\s*((?:#\[[^\n]*\]\s*)*)pub (struct|enum) (\w+)\s*\{"
        )
        for m in re.finditer(pat, self.text):
            body, _ = _body(self.text, m.end() - 1)
            doc = " ".join(
                x.strip()[3:].strip()
                for x in m.group(1).strip().split("\n")
                if x.strip()
            )
            entry = {"doc": doc, "attrs": m.group(2), "items": _items(body)}
            (self.structs if m.group(3) == "struct" else self.enums)[m.group(4)] = entry
        self.fns = dict(
            re.findall(
                r"fn (\w+)\(\) -> [\w<>]+ \{\s*(.+?)\s*\}\n", self.text, re.DOTALL
            )
        )

    def struct_defaults(self, name: str) -> dict[str, str]:
        m = re.search(rf"impl Default for {name} \{{", self.text)
        if not m:
            return {}
        body, _ = _body(self.text, m.end() - 1)
        inner, _ = _body(body, body.index(f"{name} {{") + len(name))
        out: dict[str, str] = {}
        depth, cur = 0, ""
        for c in inner + ",":
            if c == "," and depth == 0:
                if cur.strip():
                    k, v = cur.split(":", 1)
                    out[k.strip()] = v.strip()
                cur = ""
                continue
            depth += (c in "([{") - (c in ")]}")
            cur += c
        return out


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


def _value(expr: str, schema: RustSchema) -> str:
    e = " ".join(expr.split())
    if m := re.fullmatch(r"Dur\(Duration::from_secs\((\d+)\)\)", e):
        n = int(m.group(1))
        return f"`{n // 3600}h`" if n >= 3600 and n % 3600 == 0 else f"`{n}s`"
    if m := re.fullmatch(r"Dur\(Duration::from_millis\((\d+)\)\)", e):
        return f"`{m.group(1)}ms`"
    if m := re.fullmatch(r"Dur\(std::time::Duration::from_secs\((\d+)\)\)", e):
        return f"`{m.group(1)}s`"
    if m := re.fullmatch(r"ByteSize\((\d+) << (\d+)\)", e):
        unit = {10: "KiB", 20: "MiB", 30: "GiB"}[int(m.group(2))]
        return f"`{m.group(1)}{unit}`"
    if m := re.fullmatch(r'"([^"]*)"\.(?:to_owned|into|to_string)\(\)', e):
        return f'`"{m.group(1)}"`'
    if m := re.fullmatch(r"vec!\[(.*)\]", e):
        items = re.findall(r'"([^"]*)"', m.group(1))
        return "`[" + ", ".join(f'"{x}"' for x in items) + "]`"
    if e in ("Vec::new()", "vec![]"):
        return "`[]`"
    if e == "BTreeMap::new()":
        return "`{}`"
    if e == "None":
        return "none"
    if re.fullmatch(r"-?[\d.]+|true|false", e):
        return f"`{e}`"
    if m := re.fullmatch(r"(\w+)::default\(\)", e):
        return "see below" if m.group(1) in schema.structs else f"`{m.group(1)}`"
    raise GenError(f"cannot render the default `{e}`")


def _type(t: str, schema: RustSchema) -> str:
    t = t.strip()
    if m := re.fullmatch(r"Option<(.+)>", t):
        return _type(m.group(1), schema)
    if m := re.fullmatch(r"Vec<(.+)>", t):
        return f"list of {_type(m.group(1), schema)}"
    if m := re.fullmatch(r"BTreeMap<String, ?String>", t):
        return "map of string to string"
    simple = {
        "u32": "integer",
        "u64": "integer",
        "f64": "number",
        "bool": "boolean",
        "String": "string",
        "Dur": "duration",
        "ByteSize": "size",
        "PathBuf": "path",
        "ComponentConfig": "component `{id, path, args}`",
        "serde_json::Value": "any JSON",
    }
    if t in simple:
        return simple[t]
    if t in schema.structs:
        return "object"
    if t in schema.enums:
        return "one of the forms below"
    raise GenError(f"cannot render the type `{t}`")


def _default_of(
    field: dict[str, Any],
    struct_defaults: dict[str, str],
    schema: RustSchema,
    struct_default: bool = False,
) -> str:
    for a in field["attrs"]:
        if m := re.search(r'default = "(\w+)"', a):
            return _value(schema.fns[m.group(1)], schema)
    if field["name"] in struct_defaults:
        return _value(struct_defaults[field["name"]], schema)
    t = field["type"]
    if struct_default or any("serde(default)" in a for a in field["attrs"]):
        if t.startswith("Option<"):
            return "none"
        if t.startswith("Vec<"):
            return "`[]`"
        if t in schema.enums:
            return _enum_default(t, schema)
        if t in schema.structs:
            return "see below"
        if t == "bool":
            return "`false`"
        if t == "u32":
            return "`0`"
        if t in ("Vec<String>", "BTreeMap<String, String>"):
            return "`[]`" if t.startswith("Vec") else "`{}`"
        raise GenError(f"no default known for `{field['name']}: {t}`")
    if t.startswith("Option<"):
        return "none"
    return "required"


def _enum_default(name: str, schema: RustSchema) -> str:
    for v in schema.enums[name]["items"]:
        if any("#[default]" in a for a in v["attrs"]):
            return f'`"{_snake(v["name"])}"`'
    return "required"


def _rows(
    schema: RustSchema, struct: str, prefix: str, enums_seen: list[tuple[str, str]]
) -> list[str]:
    s = schema.structs[struct]
    struct_default = "default)]" in s["attrs"] or "default)" in s["attrs"]
    defaults = schema.struct_defaults(struct) if struct_default else {}
    rows: list[str] = []
    nested: list[tuple[str, str]] = []
    for f in s["items"]:
        key = f"{prefix}{f['name']}"
        t = f["type"]
        inner = re.sub(r"^Option<(.+)>$", r"\1", t)
        default = _default_of(f, defaults, schema, struct_default)
        if default == "see below" and inner in schema.structs:
            default = f"see `{key}.*`"
        rows.append(f"| `{key}` | {_type(t, schema)} | {default} | {f['doc']} |")
        if inner in schema.structs:
            nested.append((inner, key + "."))
        elif inner in schema.enums:
            enums_seen.append((key, inner))
    for inner, pre in nested:
        rows.extend(_rows(schema, inner, pre, enums_seen))
    return rows


def _variant_form(v: dict[str, Any], schema: RustSchema) -> str:
    name = _snake(v["name"])
    if not v["fields"]:
        return f'`"{name}"`'
    keys = ", ".join(f["name"] for f in v["fields"])
    return f'`{{"{name}": {{{keys}}}}}`'


def rust_section(schema: RustSchema, struct: str) -> list[str]:
    enums: list[tuple[str, str]] = []
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    out += _rows(schema, struct, "", enums)
    for key, enum in enums:
        e = schema.enums[enum]
        out += ["", f"#### `{key}`", "", e["doc"], ""]
        for v in e["items"]:
            default = (
                " (the default)" if any("#[default]" in a for a in v["attrs"]) else ""
            )
            out.append(f"- {_variant_form(v, schema)}{default}: {v['doc']}")
            for f in v["fields"]:
                fd = _default_of(f, {}, schema)
                out.append(
                    f"    - `{f['name']}` ({_type(f['type'], schema)}, {fd}): {f['doc']}"
                )
    return out


# --- Python ----------------------------------------------------------------------------


def flower_site_section() -> list[str]:
    site = importlib.import_module("rankexec.flower._site")
    doc = site.__doc__ or ""
    part = doc.split(
        "Site file (JSON object; unknown keys refuse every request), all optional:\n", 1
    )[1]
    part = part.strip().split("\n\n", 1)[0]
    items = re.split(r"\n- ", "\n" + part)[1:]
    out: list[str] = []
    keys: set[str] = set()
    for it in items:
        text = " ".join(it.split())
        keys.update(re.findall(r"``(\w+)``", text.split(":", 1)[0]))
        out.append("- " + text.replace("``", "`"))
    if keys != set(site._SITE_KEYS):
        raise GenError(
            f"rankexec.flower._site's docstring documents {sorted(keys)}, the code accepts {sorted(site._SITE_KEYS)}"
        )
    node = doc.split("Node-config keys (all optional): ", 1)[1].split("\n\n", 1)[0]
    return out + [
        "",
        "Node-config keys, set on the SuperNode's `--node-config` (all optional): "
        + " ".join(node.split()).replace("``", "`"),
    ]


# --- the page ----------------------------------------------------------------------------


def page() -> str:
    schema = RustSchema(ROOT / "executor/src/config/schema.rs")
    job = RustSchema(ROOT / "src/job/model.rs")
    group_keys = [f["name"] for f in schema.structs["ExecutorConfig"]["items"]]
    units = (ROOT / "executor/src/units.rs").read_text()
    if "KiB" not in units:
        raise GenError(
            "executor/src/units.rs no longer speaks of KiB: check the units text"
        )
    lines = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/gen-config-docs.py from the code; do not edit by hand. -->",
        "",
        "Every file, key, argument, command line, environment variable and enumerated value a",
        "job, a site or an app can set, with its type, default and meaning, generated from the",
        "code (`python scripts/gen-config-docs.py`; the docs test fails when this page differs",
        "from what it writes, and `python/tests/test_config_reference.py` checks it against",
        "the binaries' `--help`, the signatures and a grep of the sources). Start from your",
        "framework's chapter; come here for the exact key. The Python classes' methods and",
        "docstrings: the [API reference](api/index.md).",
        "",
        "Sizes accept `4GiB`, `512 MB`, `1.5G` (KB/MB/GB are powers of 1000, KiB/MiB/GiB and",
        "bare K/M/G powers of 1024). Durations accept `500ms`, `30s`, `5m`, `1h` or seconds.",
        "",
        "## rankexec's executor arguments",
        "",
        "The rank group's settings: the `args` of a rankexec job's `MultiProcessExecutor`, the",
        "`--config` file of `rankexec run` and the dict a `rankexec.host.RankGroup` takes. The",
        "FLARE and Flower faces below take a part of them as their own args (each says which)",
        "and fill in `executor_id`, `components` and `worker`. From",
        "`executor/src/config/schema.rs`.",
        "",
    ]
    lines += rust_section(schema, "ExecutorConfig")
    lines += [
        "",
        "## `rankexec.flare.MultiProcessExecutor`",
        "",
        "A FLARE client executor (`config_fed_client.json`'s `executor.args`, or",
        "`job.to(rankexec.flare.MultiProcessExecutor(...), site)`). Its group settings are",
        "[rankexec's executor arguments](#rankexecs-executor-arguments).",
        "",
    ]
    lines += face_settings(group_keys, "rankexec.flare.MultiProcessExecutor")
    lines += python_section("rankexec.flare.MultiProcessExecutor")
    lines += [
        "",
        "## `rankexec.flare.ScriptExecutor`",
        "",
        "Runs a FLARE Client API script on a rank group, in place of FLARE's",
        "`ClientAPIExecutor`.",
        "",
    ]
    lines += face_settings(group_keys, "rankexec.flare.ScriptExecutor")
    lines += python_section("rankexec.flare.ScriptExecutor")
    lines += [
        "",
        "## `rankexec.flare.ScriptRunner`",
        "",
        "FLARE's Job API: `job.to(ScriptRunner(...), site)` adds a `ScriptExecutor` and ships",
        "the script in the job's `custom/` folder.",
        "",
    ]
    lines += python_section("rankexec.flare.ScriptRunner")
    lines += [
        "",
        "## `rankexec.flare.use_rank_groups`",
        "",
        "FLARE's Recipe API: `use_rank_groups(recipe, ...)` turns a recipe's Client API",
        "executors into `ScriptExecutor`s.",
        "",
    ]
    lines += python_section("rankexec.flare.use_rank_groups")
    lines += [
        "",
        "## `rankexec.flare.resources.GpuResourceManager` and `GpuResourceConsumer`",
        "",
        "The site's GPU authority, in the site's resources file",
        "(`python -m rankexec.flare gpus` sets them): `resource_manager`'s args, then",
        "`resource_consumer`'s.",
        "",
    ]
    lines += python_section("rankexec.flare.resources.GpuResourceManager")
    lines += [""]
    lines += python_section("rankexec.flare.resources.GpuResourceConsumer")
    lines += [""]
    lines += config_sections.policy_section()
    lines += [
        "",
        "## `rankexec.flower.ClientApp`",
        "",
        "A drop-in for `flwr.clientapp.ClientApp`. What the node's site file allows bounds",
        "`launcher` and `gpu` (below).",
        "",
    ]
    lines += face_settings(group_keys, "rankexec.flower.ClientApp")
    lines += python_section("rankexec.flower.ClientApp")
    lines += [
        "",
        "## Flower site file",
        "",
        'A JSON object the node\'s operator writes (`rankexec-site="/etc/rankexec/flower.json"`',
        "in the SuperNode's `--node-config`, or `RANKEXEC_FLOWER_SITE` in its environment).",
        "Unknown keys refuse every request. All keys are optional.",
        "",
    ]
    lines += flower_site_section()
    lines += [
        "",
        "## `ScatterAndGather` (rankexec simulate's server workflow)",
        "",
        "The FedAvg workflow of a rankexec job's `config_fed_server.json`. From",
        "`src/job/model.rs`.",
        "",
    ]
    lines += rust_section(job, "ScatterAndGatherArgs")
    lines += [
        "",
        "## `meta.json` and the apps' files (rankexec simulate's job folder)",
        "",
        "A job folder's `meta.json`; unknown keys are refused, in every file of the folder.",
        "From `src/job/model.rs`.",
        "",
    ]
    lines += rust_section(job, "Meta")
    for title, struct, what in (
        ("`app/config/config_fed_client.json`", "ClientAppConfig", "The client app."),
        ("an entry of `executors`", "ExecutorEntry", "One executor and its tasks."),
        ("`app/config/config_fed_server.json`", "ServerAppConfig", "The server app."),
        ("`ModelPersistor` (a server component)", "PersistorArgs", "Its `args`."),
    ):
        lines += ["", f"### {title}", "", what + " From `src/job/model.rs`.", ""]
        lines += rust_section(job, struct)
    lines += [""]
    lines += config_sections.rank_source_section()
    lines += [""]
    lines += config_sections.env_section()
    lines += [""]
    lines += config_sections.cli_section()
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--check", action="store_true", help="exit 1 when docs/configuration.md differs"
    )
    a = ap.parse_args()
    try:
        text = page()
    except (GenError, config_sections.SectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.check:
        old = OUT.read_text() if OUT.exists() else ""
        if old != text:
            print(
                f"{OUT.relative_to(ROOT)} differs from the code: run python scripts/gen-config-docs.py",
                file=sys.stderr,
            )
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
