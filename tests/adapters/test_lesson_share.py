"""adapters/lesson_share.py over real Unix datagram sockets: lessons published by one worker are
learned by its sibling, in batches; what is not a lesson is refused and counted; a sibling that is
not there costs a count, never an error; the sockets are this user's only and go at close."""

from __future__ import annotations

import asyncio
import socket
import stat
from pathlib import Path

import msgspec
import pytest

from adapters.lesson_share import MAX_LESSONS, UnixLessonShare, slot_path
from predictors.lessons import checked


class Pupil:
    """A learn callback that checks each lesson as Predictors.learn does and keeps it."""

    def __init__(self) -> None:
        self.learned: list[tuple[object, ...]] = []

    def __call__(self, raw: object) -> None:
        self.learned.append(checked(raw))


async def _until(cond: object, limit_s: float = 10.0) -> bool:
    for _ in range(int(limit_s / 0.01)):
        if cond():  # type: ignore[operator]
            return True
        await asyncio.sleep(0.01)
    return bool(cond())  # type: ignore[operator]


async def test_a_siblings_lessons_arrive_in_order_and_in_batches(tmp_path: Path) -> None:
    a, b = UnixLessonShare(tmp_path, 0, 2, flush_s=0.001), UnixLessonShare(tmp_path, 1, 2)
    pupil_a, pupil_b = Pupil(), Pupil()
    a.start(pupil_a)
    b.start(pupil_b)
    try:
        lessons = [("tbt", 4, 1000 + i, 0.02) for i in range(MAX_LESSONS * 2 + 7)]  # three datagrams
        a.publish(lessons[:10])
        a.publish(lessons[10:])  # gathered with the first ten until the flush
        assert await _until(lambda: len(pupil_b.learned) == len(lessons))
        assert pupil_b.learned == [(k, x, y, float(z)) for k, x, y, z in lessons]
        assert a.counts["sent"] == len(lessons) and b.counts["received"] == len(lessons)
        assert not pupil_a.learned  # nothing comes back to the sender
    finally:
        a.close()
        b.close()


async def test_what_is_not_a_lesson_is_refused_and_the_rest_learned(tmp_path: Path) -> None:
    b = UnixLessonShare(tmp_path, 1, 2)
    pupil = Pupil()
    b.start(pupil)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as rogue:
            rogue.sendto(b"\xc1 not msgpack", str(slot_path(tmp_path, 1)))
            rogue.sendto(b"\x93\x01\x02\x03", str(slot_path(tmp_path, 1)))  # msgpack, not a list of lists
            rogue.sendto(
                msgspec.msgpack.encode(
                    [["tbt", 4, 100, float("nan")], ["transfer", "instance", 1e6, 0.01], ["nope", 1], ["tbt", 2, 10, 0.01]]
                ),
                str(slot_path(tmp_path, 1)),
            )
        assert await _until(lambda: b.counts["received"] == 2)
        assert pupil.learned == [("transfer", "instance", 1e6, 0.01), ("tbt", 2, 10, 0.01)]
        assert b.counts["refused"] == 4  # two datagrams, two lessons
    finally:
        b.close()


async def test_a_sibling_not_there_is_counted_not_raised(tmp_path: Path) -> None:
    a = UnixLessonShare(tmp_path, 0, 3)  # siblings 1 and 2 never started
    a.start(Pupil())
    try:
        a.publish([("tbt", 4, 100, 0.02)] * 3)
        a.flush()
        assert a.counts["dropped"] == 6 and a.counts["sent"] == 0
    finally:
        a.close()


async def test_the_socket_is_this_users_only_and_goes_at_close(tmp_path: Path) -> None:
    a = UnixLessonShare(tmp_path, 0, 2)
    path = slot_path(tmp_path, 0)
    path.write_bytes(b"")  # left by a previous process of this slot that died
    a.start(Pupil())
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_ISSOCK(path.stat().st_mode)
    a.close()
    assert not path.exists()


async def test_a_slot_that_cannot_bind_raises_at_start(tmp_path: Path) -> None:
    missing = tmp_path / "gone"
    with pytest.raises(OSError):
        UnixLessonShare(missing, 0, 2).start(Pupil())
