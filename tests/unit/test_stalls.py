"""StallWatch (ps_server/stalls.py): a stream that sends nothing for its idle limit is ended; one that ended is
never. Threads, no sockets."""

from __future__ import annotations

import threading

from torchps.ps_server.failstop import FailStop
from torchps.ps_server.stalls import StallWatch

TIMEOUT = 10.0


def test_a_silent_stream_is_ended_and_a_finished_one_is_not():
    watch = StallWatch(0.05, FailStop(exit=lambda code: None))
    ended: list[str] = []
    silent_ended = threading.Event()
    with watch.watching(lambda idle: ended.append("finished")) as touch:
        touch()  # a stream that got its messages and ended
    with watch.watching(lambda idle: (ended.append(f"silent after {idle:g} s"), silent_ended.set())):
        assert silent_ended.wait(TIMEOUT)
    assert ended == ["silent after 0.05 s"] and watch.stalled == 1
