"""The ``rankexec`` console command of the installed package.

The wheel ships the Rust command line as ``rankexec/_bin/rankexec``; this entry point
(``[project.scripts]``) replaces the Python process with it (``os.execv``), so signals,
exit codes and the terminal are the binary's own, and its ``rankexec worker`` ranks find
``rankexec-worker`` beside it. A package without the binaries (a checkout's development
install, the sdist) runs the checkout's ``target/release/rankexec`` or another
``rankexec`` on ``PATH`` (see ``rankexec._paths.command``), else says what to do and
exits with code 127.
"""

from __future__ import annotations

import os
import sys

from rankexec._paths import command


def main() -> None:
    exe = command(skip=sys.argv[0] if sys.argv and sys.argv[0] else None)
    if exe is None:
        sys.stderr.write(
            "rankexec: this installation carries no `rankexec` binary (it was built from a"
            " checkout or the sdist) and none is on PATH: install the wheel (scripts/wheel.sh"
            " builds it), or run `cargo build --release` in the checkout\n"
        )
        sys.exit(127)
    try:
        os.execv(exe, ["rankexec", *sys.argv[1:]])
    except OSError as e:
        sys.stderr.write(f"rankexec: cannot run {exe}: {e}\n")
        sys.exit(126)


if __name__ == "__main__":
    main()
