"""The wheel as a site installs it: built by `scripts/wheel.sh`, installed into a clean
virtual environment, run with no Rust, no checkout and an empty HOME.

The module builds the wheel once (`scripts/wheel.sh` as docs/development.md shows it,
read from the page, its output compared, with `RANKEXEC_WHEEL_PROFILE=wheel-test`: a
profile that compiles faster; `RANKEXEC_WHEEL=path.whl` tests a wheel
built before, e.g. the release one), makes a venv without system site-packages, installs
the wheel with pip (from pip's own cache when it has the packages: `PIP_CACHE_DIR` is
passed on, since HOME is empty), and runs everything from a directory outside the
checkout with `PATH` = the venv's bin, /usr/bin, /bin.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import docrun
import pytest
from conftest import REPO, TARGET, pid_alive

# Generous caps for a busy 2-core machine; a cold wheel-test build takes a few minutes
# idle, and passed 1500 s with the CPUs saturated (scripts/load-test.sh --python) while
# other builds held cargo's lock.
BUILD_CAP_S = float(os.environ.get("RANKEXEC_WHEEL_BUILD_CAP", "3600"))
PIP_CAP_S = 900.0
RUN_CAP_S = 300.0
WORKSPACE_VERSION = tomllib.loads((REPO / "Cargo.toml").read_text())["workspace"]["package"][
    "version"
]
INITIAL = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]


def _pip_cache() -> str:
    """pip's cache of the user running the tests (the clean env's HOME is empty)."""
    if os.environ.get("PIP_CACHE_DIR"):
        return os.environ["PIP_CACHE_DIR"]
    out = subprocess.run(
        [sys.executable, "-m", "pip", "cache", "dir"],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip()
    return str(Path.home() / ".cache" / "pip")


def _snapshot() -> Path:
    """The checkout's files (tracked, and untracked ones git does not ignore) copied to
    ``TARGET/wheel-src``, with their modification times: ``wheel.sh`` stages the
    binaries in ``python/rankexec/_bin`` of the tree it builds, which the checkout's
    own package must never have while other tests run (``test_worker_lookup.py``
    checks that it has none). The path is fixed, so cargo's builds stay incremental."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    dst = TARGET.resolve() / "wheel-src"
    shutil.rmtree(dst, ignore_errors=True)
    for name in filter(None, files):
        rel = Path(os.fsdecode(name))
        if not (REPO / rel).is_file():  # deleted but not yet committed
            continue
        (dst / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / rel, dst / rel)
    return dst


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    prebuilt = os.environ.get("RANKEXEC_WHEEL")
    if prebuilt:
        return Path(prebuilt).resolve()
    out = tmp_path_factory.mktemp("dist")
    src = _snapshot()
    # docs/development.md's command as written, in the snapshot, with the faster profile
    # and this test's folder for the wheel (wheel.sh's RANKEXEC_WHEEL_* defaults); its
    # output is compared with the page's (`[..]` for sizes, seconds and the profile).
    (step,) = docrun.console(
        "docs/development.md",
        "wheel-build",
        paths={"/home/you/rankexec/target/wheels": out},
        cwd=src,
    )
    env = {
        **os.environ,
        "CARGO_TARGET_DIR": str(TARGET.resolve()),
        "RANKEXEC_WHEEL_PROFILE": "wheel-test",
        "RANKEXEC_WHEEL_OUT": str(out),
    }
    log = tmp_path_factory.mktemp("wheel-build") / "wheel.sh.out"
    rc, text = docrun.run(step, log, BUILD_CAP_S, env)
    print(text[-3000:])
    why = step.check(rc, text)
    assert why is None, f"scripts/wheel.sh: {why}\n{text[-6000:]}"
    m = re.search(r"^wheel: (\S+\.whl) ", text, re.MULTILINE)
    assert m, text[-6000:]
    return Path(m.group(1))


