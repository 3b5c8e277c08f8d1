"""ShardChannels.relocate against another thread's move: an answer that was asked for before another thread
moved the shard (a failover it found first) never moves the client back. No server: the answers are given
in place of the shard's GetLayout (ShardChannels._served_by), as a slow arbiter's would come."""

from torchps.client.channels import ShardChannels

OLD, NEW = "127.0.0.1:2", "127.0.0.1:3"


def _channels(answer):
    """Channels to ps 0 and ps 1 (at OLD) whose every ask is answered by answer(channels, asked)."""
    channels = ShardChannels(["127.0.0.1:1", OLD], connect_timeout=1)
    channels._served_by = lambda asked, request, limit: answer(channels, asked)
    return channels


def test_an_arbiters_answer_older_than_another_threads_move_does_not_move_the_shard_back():
    """While this thread asks ps 0 (ps:1's arbiter), another moves ps:1 to NEW; ps 0's answer was made before
    the promotion and still names OLD, where this thread called it: not promoted, as far as that answer goes.
    Before, it was compared with NEW, and the client went back to the dead OLD (seen in a fresh-clone run: 3
    moves where 1 was due)."""
    def answer(channels, asked):
        channels.redirect(1, NEW)  # the other thread's move, while this ask is under way
        return {1: OLD}
    channels = _channels(answer)
    try:
        assert not channels.relocate(1)
        assert channels.addresses[1] == NEW and channels.relocated == 0
    finally:
        channels.close()


def test_news_of_a_move_is_taken_once_however_many_threads_bring_it():
    """Two relocations that both learnt ps:1 moved from OLD to NEW: the first moves it, the second finds it
    there (not counted, not logged twice); news naming an address the client no longer calls is dropped."""
    channels = _channels(lambda channels, asked: {1: NEW})
    try:
        assert channels.relocate(1) is True
        assert channels.relocate(1) is False  # the arbiter names where the client calls now
        assert channels.relocated == 1 and channels.addresses[1] == NEW
        assert not channels.redirect(1, "127.0.0.1:4", instead_of=OLD)  # older news: OLD is not called any more
        assert channels.addresses[1] == NEW
        assert channels.redirect(1, "127.0.0.1:4", instead_of=NEW)
        assert channels.addresses[1] == "127.0.0.1:4"
    finally:
        channels.close()
