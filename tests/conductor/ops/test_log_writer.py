"""The batching log writer: a record is only appended where it is logged, lines come out in order
and whole, a WARNING is written without waiting for the interval, the pending records are bounded
(what is dropped is said), and nothing pending is lost at close."""

from __future__ import annotations

import io
import json
import logging
import threading

from conductor.ops.log_writer import BatchingHandler
from tests.support.waiting import wait_for

HOUR = 3600.0  # an interval no test waits out: every write below is caused by the test


class _Stream(io.StringIO):
    """Counts the writes, and tells when one happens."""

    def __init__(self) -> None:
        super().__init__()
        self.writes = 0
        self.written = threading.Event()

    def write(self, s: str) -> int:
        self.writes += 1
        n = super().write(s)
        self.written.set()
        return n


def _logger(handler: logging.Handler, name: str) -> logging.Logger:
    logger = logging.getLogger(name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger


def test_records_are_written_by_the_writer_in_one_batch_in_order() -> None:
    stream = _Stream()
    handler = BatchingHandler(stream, flush_interval_s=HOUR)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = _logger(handler, "test.batch.order")
    try:
        for i in range(100):
            log.info("%s", json.dumps({"i": i, "tag": "decision"}))
        assert stream.writes == 0  # logging only appended: no formatting, no write(2) in the caller
        handler.flush()
        assert stream.writes == 1
        lines = stream.getvalue().splitlines()
        assert [json.loads(line)["i"] for line in lines] == list(range(100))
    finally:
        handler.close()


def test_a_warning_is_written_without_waiting_for_the_interval() -> None:
    stream = _Stream()
    handler = BatchingHandler(stream, flush_interval_s=HOUR)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log = _logger(handler, "test.batch.warning")
    try:
        log.info("routine")
        log.warning("trouble")
        assert stream.written.wait(timeout=30)  # the writer thread woke for it, an hour early
        assert wait_for(lambda: "WARNING trouble" in stream.getvalue(), timeout=30)
        assert stream.getvalue().splitlines() == ["INFO routine", "WARNING trouble"]
    finally:
        handler.close()


def test_pending_records_are_bounded_and_the_loss_is_said() -> None:
    stream = _Stream()
    handler = BatchingHandler(stream, flush_interval_s=HOUR, max_pending=10)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = _logger(handler, "test.batch.bound")
    try:
        for i in range(25):
            log.info("line %d", i)
        assert handler.dropped_total == 15
        handler.flush()
        lines = stream.getvalue().splitlines()
        assert lines[:10] == [f"line {i}" for i in range(10)]
        assert lines[10] == "conductor: 15 log records dropped: the log stream did not keep up"
        log.info("after")
        handler.flush()
        assert stream.getvalue().splitlines()[-1] == "after"  # the count is said once
    finally:
        handler.close()


def test_close_writes_everything_pending() -> None:
    stream = _Stream()
    handler = BatchingHandler(stream, flush_interval_s=HOUR)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = _logger(handler, "test.batch.close")
    for i in range(5):
        log.info("line %d", i)
    handler.close()
    assert stream.getvalue().splitlines() == [f"line {i}" for i in range(5)]


def test_a_record_that_cannot_be_formatted_spares_the_others() -> None:
    stream = _Stream()
    handler = BatchingHandler(stream, flush_interval_s=HOUR)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = _logger(handler, "test.batch.bad")
    try:
        log.info("fine 1")
        log.info("%d", "not a number")
        log.info("fine 2")
        handler.flush()
        assert stream.getvalue().splitlines() == ["fine 1", "fine 2"]
    finally:
        handler.close()


def test_a_decision_line_is_built_by_the_writer_as_the_decision_log_defines_it() -> None:
    from conductor.core.decision_log import decision_log_record
    from conductor.core.types import CandidateScore, Decision, Role
    from conductor.ops.logs import log_decision

    stream = _Stream()
    handler = BatchingHandler(stream, flush_interval_s=HOUR)
    handler.setFormatter(logging.Formatter("%(name)s %(message)s"))
    log = _logger(handler, "test.batch.decisions")
    decision = Decision(
        request_id="r-1",
        prefill="p0",
        decode="d0",
        policy="kvcache_aware",
        predicted_ttft_s=0.25,
        candidates=(CandidateScore("p0", Role.PREFILL, 0.25, predicted_ttft_s=0.25),),
    )
    try:
        log_decision(log, decision, 512, "tiny", priority="batch", tenant="team-b")
        assert stream.writes == 0
        handler.flush()
        name, _, line = stream.getvalue().strip().partition(" ")
        assert name == "test.batch.decisions"
        assert json.loads(line) == decision_log_record(decision, 512, "tiny", priority="batch", tenant="team-b")
        log.setLevel(logging.WARNING)  # the decision log off: nothing is made
        log_decision(log, decision, 512, "tiny")
        assert not handler._pending
    finally:
        handler.close()
