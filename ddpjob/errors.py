"""User-facing errors.

Every failure a user can fix is a DDPJobError: the CLI prints it as one line,
`ddpjob: error: <what was found, what was expected>. Hint: <the fix>`, and exits with its code
(2 for usage, 1 for runtime). `assert` is only for internal invariants.
"""

from __future__ import annotations

from ddpjob import exitcodes


class DDPJobError(Exception):
    """A failure the user can act on; `exit_code` 1 = runtime problem."""

    exit_code = exitcodes.ERROR

    def __init__(self, message: str, hint: str = "", *, exit_code: int | None = None) -> None:
        super().__init__(message)
        self.message = message.rstrip(". ")
        self.hint = hint.rstrip(". ")
        if exit_code is not None:
            self.exit_code = exit_code

    def line(self) -> str:
        """The single line the CLI prints (never contains a newline)."""
        text = f"ddpjob: error: {self.message}."
        if self.hint:
            text += f" Hint: {self.hint}" + ("" if self.hint[-1] in "?!" else ".")
        return " ".join(text.split())  # user strings may hold newlines: keep it one line

    def __str__(self) -> str:
        return self.line()


class UsageError(DDPJobError):
    """Bad command line, job file or override: exit code 2."""

    exit_code = exitcodes.USAGE


class ClusterFailure(DDPJobError):
    """What the cluster broke, not the user's code or settings: a collective that failed because
    a peer died or stalled (node/hang.py). A crash it ends is retried inside the allocation
    (ledger/policy.py)."""
