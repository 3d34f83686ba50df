"""Edits of a FLARE site's ``local/resources.json`` that never break the site.

A provisioned FLARE site (``nvflare poc prepare``, ``nvflare provision``) keeps its
settings in ``local/resources.json.default``: ``resource_manager``,
``resource_consumer``, ``process_launcher``, ``site_log_streamer``, the allow-list
enforcement mode and more. FLARE reads ``local/resources.json`` *instead of* the
``.default`` file when it exists, so a ``resources.json`` holding only a
``class_allow_list`` leaves the site without a resource manager, and it can run no job
at all (the server's log repeats ``resource_manager should be of type
ResourceManagerSpec, but got <class 'NoneType'>``).

:func:`edit_resources` is the one way this package changes that file:

- it starts from the file FLARE reads now: ``resources.json`` if present, else
  ``resources.json.default``, else (a simulator workspace, or a new folder that is not
  a provisioned kit) an empty document;
- it keeps every key and changes only what the caller's function changes;
- a file that does not parse (or is not a JSON object) is refused with its path and the
  parse error (:class:`SiteFileError`), and nothing is written;
- it writes atomically (a temporary file in the same folder, ``fsync``, ``rename``),
  keeping the file's permissions, and leaves a backup of a ``resources.json`` it
  replaces (``resources.json.bak``, or ``resources.json.bak.N`` when that exists);
- it reports what changed as a unified diff (:class:`ResourcesEdit`), and with
  ``dry_run`` writes nothing.

Caveats: once ``resources.json`` exists, FLARE no longer reads the ``.default`` file,
so a later re-provisioning that only rewrites ``resources.json.default`` is not seen
(the same holds for any site that keeps its own ``resources.json``). The edit is not
locked against a concurrent editor: run it while the site is stopped, or at least not
while another tool edits the same file. FLARE reads the file when the client starts:
restart the client for a change to take effect.
"""

from __future__ import annotations

import difflib
import json
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["ResourcesEdit", "SiteFileError", "edit_resources", "resources_paths"]

RESOURCES = "resources.json"
DEFAULT = "resources.json.default"


class SiteFileError(Exception):
    """A site file cannot be read or written; ``path`` names it. Nothing was changed."""

    def __init__(self, message: str, path: str) -> None:
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class ResourcesEdit:
    """What :func:`edit_resources` did (or, with ``dry_run``, would do)."""

    path: str
    """The file FLARE reads from now on: ``WORKSPACE/local/resources.json``."""
    source: str | None
    """The file the edit started from (``None``: neither file existed)."""
    diff: str
    """A unified diff from ``source`` to the new content (empty: no change)."""
    backup: str | None
    """Where the replaced ``resources.json`` was copied (``None``: nothing replaced)."""
    written: bool
    """Whether ``path`` was written (False on ``dry_run`` or when nothing changed)."""

    @property
    def changed(self) -> bool:
        """Whether the edit changes the file (a non-empty diff)."""
        return bool(self.diff)

    def describe(self) -> str:
        """A few lines for a person: what was read, what changed, where it went."""
        src = self.source or "(no resources file: a new one)"
        if not self.changed:
            return f"{self.path}: no change (read {src})\n"
        lines = [self.diff.rstrip("\n")]
        if self.written:
            lines.append(f"wrote {self.path} (from {src})")
            if self.backup:
                lines.append(f"backup of the previous file: {self.backup}")
        else:
            lines.append(f"dry run: {self.path} not written (would start from {src})")
        return "\n".join(lines) + "\n"


def resources_paths(workspace: str) -> tuple[str, str]:
    """``(resources.json, resources.json.default)`` of a site workspace."""
    local = os.path.join(workspace, "local")
    return os.path.join(local, RESOURCES), os.path.join(local, DEFAULT)


def _is_provisioned(workspace: str) -> bool:
    return os.path.isfile(os.path.join(workspace, "startup", "fed_client.json")) or os.path.isfile(
        os.path.join(workspace, "startup", "fed_server.json")
    )


def _read(path: str) -> tuple[str, dict[str, Any]]:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise SiteFileError(f"{path}: cannot read it: {e}", path) from e
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise SiteFileError(f"{path}: not valid JSON, left as it is: {e}", path) from e
    if not isinstance(doc, dict):
        raise SiteFileError(
            f"{path}: not a JSON object (a {type(doc).__name__}), left as it is", path
        )
    return text, doc


def _render(doc: dict[str, Any]) -> str:
    return json.dumps(doc, indent=2) + "\n"


def _backup_path(path: str) -> str:
    candidate = path + ".bak"
    n = 1
    while os.path.lexists(candidate):
        candidate = f"{path}.bak.{n}"
        n += 1
    return candidate


def _write_atomic(path: str, text: str, mode: int) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".resources.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    try:
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def edit_resources(
    workspace: str,
    change: Callable[[dict[str, Any]], None],
    *,
    dry_run: bool = False,
) -> ResourcesEdit:
    """Applies ``change`` (which edits the document in place) to the resources file
    FLARE reads for the site at ``workspace``; see the module's doc for the rules.

    Raises :class:`SiteFileError` when a file does not parse or cannot be written, and
    when ``workspace`` is a provisioned kit with neither resources file (writing a new
    one would hide the settings FLARE would otherwise default to).
    """
    path, default = resources_paths(workspace)
    source: str | None = None
    old_text = ""
    doc: dict[str, Any] = {}
    if os.path.lexists(path):
        source = path
        old_text, doc = _read(path)
    elif os.path.lexists(default):
        source = default
        old_text, doc = _read(default)
    elif _is_provisioned(workspace):
        raise SiteFileError(
            f"{workspace} is a provisioned FLARE kit (it has startup/) but neither "
            f"local/{RESOURCES} nor local/{DEFAULT}: refusing to write a {RESOURCES} that "
            "would replace the settings FLARE expects there",
            path,
        )
    before = _render(doc) if source else ""
    change(doc)
    after = _render(doc)
    if source and json.loads(before) == doc:
        return ResourcesEdit(path=path, source=source, diff="", backup=None, written=False)
    diff = "".join(
        difflib.unified_diff(
            before.splitlines(keepends=True),
            after.splitlines(keepends=True),
            fromfile=source or "/dev/null",
            tofile=path,
        )
    )
    if dry_run:
        return ResourcesEdit(path=path, source=source, diff=diff, backup=None, written=False)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    mode = 0o644
    backup = None
    if source is not None:
        mode = os.stat(source).st_mode & 0o777
    if source == path:
        backup = _backup_path(path)
        try:
            with open(backup, "x") as f:
                f.write(old_text)
        except OSError as e:
            raise SiteFileError(f"{backup}: cannot write the backup: {e}", backup) from e
    try:
        _write_atomic(path, after, mode)
    except OSError as e:
        raise SiteFileError(f"{path}: cannot write it: {e}", path) from e
    return ResourcesEdit(path=path, source=source, diff=diff, backup=backup, written=True)
