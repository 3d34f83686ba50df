"""A rank program that starts the runtime in component style and never calls
`receive()`: its component is never built."""

import time

from rankexec import _rankexec

rank = _rankexec.start("components")
time.sleep(600)
