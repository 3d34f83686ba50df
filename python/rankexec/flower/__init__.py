"""rankexec in Flower: a ClientApp whose handlers run on a rank group that lives
across rounds.

Switch an app with one import and one argument::

    from rankexec.flower import ClientApp        # was: from flwr.clientapp import ClientApp
    app = ClientApp(num_of_processes=2)          # plus rankexec's deadlines, resources, ...

    @app.train()
    def train(msg: Message, context: Context) -> Message: ...   # runs on every rank

Every rank of the node's group runs the handler with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ...), so
``torch.distributed.init_process_group()`` works (guard it with ``is_initialized()``:
the ranks, and the app module's globals, live from one message to the next). Every rank
receives the message; rank 0's returned ``Message`` is the reply and its
``context.state`` is kept. ``ArrayRecord`` payloads arrive as read-only views of one
copy in shared memory (``ndarrays(record)`` reads them without a copy), and a reply
built with ``shared_array_record(state_dict)`` leaves rank 0 as one memory file, its
tensors copied once, straight into it.

How: Flower runs each message in a new ``flwr-clientapp`` process. This class's
``__call__`` forwards the message to the node's rankexec host
(``rankexec.flower.host``, started by the first message, kept alive across messages),
which keeps the run's group; see that module for when the group ends. At the end of
the ServerApp's ``main``, call ``close_groups(grid)`` so every node closes its group.

Failures: a rank that raises or dies answers the message with Flower's ``Error``
(``ErrorCode.CLIENT_APP_RAISED_EXCEPTION``) naming the rank and the cause; the next
message starts a new group.

What the node runs (the ranks' interpreter, launcher, GPUs, environment) is the
site's decision, from ``--node-config`` and a site file (``rankexec.flower._site``).

Modules: ``_app`` (the ClientApp), ``_start`` (finding or starting the node's host),
``host`` (the host: the site's authority, the runs' groups; its parts are ``_hostnode``,
``_hostserve``, ``_hostops``, ``_hostwatch``, ``_hostcli``, ``_hostlog``), ``_site`` (the
site's rules), ``_channel`` (the authenticated socket; its frames are ``_frames``),
``_peer`` (who may connect: a host run as its own service user), ``_rank`` (the rank
component),
``_codec`` (messages to buffers), ``_arrays`` (``ndarrays``, ``shared_array_record``), ``_state``
(``abort_requested``), ``_server`` (``close_groups``), ``_control`` (the SuperLink's
Control API), ``deployment`` (a local Deployment Engine for tests).

Caveats: tested with flwr 1.42 (``TESTED_FLOWER``) under the Deployment Engine; Linux
only. Custom ``mods`` run on the ranks, around the handler.
"""

from __future__ import annotations

from rankexec.flower._app import ClientApp
from rankexec.flower._arrays import ndarrays, shared_array_record
from rankexec.flower._channel import ChannelError
from rankexec.flower._server import CLOSE_MESSAGE_TYPE, close_groups
from rankexec.flower._site import SiteError
from rankexec.flower._start import host_status
from rankexec.flower._state import abort_requested

__all__ = [
    "CLOSE_MESSAGE_TYPE",
    "TESTED_FLOWER",
    "ChannelError",
    "ClientApp",
    "SiteError",
    "abort_requested",
    "close_groups",
    "host_status",
    "ndarrays",
    "shared_array_record",
]

TESTED_FLOWER = "1.42.0"
