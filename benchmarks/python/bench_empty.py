"""The empty component of the start-up and round-trip figures (imports nothing more
than rankexec, so start-up compares with the bare interpreter importing rankexec)."""


class Empty:
    def execute(self, task, input, ctx, abort):
        return None
