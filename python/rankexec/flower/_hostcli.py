"""The Flower node host's command line (``python -m rankexec.flower.host``): its
arguments, their defaults and the checks on them.

Why a module of its own: the arguments are many (where the node is, who the SuperNode
is, the SuperLink's settings, the deadlines, who else may connect) and their help is
the reference's (``docs/configuration.md`` is generated from this parser, by
``scripts/config_sections.py`` through ``host.main``). ``parse`` exits 2 with argparse's
message on a bad argument, before anything is made.

Caveats: the parser's description is ``host``'s module docstring (``host.main`` passes
it), so the reference's one-line summary is that docstring's first line. The defaults
here are also ``Host``'s keyword defaults.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rankexec.flower import _peer

__all__ = ["HANDSHAKE_S", "MAX_UNAUTHENTICATED", "REQUEST_S", "SHUTDOWN_WAIT_S", "parse"]

SHUTDOWN_WAIT_S = 30.0
#: Seconds a connection has for the whole handshake (nonce, answer, OK).
HANDSHAKE_S = 10.0
#: Seconds an authenticated connection has to send its whole request.
REQUEST_S = 60.0
#: Connections in their handshake at once; further ones are closed at once.
MAX_UNAUTHENTICATED = 64


def _parser(description: str | None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rankexec.flower.host", description=description)
    p.add_argument(
        "--dir", type=Path, default=None, help="default: the node's folder under the base"
    )
    p.add_argument("--node-id", required=True, type=int)
    p.add_argument("--supernode-pid", type=int, default=None)
    p.add_argument(
        "--superlink", default=None, help="the SuperLink's address (default: the SuperNode's)"
    )
    p.add_argument(
        "--root-certificates",
        default=None,
        help="the CA that signs the SuperLink's certificate (default: the SuperNode's)",
    )
    p.add_argument(
        "--node-key",
        default=None,
        help="the node's private key, with SuperNode authentication (default: the SuperNode's)",
    )
    p.add_argument("--lease", type=float, default=None, help="idle seconds (default: the site's)")
    p.add_argument("--site", default=None, help="the site file (default: the SuperNode's)")
    p.add_argument(
        "--shutdown-wait",
        type=float,
        default=SHUTDOWN_WAIT_S,
        help="on SIGTERM, seconds a task in flight has to return after its abort (not"
        " after the SuperNode's death: its groups are killed at once)"
        f" (default {SHUTDOWN_WAIT_S:g})",
    )
    p.add_argument(
        "--handshake-deadline",
        type=float,
        default=HANDSHAKE_S,
        help="seconds a connection has for the whole handshake before it is closed"
        f" (default {HANDSHAKE_S:g})",
    )
    p.add_argument(
        "--request-deadline",
        type=float,
        default=REQUEST_S,
        help=f"seconds an authenticated connection has to send its request (default {REQUEST_S:g})",
    )
    p.add_argument(
        "--max-unauthenticated",
        type=int,
        default=MAX_UNAUTHENTICATED,
        help="connections in their handshake at once; further ones are closed at once"
        f" (default {MAX_UNAUTHENTICATED})",
    )
    p.add_argument(
        "--node-config", default=None, help="the SuperNode's --node-config (default: read it)"
    )
    p.add_argument(
        "--allow-uid",
        action="append",
        default=[],
        metavar="UID",
        help="a uid (or user name) besides the host's own that may connect, checked by"
        " SO_PEERCRED (repeatable); the node folder is then shared with the host's group",
    )
    p.add_argument(
        "--allow-gid",
        action="append",
        default=[],
        metavar="GID",
        help="a gid (or group name) whose processes may connect: the peer's primary gid,"
        " checked by SO_PEERCRED (repeatable); the node folder is then shared as above",
    )
    p.add_argument(
        "--service",
        action="store_true",
        help="a host the site runs (systemd): it does not leave when idle with no run",
    )
    return p


def parse(
    argv: list[str] | None, description: str | None
) -> tuple[argparse.Namespace, _peer.PeerPolicy]:
    """The host's arguments and the peers they allow; exits 2 (argparse's ``error``)
    on arguments that do not go together."""
    p = _parser(description)
    a = p.parse_args(argv)
    if a.max_unauthenticated < 1 or a.handshake_deadline <= 0 or a.request_deadline <= 0:
        p.error("--max-unauthenticated, --handshake-deadline and --request-deadline are positive")
    try:
        peers = _peer.PeerPolicy.of(a.allow_uid, a.allow_gid)
    except ValueError as e:
        p.error(f"--allow-uid/--allow-gid: {e}")
    if peers.shared and not a.dir:
        p.error("--allow-uid/--allow-gid need --dir (the folder the SuperNode's side is told)")
    return a, peers
