"""Which blocked ranks are deadlocked, and what cut-short recordings prove (pure, no torch).

These are the rules that let every tier report a broken program as the same divergence
whether the run hung, crashed or returned; each case states the schedule it stands for.
"""

from __future__ import annotations

from meshsim.harness.deadlock import deadlocked
from meshsim.harness.live import judge
from meshsim.harness.outcome import RankOutcome
from meshsim.harness.p2p import PeerOp
from meshsim.harness.recorder import Call


def coll(op: str, group: tuple[int, ...] | None = None) -> Call:
    return Call("collective", op, group)


def p2p(op: str, peer: int) -> Call:
    sends = op.startswith(("send", "isend"))
    return Call("p2p", op, None, ops=(PeerOp(op, sends, peer, 0, (2,), "float32"),))


def blocked_in_last(calls: dict[int, list[Call]], ranks: list[int]) -> dict[int, Call | None]:
    return {r: calls[r][-1] for r in ranks}


def test_ranks_all_inside_the_same_collective_will_leave_it() -> None:
    calls = {r: [coll("all_reduce")] for r in range(4)}
    assert deadlocked(4, calls, blocked_in_last(calls, [0, 1, 2, 3])) == set()


def test_a_rank_still_computing_may_release_the_waiting_ones() -> None:
    calls = {0: [coll("all_reduce")], 1: [coll("all_reduce")], 2: []}
    assert deadlocked(3, calls, {0: calls[0][-1], 1: calls[1][-1], 2: None}) == set()


def test_mismatched_collectives_at_one_position_deadlock_everyone() -> None:
    calls = {0: [coll("all_reduce")], 1: [coll("barrier")], 2: [coll("barrier")]}
    assert deadlocked(3, calls, blocked_in_last(calls, [0, 1, 2])) == {0, 1, 2}


def test_waiting_for_ranks_whose_own_call_completes_is_not_a_deadlock() -> None:
    """Ranks 0 and 1 finish their pair all_reduce and then join the world barrier that ranks
    2 and 3 already wait in: nobody is stuck, although 2 and 3 wait for 0 and 1."""
    calls = {
        0: [coll("all_reduce", (0, 1))],
        1: [coll("all_reduce", (0, 1))],
        2: [coll("barrier")],
        3: [coll("barrier")],
    }
    assert deadlocked(4, calls, blocked_in_last(calls, [0, 1, 2, 3])) == set()


def test_waiting_for_a_rank_that_returned_is_a_deadlock() -> None:
    calls = {0: [coll("all_reduce"), coll("all_reduce")], 1: [coll("all_reduce")]}
    assert deadlocked(2, calls, {0: calls[0][-1]}) == {0}


def test_a_receive_deadlocks_only_when_its_peer_cannot_send_any_more() -> None:
    sent = {0: [p2p("send", 1)], 1: [p2p("recv", 0)]}
    assert deadlocked(2, sent, {1: sent[1][-1]}) == set()  # the message is there
    waiting = {0: [p2p("send", 2)], 1: [p2p("recv", 0)], 2: []}
    assert deadlocked(3, waiting, {1: waiting[1][-1]}) == {1}  # rank 0 returned
    assert deadlocked(3, waiting, {0: None, 1: waiting[1][-1]}) == set()  # 0 may still send


def _outcomes(statuses: dict[int, str]) -> list[RankOutcome]:
    return [RankOutcome(r, status=s) for r, s in sorted(statuses.items())]


def test_a_rank_that_raised_proves_nothing_by_what_it_did_not_call() -> None:
    """Rank 0 raised before its all_reduce; the others wait in theirs. That is a failure,
    not a divergence: rank 0 might have called it."""
    calls = {0: [], 1: [coll("all_reduce")], 2: [coll("all_reduce")]}
    outcomes = _outcomes({0: "error", 1: "aborted", 2: "aborted"})
    assert judge(3, calls, outcomes, blocked_in_last(calls, [1, 2])) is None


def test_what_a_cut_short_rank_did_call_is_evidence() -> None:
    calls = {0: [coll("broadcast")], 1: [coll("all_reduce")], 2: [coll("all_reduce")]}
    outcomes = _outcomes({0: "error", 1: "aborted", 2: "aborted"})
    found = judge(3, calls, outcomes, {})
    assert found is not None and set(found.ranks) == {0, 1} and found.index == 0


def test_a_deadlocked_rank_s_missing_call_is_evidence() -> None:
    """Rank 1 waits for good in a barrier; rank 0 waits in an all_reduce on a group of both.
    Each lacks the other's call, and neither can move: the report names the group."""
    calls = {0: [coll("all_reduce", (0, 1))], 1: [coll("barrier")]}
    outcomes = _outcomes({0: "aborted", 1: "aborted"})
    found = judge(2, calls, outcomes, blocked_in_last(calls, [0, 1]))
    assert found is not None and found.group in ((0, 1), None)
    assert "rank 1 called barrier on the world at step 0 instead" in str(found)


def test_a_rank_that_raised_may_have_released_its_waiting_peers() -> None:
    """Rank 0 raised; rank 1 waits in (0,1), rank 2 in the world: for the final set rank 0
    might have moved, so neither is final; for a standstill nobody can move."""
    calls = {0: [], 1: [coll("all_reduce", (0, 1))], 2: [coll("all_reduce")]}
    blocked = blocked_in_last(calls, [1, 2])
    assert deadlocked(3, calls, blocked, returned=()) == set()
    assert deadlocked(3, calls, blocked) == {1, 2}


def test_async_and_rooted_calls_and_buffered_sends_count_as_moving() -> None:
    asynchronous = Call("collective", "all_reduce", None, async_op=True)
    calls = {0: [asynchronous], 1: [coll("barrier", (0, 1))]}
    assert deadlocked(2, calls, blocked_in_last(calls, [0, 1]), returned=()) == set()
    calls = {0: [coll("broadcast")], 1: [coll("all_reduce")]}
    assert 0 not in deadlocked(2, calls, blocked_in_last(calls, [0, 1]), returned=())
    calls = {0: [p2p("send", 1)], 1: [coll("barrier", (0, 1))]}
    assert deadlocked(2, calls, blocked_in_last(calls, [0, 1]), returned=()) == set()
    calls = {0: [p2p("send", 1)], 1: []}
    assert deadlocked(2, calls, {0: calls[0][-1]}, returned=(1,)) == {0}  # 1 never takes it
