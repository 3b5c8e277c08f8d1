"""What ps-launch makes of a dead process (worker/lastlines.py, worker/restarts.py): the lines of its log it shows,
the signal that killed it, how long a restart waits, and a death for want of room that no restart can mend."""

import resource

import pytest

from torchps.worker.lastlines import FINAL_LINES, TRACEBACK_LINES, LastLines, death
from torchps.worker.restarts import BACKOFF_MAX_SECONDS, backoff, no_room


def info(n: int) -> str:
    return f"2026-11-29 12:28:00,{n:03d} INFO torchps.ps_server: line {n}"


WARNING = "2026-11-29 12:28:01,000 WARNING torchps.ps_server.journal: journal /x/log-000000.bin: 17 bytes cut off"
TRACEBACK = ["Traceback (most recent call last):", '  File "/w/trainer.py", line 72, in step_once',
             "    loss = task.loss(logits, yb)", "RuntimeError: injected failure"]
FAILSTOP = ("2026-11-29 12:28:00,979 CRITICAL torchps.ps_server.failstop: ps 0 stops (fail-stop, exit code 70): journal "
            "{path}/journal/ps-0/log-000000.bin: a write failed: No space left on device; restart it: its journal "
            "brings back everything it acknowledged")


def shown(lines: list[str]) -> list[str]:
    kept = LastLines()
    for line in lines:
        kept.append(line)
    return kept.shown()


def test_a_short_log_is_shown_whole():
    assert shown([info(1), info(2)]) == [info(1), info(2)]


def test_the_warnings_and_the_last_traceback_are_shown_before_the_final_lines_whatever_came_after():
    log = [info(n) for n in range(30)] + [WARNING] + [info(n) for n in range(30, 40)] + TRACEBACK
    log += [info(n) for n in range(40, 60)]
    assert shown(log) == ["[... 30 lines ...]", WARNING, "[... 10 lines ...]", *TRACEBACK, "[... 15 lines ...]",
                          *[info(n) for n in range(60 - FINAL_LINES, 60)]]


def test_a_long_traceback_keeps_its_first_line_and_its_end():
    frames = [f'  File "/w/deep.py", line {n}, in f' for n in range(100)]
    lines = shown([*TRACEBACK[:1], *frames, TRACEBACK[-1]])
    assert lines == [TRACEBACK[0], f"[... {100 - TRACEBACK_LINES + 2} lines ...]",
                     *frames[-(TRACEBACK_LINES - 2):], TRACEBACK[-1]]


def test_a_usage_error_is_an_error_line():
    error = "ps-server: error: --restore-from /x: no committed checkpoint there"
    assert shown([error, *[info(n) for n in range(20)]])[:2] == [error, "[... 15 lines ...]"]


def test_a_signal_is_named():
    assert (death(-9), death(-15), death(1), death(0), death(None)) == ("killed by SIGKILL", "killed by SIGTERM",
                                                                          "", "", "")


def test_restarts_wait_doubling_from_one_second_up_to_a_cap():
    assert [backoff(n) for n in range(1, 8)] == [1, 2, 4, 8, 16, BACKOFF_MAX_SECONDS, BACKOFF_MAX_SECONDS]


def test_a_full_disk_is_named_with_the_path_and_its_free_bytes(tmp_path):
    room = no_room([info(1), FAILSTOP.format(path=tmp_path)], tmp_path / "elsewhere")
    cause = f"the disk is full ({tmp_path}/journal/ps-0/log-000000.bin: "
    assert room.cause.startswith(cause) and room.cause.endswith(" bytes free)") and room.wall == "full disk", room
    assert int(room.cause[len(cause):-len(" bytes free)")].replace(",", "")) >= 0


def test_a_traceback_without_a_path_names_where_the_process_writes(tmp_path):
    room = no_room([*TRACEBACK[:-1], "OSError: [Errno 28] No space left on device"], tmp_path)
    assert room.cause.startswith(f"the disk is full ({tmp_path}: "), room


def test_a_file_size_limit_is_named_as_such(tmp_path):
    room = no_room([f"OSError: [Errno 27] File too large: '{tmp_path}/big'"], tmp_path)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    assert room.cause.startswith(f"{tmp_path}/big could grow no further (File too large: ") and room.wall == "limit"
    assert (limit == resource.RLIM_INFINITY) == ("filesystem's largest file" in room.cause), room


@pytest.mark.parametrize("line", [info(1), WARNING, "OSError: [Errno 5] Input/output error", *TRACEBACK])
def test_other_deaths_are_not_for_want_of_room(line, tmp_path):
    assert no_room([line], tmp_path) is None
