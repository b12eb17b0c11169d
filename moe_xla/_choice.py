"""A trace-time override of one of moe()'s implementation choices (by default "gather" or
"copy"), for tests and benchmarks: `forced(mode)` sets it within a block, `mode` reads it while
tracing ("auto": the choosing module's heuristic). A function jitted under one mode keeps
it in its compiled programs."""

from __future__ import annotations

import contextlib

MODES = ("auto", "gather", "copy")


class Override:
    """The override of the choice that module `owner` makes (its name in error messages)
    among `modes`, "auto" first."""

    def __init__(self, owner: str, modes=MODES):
        self.owner = owner
        self.modes = tuple(modes)
        self.mode = "auto"

    @contextlib.contextmanager
    def forced(self, mode: str):
        if mode not in self.modes:
            raise ValueError(f"{self.owner}.forced: expected a mode in {self.modes}, got {mode!r}")
        previous, self.mode = self.mode, mode
        try:
            yield
        finally:
            self.mode = previous
