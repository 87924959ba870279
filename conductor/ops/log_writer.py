"""Log lines written by a background thread in batches, so a request only appends its record.

With the defaults (`logs.level: info`) the gateway writes a decision record per request, and with
`logs.access_log` an access line too. Written the standard way (a StreamHandler), each record is
formatted on the event loop and flushed with its own write(2): on a loaded gateway that was about
15% of its CPU per request (benchmarks/bench_gateway.py, docs/performance.md). `BatchingHandler`
takes the record as it is (no formatting, no lock beyond the deque's own) and a writer thread formats
and writes everything pending in one write every `flush_interval_s`, or at once for a WARNING or
worse, so an operator still sees trouble as it happens.

Bounded: at most `max_pending` records wait; past that a record is dropped and counted, and the
next batch says how many were lost, so a stalled log pipe (a full stderr pipe nobody reads) costs
memory up to that bound and never blocks a request. `flush` and `close` write everything pending
(logging.shutdown calls them at exit; `flush_before_sigterm` makes SIGTERM lose nothing either); a
SIGKILL loses at most one interval's lines, which a StreamHandler would have written.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
from typing import TextIO

FLUSH_INTERVAL_S = 0.2
MAX_PENDING = 50_000


class BatchingHandler(logging.Handler):
    """A StreamHandler whose formatting and writing happen on a writer thread, in batches."""

    def __init__(self, stream: TextIO, *, flush_interval_s: float = FLUSH_INTERVAL_S, max_pending: int = MAX_PENDING) -> None:
        super().__init__()
        self.stream = stream
        self.flush_interval_s = flush_interval_s
        self.max_pending = max_pending
        self.dropped = 0  # records refused since the last batch, for its note
        self.dropped_total = 0
        self._pending: collections.deque[logging.LogRecord] = collections.deque()
        self._write_lock = threading.Lock()  # one batch at a time (the writer, or flush from another thread)
        self._wake = threading.Event()
        self._stopping = False
        self._writer = threading.Thread(target=self._run, name="conductor-log-writer", daemon=True)
        self._writer.start()

    def handle(self, record: logging.LogRecord) -> bool:
        # no handler lock per record: deque.append is atomic, and only the writer formats
        if not self.filter(record):
            return False
        if len(self._pending) >= self.max_pending:
            self.dropped += 1
            self.dropped_total += 1
            return True
        self._pending.append(record)
        if record.levelno >= logging.WARNING:
            self._wake.set()
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            self.flush()

    def flush(self) -> None:
        """Format and write every record pending now, in one write."""
        with self._write_lock:
            lines: list[str] = []
            pending = self._pending
            while pending:
                record = pending.popleft()
                try:
                    lines.append(self.format(record))
                except Exception:  # noqa: BLE001 - a bad record must not stop the others (logging's own rule)
                    self.handleError(record)
            if self.dropped:
                lines.append(f"conductor: {self.dropped} log records dropped: the log stream did not keep up")
                self.dropped = 0
            if not lines:
                return
            try:
                self.stream.write("\n".join(lines) + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # a closed or broken stream: nothing else can be done with these
                pass

    def close(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._writer.is_alive() and threading.current_thread() is not self._writer:
            self._writer.join(timeout=5)
        self.flush()
        super().close()


def flush_before_sigterm() -> None:
    """Write the pending lines when SIGTERM ends the process. uvicorn, once it has shut down on
    SIGTERM, raises the signal again under the handler it found; under the default action the
    process ends there without running atexit, so logging.shutdown would never flush the writer.
    The handler set here flushes and closes the handlers, then dies by SIGTERM as before (same exit
    status). A handler someone else installed is left alone. Call from the main thread."""
    if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
        return

    def flush_then_die(signum: int, frame: object) -> None:
        logging.shutdown()
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)

    signal.signal(signal.SIGTERM, flush_then_die)
