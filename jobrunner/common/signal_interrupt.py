"""The exception our SIGTERM and second-Ctrl-C handlers raise to stop a command at once."""
from __future__ import annotations


class SignalInterrupt(KeyboardInterrupt):
    """Caught wherever KeyboardInterrupt is. A subclass, not KeyboardInterrupt itself: CPython 3.11 marks a
    bare KeyboardInterrupt that passes out of an exec'd string (a dataclass built while a module imports)
    as unhandled and, however the command then exits, ends the process by SIGINT (return code -2) in
    place of its own exit code (130). The check is on the exact type, so a subclass is not marked."""
