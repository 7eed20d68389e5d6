"""SIGTERM and SIGHUP end ``toolsetctl`` as Ctrl-C does, then by the signal itself.

A CI runner stops a job with SIGTERM (GitLab, ``docker stop``, a step's ``timeout``),
GitHub Actions at times with SIGHUP, and a closed terminal sends SIGHUP. By default
either ended ``toolsetctl`` at once: a ``--format jsonl`` log stopped after its last
``progress`` line, with nothing telling a reader the call was cancelled rather than cut
off, and the call was cancelled only because the daemon noticed the closed connection.

``Termination.catch`` makes each signal raise ``Terminated``, a ``KeyboardInterrupt``,
so every path that handles Ctrl-C handles it too: ``invoke`` sends ``cancel``, waits
(bounded: a runner sends SIGKILL seconds later) and prints the outcome, and any other
command prints its ``Interrupted by SIGTERM.`` error. ``Termination.end`` then ends the
process by that signal, as the default action would have: a shell reports 143 (129), and
a parent that reads the wait status (``timeout``, Python's ``subprocess``) sees the signal.

Only the first one counts: a second SIGTERM or SIGHUP is ignored (``timeout`` signals the
command and then its process group, so one often comes twice), and the wait for the
cancelled call is bounded anyway. A signal the parent left ignored (``nohup`` ignores
SIGHUP) stays ignored.

``Termination.run`` runs the command between ``catch`` and ``end``. A signal may come
once the command has returned and before ``end`` has restored the default actions (the
command's outcome printed, its handlers left): that ``Terminated`` is caught there too,
and ``end`` ends the process by it, as it does for one the command handled.

Ctrl-C raises ``KeyboardInterrupt`` while the command runs, as Python's own handler does
(``invoke`` cancels its call on it, a second one stops the wait). Once the command has
returned there is nothing left to stop, and Python's handler raised it outside every
handler: a traceback, and a death by SIGINT. ``catch`` puts a handler of ours in its
place that raises only until the command returns and then notes the signal: the process
exits 130 (as for a Ctrl-C the command handled; with the command's code once ``run`` has
returned it), nothing more printed. One raised in the
few instructions between the command's return and that note is caught as ``Terminated``
is. A SIGINT the parent left ignored (a background job of a script) stays ignored.
"""

from __future__ import annotations

import os
import signal
import sys

from .exits import EXIT_HUNG_UP, EXIT_INTERRUPTED, EXIT_TERMINATED

TYPE_CHECKING = False  # not typing's: importing typing is a share of the start-up
if TYPE_CHECKING:
    from collections.abc import Callable
    from types import FrameType

__all__ = ["HELD", "Terminated", "Termination", "interruption"]

#: The signals caught (what a CI runner or a closed terminal sends to stop a command), and
#: the exit code of each: 128 + its number, what a shell reports for a process it ended.
_CAUGHT: dict[int, int] = {signal.SIGTERM: EXIT_TERMINATED, signal.SIGHUP: EXIT_HUNG_UP}

#: The signals that stop a command (``KeyboardInterrupt``, ``Terminated``), held (blocked)
#: where one must not land: between a call event's line taken from what was read and that
#: line owed to stdout (``BlockingClient._read_once``, ``Output.json``), and around each
#: write of it (``Output._drain``), whose wait for a lagging reader lets them in.
HELD = frozenset({signal.SIGINT, *_CAUGHT})


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived: handled as Ctrl-C is, then the process ends by it.

    Attributes:
        signum: The signal's number.
    """

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def interruption(exc: KeyboardInterrupt) -> tuple[str, int]:
    """What stopped the command (``Interrupted``, ``Interrupted by SIGTERM``) and the exit
    code that says so: 130 for Ctrl-C, 143 for SIGTERM, 129 for SIGHUP."""
    if isinstance(exc, Terminated):
        return f"Interrupted by {signal.Signals(exc.signum).name}", _CAUGHT[exc.signum]
    return "Interrupted", EXIT_INTERRUPTED


class Termination:
    """The SIGTERM and SIGHUP handlers of one ``toolsetctl`` run, and the signal received."""

    def __init__(self) -> None:
        self.received: int | None = None
        #: Whether the command has returned (a Ctrl-C then only sets ``interrupted``).
        self.finished = False
        self.interrupted = False

    def catch(self) -> None:
        """Make SIGTERM and SIGHUP raise ``Terminated`` (those the parent did not ignore),
        and SIGINT raise ``KeyboardInterrupt`` until the command has returned."""
        for signum in _CAUGHT:
            if signal.getsignal(signum) == signal.SIG_DFL:
                signal.signal(signum, self._raise)
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._interrupt)

    def run(self, command: Callable[[], int]) -> int:
        """Run ``command`` with the handlers in place, then ``end``: return its exit code
        (130 when a Ctrl-C or a signal got past its own handlers, or a Ctrl-C came once it
        had returned), unless a signal caught ends the process first.

        A ``Terminated`` raised once the command has returned (before ``end``, or in it
        before the default actions are back) was raised outside every handler: a
        traceback, and a process that did not end by the signal. Only the first signal
        raises, so the one caught here is the only one, and ``end`` ends by it. A Ctrl-C
        then raises nothing (``_interrupt``); only one in the instructions between the
        command's return and ``finished`` could, and it is caught here the same way.
        """
        code = EXIT_INTERRUPTED
        self.catch()
        try:
            try:
                code = command()
                self.finished = True
            except KeyboardInterrupt:  # a signal after the command's own handlers
                self.finished = True
                code = EXIT_INTERRUPTED
            self.end()
        except KeyboardInterrupt as exc:  # it came once the command had finished
            self.finished = True
            if not isinstance(exc, Terminated):  # a Ctrl-C before ``finished`` was set
                self.interrupted = True
            self.end()
        return EXIT_INTERRUPTED if self.interrupted else code

    def _interrupt(self, signum: int, frame: FrameType | None) -> None:
        # Python's default_int_handler while the command runs; once it has returned, the
        # exit code says it (130), and nothing is raised where no handler is left.
        if not self.finished:
            raise KeyboardInterrupt
        self.interrupted = True

    def _raise(self, signum: int, frame: FrameType | None) -> None:
        # Only the first: GNU timeout, and runners, signal the process and then its group,
        # and a second Terminated would cut short the wait for the cancelled call's result.
        if self.received is None:
            self.received = signum
            raise Terminated(signum)

    def end(self) -> None:
        """Restore the default actions; then, if a signal was caught, end by it (the
        command has printed its outcome and flushed its output)."""
        for signum in _CAUGHT:
            if signal.getsignal(signum) == self._raise:
                signal.signal(signum, signal.SIG_DFL)
        if self.received is not None:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except (AttributeError, ValueError, OSError):
                    pass  # nothing to flush, or nobody to read it: the signal still ends it
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {self.received})
            os.kill(os.getpid(), self.received)
