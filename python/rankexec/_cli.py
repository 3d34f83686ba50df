"""The ``rankexec`` console command of the installed package.

The wheel ships the Rust command line as ``rankexec/_bin/rankexec``; this entry point
(``[project.scripts]``) replaces the Python process with it (``os.execv``), so signals,
exit codes and the terminal are the binary's own, and its ``rankexec worker`` ranks find
``rankexec-worker`` beside it. A package built without the binaries (from a checkout or
the sdist) says so and exits with code 127.
"""

from __future__ import annotations

import os
import sys

from rankexec._paths import binary


def main() -> None:
    exe = binary("rankexec")
    if exe is None:
        sys.stderr.write(
            "rankexec: this installation carries no `rankexec` binary (it was built from a"
            " checkout or the sdist); install the wheel (scripts/wheel.sh builds it), or"
            " build it with `cargo build --release` and run target/release/rankexec\n"
        )
        sys.exit(127)
    try:
        os.execv(exe, ["rankexec", *sys.argv[1:]])
    except OSError as e:
        sys.stderr.write(f"rankexec: cannot run {exe}: {e}\n")
        sys.exit(126)


if __name__ == "__main__":
    main()
