"""The exits a fork server reports (torchps/forkserver.py's _Exits), kept per child: the kernel gives an exited
child's pid to a later one, and the later child must not read as exited with the earlier one's code. The
messages come in the fork server's order (an exit is reported when it reaps the child, before the pid can be
given again). No processes."""

import threading

from torchps.forkserver import _Exits


def test_a_child_given_an_exited_childs_pid_runs_until_its_own_exit_is_reported():
    exits = _Exits()
    first = exits.born(4242)
    exits.record(4242, 0)           # the first child exits, and is reaped
    second = exits.born(4242)       # a later child gets its pid
    assert (first, second) == (1, 2)
    assert exits.code(4242, first) == 0 and exits.reported(4242, first)
    assert exits.code(4242, second) is None and not exits.reported(4242, second)
    assert exits.wait(4242, second, 0.01) is None
    exits.record(4242, -9)
    assert exits.code(4242, second) == -9 and exits.code(4242, first) == 0


def test_a_wait_for_a_later_child_wakes_on_its_exit_not_on_an_earlier_ones():
    exits = _Exits()
    exits.born(7)
    exits.record(7, 3)
    later = exits.born(7)
    got = []
    waiter = threading.Thread(target=lambda: got.append(exits.wait(7, later, 30)))
    waiter.start()
    exits.record(7, 5)
    waiter.join(30)
    assert got == [5]


def test_once_the_fork_server_is_gone_an_earlier_child_whose_pid_was_given_again_reads_as_killed():
    exits = _Exits()
    earlier = exits.born(11)
    exits.born(11)  # its exit was never reported (the server died), yet its pid went to a later child
    exits.server_gone()
    assert exits.code(11, earlier) == -9
