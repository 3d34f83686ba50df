"""Who may talk to the node's host, and where a ClientApp finds a host that runs as its
own service user.

Why: a Flower ClientApp is code the federation's server ships; it runs as the
SuperNode's user. A host of that same user is only a protocol against it (the app can
read the secret, signal the host, replace the site file). A host run as another user (a
service user, ``examples/flower/systemd``) is a wall, provided it talks to the
SuperNode's user only through its socket and lets nobody else in:

- the host: ``PeerPolicy`` (``--allow-uid``, ``--allow-gid``, repeatable, names or
  numbers) is checked on every connection's peer credentials (``SO_PEERCRED``) before
  anything is read from it (``_channel.accept_auth``); its own uid is always allowed.
  A host that allows anyone else shares its node folder with its own group
  (``shared_dir``: folder 0750, secret 0640, socket 0660, the host's primary gid), so
  the SuperNode's user must be a member of that group to reach the socket at all;
- the ClientApp: ``RANKEXEC_FLOWER_NODE_DIR`` (in the SuperNode's environment, which
  ``flwr-clientapp`` inherits) names the folder such a host serves, and
  ``RANKEXEC_FLOWER_HOST_UID`` (a name or a number) the uid the host must run as
  (``host_uid``; default this process's own). With ``RANKEXEC_FLOWER_NODE_DIR`` the
  ClientApp never starts a host: it connects, checks the folder is the host uid's and
  not writable by anyone else (``client_dir``), and the host's credentials
  (``_channel.connect``).

Caveats: ``SO_PEERCRED`` gives the peer's *effective* uid and its *primary* gid at the
time it connected, never its supplementary groups: ``--allow-gid G`` admits a process
whose gid is G (systemd's ``Group=``), not every member of G. Root's processes can read
anything: the checks do not hold against root. Linux only.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from rankexec.flower import _channel
from rankexec.flower._channel import ChannelError

__all__ = ["PeerPolicy", "client_dir", "host_uid", "is_service_dir", "parse_gid", "parse_uid"]

#: The modes of a node folder and its files that a host shares with its group.
DIR_MODE = 0o750
SECRET_MODE = 0o640
SOCKET_MODE = 0o660


def parse_uid(value: str | int) -> int:
    """A uid from a number or a user name; ``ValueError`` names an unknown user."""
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    try:
        return pwd.getpwnam(text).pw_uid
    except KeyError:
        raise ValueError(f"no user named {text!r}") from None


def parse_gid(value: str | int) -> int:
    """A gid from a number or a group name; ``ValueError`` names an unknown group."""
    text = str(value).strip()
    if text.isdigit():
        return int(text)
    try:
        return grp.getgrnam(text).gr_gid
    except KeyError:
        raise ValueError(f"no group named {text!r}") from None


@dataclass(frozen=True)
class PeerPolicy:
    """The peers a host serves besides its own uid: by uid, or by (primary) gid."""

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, uids: Iterable[str | int] = (), gids: Iterable[str | int] = ()) -> PeerPolicy:
        return cls(frozenset(parse_uid(u) for u in uids), frozenset(parse_gid(g) for g in gids))

    @property
    def shared(self) -> bool:
        """Whether anyone but the host's own uid is allowed (the folder is then shared
        with the host's group)."""
        return bool(self.uids or self.gids)

    def allows(self, uid: int, gid: int) -> bool:
        return uid == os.getuid() or uid in self.uids or gid in self.gids

    def describe(self) -> str:
        if not self.shared:
            return f"uid {os.getuid()} only"
        return (
            f"uid {os.getuid()}, uids {sorted(self.uids)}, gids {sorted(self.gids)};"
            f" folder shared with gid {os.getegid()}"
        )


def shared_dir(path: Path) -> Path:
    """The host's node folder when it allows other peers: created if missing, this
    uid's, nothing for others and no group write (else refused, never reused), then
    given mode ``DIR_MODE`` and this process's gid, so that members of the host's group
    can reach the socket and read the secret."""
    st = _channel.owned_dir(path)
    if stat.S_IMODE(st.st_mode) & 0o027:
        raise ChannelError(
            f"{path} is open to other users or writable by its group (mode"
            f" {oct(st.st_mode)}); refusing"
        )
    try:
        if st.st_gid != os.getegid():
            os.chown(path, -1, os.getegid())
        os.chmod(path, DIR_MODE)
    except OSError as e:
        raise ChannelError(
            f"the folder {path} cannot be shared with gid {os.getegid()}: {e}"
        ) from e
    return path


def host_uid() -> int:
    """The uid the node's host must run as: for a host the site runs
    (``RANKEXEC_FLOWER_NODE_DIR``), ``$RANKEXEC_FLOWER_HOST_UID`` (a name or a number)
    when set; else this process's (a host a ClientApp starts is its own user's)."""
    value = os.environ.get("RANKEXEC_FLOWER_HOST_UID")
    if not value or not is_service_dir():
        return os.getuid()
    try:
        return parse_uid(value)
    except ValueError as e:
        raise ChannelError(f"RANKEXEC_FLOWER_HOST_UID={value!r}: {e}") from None


def is_service_dir() -> bool:
    """Whether the node's host is the site's (``RANKEXEC_FLOWER_NODE_DIR`` is set): the
    ClientApp connects to it and never starts one."""
    return bool(os.environ.get("RANKEXEC_FLOWER_NODE_DIR"))


def client_dir(node_id: int) -> Path:
    """The node folder a ClientApp connects to: ``$RANKEXEC_FLOWER_NODE_DIR`` when the
    site runs the host (checked: a folder of the host's uid that nobody else may write),
    else its own private ``node-<id>`` folder (``_channel.node_dir``)."""
    value = os.environ.get("RANKEXEC_FLOWER_NODE_DIR")
    if not value:
        return _channel.node_dir(node_id)
    path = Path(value)
    owner = host_uid()
    try:
        st = path.lstat()
    except OSError as e:
        raise ChannelError(
            f"RANKEXEC_FLOWER_NODE_DIR={value}: the host's folder cannot be read: {e}"
        ) from e
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != owner:
        raise ChannelError(
            f"RANKEXEC_FLOWER_NODE_DIR={value} is not a folder of the host's uid {owner}"
            f" (RANKEXEC_FLOWER_HOST_UID); refusing"
        )
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise ChannelError(
            f"RANKEXEC_FLOWER_NODE_DIR={value} can be written by others (mode"
            f" {oct(st.st_mode)}); refusing"
        )
    return path