class CleanEnv:
    """A venv with the wheel installed, and the environment a site's shell would have."""

    def __init__(self, root: Path, wheel: Path) -> None:
        self.root = root
        self.wheel = wheel
        self.venv = root / "venv"
        self.home = root / "home"
        self.cwd = root / "work"  # outside the checkout
        self.home.mkdir()
        self.cwd.mkdir()
        self.env = {
            "PATH": os.pathsep.join([str(self.venv / "bin"), "/usr/bin", "/bin"]),
            "HOME": str(self.home),
            "PIP_CACHE_DIR": _pip_cache(),
            "PIP_DISABLE_PIP_VERSION_CHECK": "1",
            "PIP_NO_INPUT": "1",
            "LANG": "C.UTF-8",
            "TMPDIR": str(root),
            "RANKEXEC_LOG": "warn",
        }
        # A venv of the interpreter itself, not of the venv the tests run in.
        base = getattr(sys, "_base_executable", sys.executable)
        subprocess.run([base, "-m", "venv", str(self.venv)], check=True, timeout=PIP_CAP_S)
        self.python = str(self.venv / "bin" / "python")

    def run(self, *args: str, cap: float = RUN_CAP_S, check: bool = True, **kw):
        proc = subprocess.run(
            list(args),
            check=False,
            cwd=kw.pop("cwd", self.cwd),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=cap,
            **kw,
        )
        if check:
            assert proc.returncode == 0, (
                f"{args} exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        return proc

    def pip_install(self, *reqs: str) -> None:
        self.run(self.python, "-m", "pip", "install", "-q", *reqs, cap=PIP_CAP_S)

    def installed(self) -> set[str]:
        out = self.run(self.python, "-m", "pip", "list", "--format=json").stdout
        return {p["name"].lower() for p in json.loads(out)}

    def live_processes(self) -> list[str]:
        """Live processes started from this venv (a rank's command line names its program:
        the venv's python or the packaged rankexec-worker)."""
        needle = str(self.venv).encode()
        found = []
        for d in Path("/proc").iterdir():
            if not d.name.isdigit() or int(d.name) == os.getpid():
                continue
            try:
                cmdline = (d / "cmdline").read_bytes()
            except OSError:
                continue
            if needle in cmdline and pid_alive(int(d.name)):
                args = cmdline.replace(b"\0", b" ").decode(errors="replace")
                found.append(f"{d.name}: {args}")
        return found


@pytest.fixture(scope="module")
def clean(tmp_path_factory, wheel) -> CleanEnv:
    env = CleanEnv(tmp_path_factory.mktemp("clean"), wheel)
    for tool in ("cargo", "rustc", "rustup", "rankexec", "rankexec-worker", "maturin"):
        found = shutil.which(tool, path=env.env["PATH"])
        assert found is None, f"the clean PATH has {tool}: {found}"
    env.pip_install(str(wheel))
    return env


def test_the_wheel_is_abi3_manylinux_and_auditwheel_accepts_it(wheel):
    name = wheel.name
    print(f"wheel: {name} ({wheel.stat().st_size / 2**20:.1f} MiB)")
    assert re.fullmatch(rf"rankexec-{WORKSPACE_VERSION}-cp311-abi3-manylinux\S+\.whl", name), name
    with zipfile.ZipFile(wheel) as z:
        tags = re.findall(r"^Tag: (\S+)$", z.read(_dist_info(z) + "WHEEL").decode(), re.MULTILINE)
        files = {i.filename: i for i in z.infolist()}
        metadata = z.read(_dist_info(z) + "METADATA").decode()
    print("tags:", tags)
    # Nothing by default; each extra brings what its face imports.
    requires = sorted(
        " ".join(r.split()) for r in re.findall(r"^Requires-Dist: (.+)$", metadata, re.MULTILINE)
    )
    print("requires:", requires)
    assert requires == [
        "flwr==1.42.* ; extra == 'flower'",
        "numpy>=1.26 ; extra == 'flare'",
        "numpy>=1.26 ; extra == 'flower'",
        "numpy>=1.26 ; extra == 'numpy'",
        "numpy>=1.26 ; extra == 'torch'",
        "nvflare==2.9.0 ; extra == 'flare'",
        "torch>=2.4 ; extra == 'torch'",
    ], requires
    assert tags and all(
        re.fullmatch(r"cp311-abi3-manylinux_2_\d+_x86_64|cp311-abi3-manylinux2014_x86_64", t)
        for t in tags
    ), tags
    for binary in ("rankexec/_bin/rankexec", "rankexec/_bin/rankexec-worker"):
        assert binary in files, sorted(files)
        assert files[binary].external_attr >> 16 & 0o111, f"{binary} is not executable"
    for typed in ("rankexec/py.typed", "rankexec/_rankexec.pyi"):
        assert typed in files, sorted(files)
    auditwheel = TARGET / "wheel-tools" / "bin" / "auditwheel"
    shown = subprocess.run(
        [str(auditwheel), "show", str(wheel)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
    )
    print(shown.stdout)
    assert shown.returncode == 0, shown.stderr
    text = " ".join(shown.stdout.split())
    m = re.search(
        r'is consistent with the following platform tag: "(manylinux_2_(\d+)_x86_64)"', text
    )
    assert m, text
    # Older than this Debian 12 build machine's glibc (2.36), and no library of its own:
    # nothing outside the manylinux policy's system libraries.
    assert int(m.group(2)) < 36, m.group(1)
    assert "external shared libraries" not in text, text


def _dist_info(z: zipfile.ZipFile) -> str:
    return next(n.split("/")[0] + "/" for n in z.namelist() if ".dist-info/" in n)


def test_installing_the_wheel_alone_pulls_no_other_package(clean):
    installed = clean.installed()
    print("installed:", sorted(installed))
    assert installed - {"pip", "setuptools", "wheel"} == {"rankexec"}
    probe = clean.run(
        clean.python,
        "-c",
        "import sys, rankexec, rankexec.host, rankexec.worker, rankexec.flare.arrays as _\n"
        "print(rankexec.__file__)\n",
        check=False,
    )
    # rankexec.flare.arrays needs numpy, which the `flare` extra brings: without it the
    # import fails, and only there.
    assert "No module named 'numpy'" in probe.stderr, probe.stderr
    probe = clean.run(
        clean.python,
        "-c",
        "import sys, rankexec, rankexec.host, rankexec.worker\n"
        "assert 'numpy' not in sys.modules\nprint(rankexec.__file__)\n",
    )
    assert probe.stdout.strip().startswith(str(clean.venv)), probe.stdout


COMPONENT = '''
import os
import pathlib

import rankexec


class Waiter:
    """`hello` answers at once; `wait` marks that it started, then waits for the abort."""

    def __init__(self, marks: str) -> None:
        self.marks = pathlib.Path(marks)

    def execute(self, task, input, ctx, abort):
        if task == "wait":
            (self.marks / f"started-{ctx.rank}").touch()
            if abort.wait(120):
                raise rankexec.TaskAborted(abort.reason or "aborted")
            raise RuntimeError("no abort within 120 s")
        return rankexec.Shareable(
            meta={"rank": ctx.rank, "world_size": ctx.world_size, "task": task, "pid": os.getpid()}
        )
'''

HOST = """
import json
import os
import pathlib

import rankexec
from rankexec.host import Aborted, RankGroup


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


here = pathlib.Path.cwd()
marks = here / "marks"
marks.mkdir()
out = {"version": rankexec.__version__, "file": rankexec.__file__}
config = {
    "executor_id": "w",
    "num_of_processes": 2,
    "components": [{"id": "w", "path": "comp.py:Waiter", "args": {"marks": str(marks)}}],
    "worker": {"program": "python", "args": ["-m", "rankexec.worker"]},
    "gpu": {"mode": "none"},
}
with RankGroup(config, workspace=str(here / "ws")) as group:
    group.start()
    pids = group.pids()
    out["hello"] = group.execute("hello", {"x": 1}).meta
    try:
        group.execute(
            "wait",
            abort_check=lambda: len(list(marks.iterdir())) == 2,
            abort_reason="the test aborts",
        )
        out["abort"] = "no Aborted raised"
    except Aborted as e:
        out["abort"] = {"reason": e.reason, "forced": e.forced}
    out["after_abort"] = group.execute("hello").meta
    out["closed"] = group.close()
out["pids"] = pids
out["alive_after_close"] = [p for p in pids if alive(p)]

# Rust ranks: the default worker program, `rankexec-worker`, is the packaged binary.
echo = {"executor_id": "e", "num_of_processes": 2,
        "components": [{"id": "e", "path": "Echo"}], "gpu": {"mode": "none"}}
with RankGroup(echo, workspace=str(here / "ws")) as group:
    group.start()
    rust_pids = group.pids()
    out["rust_exe"] = sorted({os.readlink(f"/proc/{p}/exe") for p in rust_pids})
    out["echo"] = group.execute("t", {"x": 2}).meta
out["rust_alive_after_close"] = [p for p in rust_pids if alive(p)]
print(json.dumps(out))
"""


def test_a_rank_group_runs_from_the_installed_wheel(clean):
    (clean.cwd / "comp.py").write_text(COMPONENT)
    (clean.cwd / "host.py").write_text(HOST)
    proc = clean.run(clean.python, "host.py")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(out, indent=1))
    assert out["file"].startswith(str(clean.venv)), out["file"]
    assert out["hello"]["world_size"] == 2 and out["hello"]["rank"] == 0
    assert out["abort"] == {"reason": "the test aborts", "forced": False}, out["abort"]
    assert out["after_abort"]["task"] == "hello"
    assert len(out["pids"]) == 2 and out["alive_after_close"] == [], out
    packaged = clean.venv.glob("lib/python3*/site-packages/rankexec/_bin/rankexec-worker")
    assert out["rust_exe"] == [str(p) for p in packaged], out["rust_exe"]
    assert out["echo"]["x"] == 2
    assert out["rust_alive_after_close"] == []
    assert clean.live_processes() == []


def test_the_rankexec_command_runs_jobs_without_a_checkout(clean):
    version = clean.run("rankexec", "--version").stdout.strip()
    py_version = clean.run(clean.python, "-c", "import rankexec; print(rankexec.__version__)")
    meta = clean.run(
        clean.python, "-c", "import importlib.metadata as m; print(m.version('rankexec'))"
    )
    print(
        f"{version!r}, rankexec.__version__ {py_version.stdout.strip()}, "
        f"dist {meta.stdout.strip()}, workspace {WORKSPACE_VERSION}"
    )
    assert version == f"rankexec {WORKSPACE_VERSION}"
    assert py_version.stdout.strip() == meta.stdout.strip() == WORKSPACE_VERSION

    # The CLI's own ranks (`rankexec worker`: the built-in components, no example).
    listed = clean.run("rankexec", "worker", "--list-components").stdout
    assert "Echo" in listed and "DigitsTrainer" not in listed, listed
    run = clean.run(
        "rankexec", "run", "-n", "2", "--component", "Echo", "--meta", '{"x": 5}', "--rounds", "2"
    )
    print(run.stdout)
    assert "round 1: ok" in run.stdout and '"x":5' in run.stdout, run.stdout

    # Python ranks from a config file, as the README's example runs them.
    (clean.cwd / "comp.py").write_text(COMPONENT)
    config = {
        "executor_id": "w",
        "num_of_processes": 2,
        "worker": {"program": "python", "args": ["-m", "rankexec.worker"]},
        "components": [{"id": "w", "path": "comp.py:Waiter", "args": {"marks": "."}}],
        "gpu": {"mode": "none"},
    }
    (clean.cwd / "component.json").write_text(json.dumps(config))
    run = clean.run(
        "rankexec", "run", "--config", "component.json", "--task", "hello", "--rounds", "2"
    )
    print(run.stdout)
    assert "round 1: ok" in run.stdout and '"world_size":2' in run.stdout, run.stdout
    assert clean.live_processes() == []


def test_the_flare_example_runs_under_nvflare_simulator_from_the_wheel(clean):
    from flare.flare_helpers import assert_no_errors, rank_pids

    ws = clean.cwd / "ws-numpy"
    # flare-admins.md's install: the wheel with [flare], then the site's allow-list and
    # policy, into the simulator's workspace.
    admins = docrun.console(
        "docs/flare-admins.md",
        "wheel",
        wheel=clean.wheel,
        paths={"/path/to/site": ws},
        cwd=clean.cwd,
    )
    _run_block(clean, admins, "docs/flare-admins.md", no_deps=False)
    installed = clean.installed()
    assert {"nvflare", "numpy"} <= installed and "torch" not in installed, sorted(installed)
    job = clean.cwd / "numpy-fedavg"
    shutil.copytree(REPO / "examples" / "flare" / "numpy-fedavg", job)
    sim = clean.run(
        str(clean.venv / "bin" / "nvflare"),
        "simulator",
        str(job),
        "-w",
        str(ws),
        "-n",
        "2",
        "-t",
        "2",
        check=False,
    )
    assert sim.returncode == 0, (
        f"simulator exited {sim.returncode}:\n{sim.stdout[-4000:]}\n{sim.stderr[-4000:]}"
    )
    assert_no_errors(ws)
    model = clean.run(
        clean.python,
        "-c",
        "import numpy, sys; print(numpy.load(sys.argv[1]).tolist())",
        str(ws / "server" / "simulate_job" / "models" / "server.npy"),
    ).stdout.strip()
    print("final model:", model)
    # 3 rounds; every rank adds delta 1.0; FedAvg of equal client models is that model.
    assert json.loads(model) == [[v + 3.0 for v in row] for row in INITIAL]
    for site in ("site-1", "site-2"):
        log = (ws / site / "log.txt").read_text(errors="replace")
        m = re.search(r"rank group of 2 ready in ([\d.]+) ms", log)
        assert m, log[-3000:]
        print(f"{site}: 2 Python ranks ready in {m.group(1)} ms")
    assert rank_pids(ws) == []
    assert clean.live_processes() == []


# --- the install commands of the guide ------------------------------------------------

# `pip install` with the wheel's file (its name in full, or abbreviated `rankexec-0.1.0-...whl`)
# or the checkout's `./python`, in README.md and docs/*.md: fenced lines and inline code.
_PIP = re.compile(r"(?:^\s*(?:\$ )?|`)(pip install [^`#\n]+)")
_WHEEL_ARG = re.compile(r"^rankexec-[^\[\s]*\.whl(?:\[(\w+)\])?$")
_SOURCE_ARG = re.compile(r"^\./python(?:\[(\w+)\])?$")


def _install_commands() -> list[tuple[str, str]]:
    """``(where, command)`` of every guide command that installs rankexec."""
    found = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        for n, line in enumerate(page.read_text().splitlines(), 1):
            for m in _PIP.finditer(line):
                cmd = m.group(1).strip()
                args = shlex.split(cmd)[2:]
                if any(_WHEEL_ARG.match(a) or _SOURCE_ARG.match(a) for a in args):
                    found.append((f"{page.relative_to(REPO)}:{n}", cmd))
    return found


def _run_block(
    clean: CleanEnv, steps: list[docrun.Step], where: str, *, no_deps: bool = True
) -> None:
    """Runs a run-in block's steps as a user's shell would, in `clean`'s environment:
    `python`, `pip` and the venv's tools are those of the active venv (the clean one,
    until a `. VENV/bin/activate` step activates the block's own); `python -m venv`
    runs as written. With `no_deps`, a `pip install` installs the wheel with `--no-deps`
    (its extra's packages are checked against the test venv, as the test below does for
    every install command) and checks that any other package it names is in the test
    venv, without downloading it; else it runs as written (from pip's cache). Each
    step's exit code and output are the page's."""
    bindir = Path(sys.executable).parent
    active = clean.venv / "bin"
    env = dict(clean.env)
    for step in steps:
        argv = list(step.argv)
        if argv[0] == ".":  # what `activate` does that matters here: PATH, VIRTUAL_ENV
            active = (step.cwd / argv[1]).parent
            assert (active / "activate").is_file(), f"{where}: no {argv[1]}"
            env.update(PATH=f"{active}{os.pathsep}{env['PATH']}", VIRTUAL_ENV=str(active.parent))
            continue
        tool = "python" if argv[0] == sys.executable else argv[0]
        if Path(tool).parent == bindir:
            tool = Path(tool).name
        argv[0] = str(active / tool) if "/" not in tool else tool
        if argv[1:2] == ["install"] and tool == "pip" and no_deps:
            from importlib.metadata import PackageNotFoundError, version

            from packaging.requirements import Requirement

            wheels = [a for a in argv[2:] if a.startswith(str(clean.wheel))]
            for a in argv[2:]:
                if a in wheels or a.startswith("-"):
                    continue
                req = Requirement(a)
                try:
                    have = version(req.name)
                except PackageNotFoundError:
                    pytest.fail(f"{where}: {req} is not in the test venv")
                assert req.specifier.contains(have, prereleases=True), f"{where}: {req}"
            if not wheels:
                print(f"{where}: $ {' '.join(step.argv)}: in the test venv, not installed")
                continue
            argv = [argv[0], "install", "--no-deps", *wheels]
        proc = subprocess.run(
            argv,
            check=False,
            cwd=step.cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=PIP_CAP_S if tool == "pip" else RUN_CAP_S,
        )
        print(f"{where}: $ {' '.join(argv)} -> {proc.returncode}")
        err = step.check(proc.returncode, proc.stdout)
        assert err is None, f"{where}: {err}\n{proc.stdout[-4000:]}"


def test_the_wheel_blocks_of_the_guide_run_as_written(clean):
    """The guide's install-from-the-wheel blocks (README, getting-started, rank-code,
    the two Flower apps' environments), read from the pages, each in a folder of its
    own (those that make a `.venv` make their own; the Flower ones install into the
    clean venv)."""
    for folder in ("readme", "getting-started", "rank-code", "flower"):
        (clean.root / folder).mkdir()
    readme = docrun.console("README.md", "wheel", wheel=clean.wheel, cwd=clean.root / "readme")
    started = docrun.console(
        "docs/getting-started.md",
        "wheel",
        wheel=clean.wheel,
        cwd=clean.root / "getting-started",
    )
    rank_code = docrun.console(
        "docs/rank-code.md", "wheel", wheel=clean.wheel, cwd=clean.root / "rank-code"
    )
    flower = docrun.console("docs/flower.md", "wheel", wheel=clean.wheel, cwd=clean.root / "flower")
    hf = docrun.console("docs/flower.md", "hf-wheel", wheel=clean.wheel, cwd=clean.root / "flower")
    for where, steps in (
        ("README.md", readme),
        ("docs/getting-started.md", started),
        ("docs/rank-code.md", rank_code),
        ("docs/flower.md, the example", flower),
        ("docs/flower.md, Hugging Face", hf),
    ):
        _run_block(clean, steps, where)


def test_every_install_command_of_the_guide_installs_the_wheel_with_its_extra(clean):
    """Each command as written, with the wheel's real path for its file name: pip
    installs the wheel with the extra the command names (``--no-deps``: the packages
    each extra and the command add are checked, not downloaded, against the test venv
    CI runs the suites in, where they are all installed); the full file name a page
    shows is the one scripts/wheel.sh builds; ``./python[extra]`` names an extra that
    python/pyproject.toml declares. Not run: the source install itself (a second
    compile of the extension; ``maturin develop`` in scripts/test.sh builds the same)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement

    commands = _install_commands()
    assert len(commands) >= 5, commands
    with zipfile.ZipFile(clean.wheel) as z:
        metadata = z.read(_dist_info(z) + "METADATA").decode()
    requires = [
        Requirement(r) for r in re.findall(r"^Requires-Dist: (.+)$", metadata, re.MULTILINE)
    ]
    declared = tomllib.loads((REPO / "python" / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]

    def satisfied(req: Requirement, where: str) -> None:
        try:
            have = version(req.name)
        except PackageNotFoundError:
            pytest.fail(f"{where}: {req} is not in the test venv")
        assert req.specifier.contains(have, prereleases=True), f"{where}: {req}, have {have}"

    done: set[str | None] = set()
    for where, cmd in commands:
        args = shlex.split(cmd)[2:]
        for a in args:
            if m := _WHEEL_ARG.match(a):
                name = a.split("[")[0]
                if "..." not in name:
                    assert name == clean.wheel.name, f"{where}: {name} is not {clean.wheel.name}"
                extra = m.group(1)
                assert extra is None or extra in declared, f"{where}: no extra [{extra}]"
                if extra not in done:
                    spec = str(clean.wheel) + (f"[{extra}]" if extra else "")
                    clean.pip_install("--no-deps", spec)
                    done.add(extra)
                for req in requires:
                    if extra and req.marker is not None and req.marker.evaluate({"extra": extra}):
                        satisfied(req, where)
            elif m := _SOURCE_ARG.match(a):
                extra = m.group(1)
                assert extra is None or extra in declared, f"{where}: no extra [{extra}]"
            elif not a.startswith("-"):
                satisfied(Requirement(a), where)
    print("install commands:", len(commands), "extras installed:", sorted(map(str, done)))
    assert {"flare", "flower", "torch"} <= done, done
    assert "rankexec" in clean.installed()
