"""The one exception type the project's CLIs turn into a single `Error: ...` line."""


class ClusterError(Exception):
    """A problem the user can fix. The message names what is wrong and, where known, the fix.

    `exit_code` lets a caller distinguish bad input (2) from a failed operation (1).
    """

    def __init__(self, message: str, *, hint: str | None = None, exit_code: int = 2):
        super().__init__(message)
        self.hint = hint
        self.exit_code = exit_code

    def line(self) -> str:
        text = f"Error: {self}"
        if self.hint:
            text += f" (try {self.hint})"
        return text
