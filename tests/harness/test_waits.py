"""The first line of a hang: who waits in which call for whom, and where that rank is (pure).

Each case is the recordings and stacks a stopped run leaves (what the threaded and gloo tiers
pass to the report), so the wording is pinned without spending a deadline; the tiers
themselves are run in ``test_first_line.py``.
"""

from __future__ import annotations

import os

from meshsim.harness import RankOutcome
from meshsim.harness.outcome import timeout_error
from meshsim.harness.p2p import PeerOp
from meshsim.harness.recorder import Call
from meshsim.harness.sites import as_traceback, format_site, stack_site
from meshsim.harness.waits import Waits

HERE = __file__


def _line(marker: str) -> int:
    """The line of this file that ends with ``# <marker>``."""
    with open(HERE) as f:
        for number, line in enumerate(f, 1):
            if line.rstrip().endswith(f"# {marker}"):
                return number
    raise AssertionError(marker)


def _user_code() -> None:  # never run: lines that recordings and stacks point at
    import time

    import torch
    import torch.distributed as dist

    dist.all_gather([torch.ones(1)] * 8, torch.ones(1))  # gather
    dist.all_reduce(torch.ones(1))  # reduce
    time.sleep(3600)  # sleep


def at(marker: str, *, source: bool = False) -> str:
    return format_site((HERE, _line(marker)), source=source)


def coll(op: str, group: tuple[int, ...] | None = None, marker: str = "reduce") -> Call:
    return Call("collective", op, group, site=(HERE, _line(marker)))


def p2p(op: str, peer: int) -> Call:
    sends = op.startswith("send")
    detail = f"{'to' if sends else 'from'} rank {peer}"
    return Call("p2p", op, None, detail, ops=(PeerOp(op, sends, peer, 0, (2,), "float32"),))


def thread_stack(marker: str) -> str:
    """A rank's stack as the threaded tier takes it (most recent call last)."""
    return f'  File "{HERE}", line {_line(marker)}, in _user_code\n    ...\n'


def process_stack(marker: str) -> str:
    """The same stack as a gloo worker's faulthandler writes it (most recent call first)."""
    torch_file = os.path.join(os.path.dirname(__import__("torch").__file__), "x.py")
    return (
        "Current thread 0x00007f86175cdb80 (most recent call first):\n"
        f'  File "{torch_file}", line 3 in wait\n'
        f'  File "{HERE}", line {_line(marker)} in _user_code\n'
    )


def stopped(rank: int, stack: str | None = None) -> RankOutcome:
    return RankOutcome(rank, status="timeout", stack=stack)


def finding(
    world: int,
    calls: dict[int, list[Call]],
    blocked: dict[int, Call | None],
    outcomes: list[RankOutcome],
) -> str:
    return Waits(world, calls, blocked, outcomes).finding()


def test_ranks_in_a_world_all_gather_wait_for_the_rank_outside_it() -> None:
    """The issue's simple variant: rank 5 sleeps, the others wait in the world's all_gather."""
    gather = coll("all_gather", marker="gather")
    calls = {r: ([] if r == 5 else [gather]) for r in range(8)}
    blocked = {r: (None if r == 5 else gather) for r in range(8)}
    outcomes = [stopped(r, thread_stack("sleep") if r == 5 else None) for r in range(8)]
    assert finding(8, calls, blocked, outcomes) == (
        f"ranks 0-4, 6, 7 wait in all_gather on the world at {at('gather')} for rank 5; "
        f"rank 5 is outside any collective at {at('sleep', source=True)}"
    )
    assert Waits(8, calls, blocked, outcomes).waits == {r: (5,) for r in range(8) if r != 5}


def test_both_stack_forms_name_the_same_line() -> None:
    """Threaded stacks list the most recent call last with source, faulthandler's first and
    without: the line named is the same, and the process stack is rewritten to read alike."""
    assert stack_site(thread_stack("sleep")) == stack_site(process_stack("sleep"))
    assert stack_site(process_stack("sleep")) == (HERE, _line("sleep"))
    rewritten = as_traceback(process_stack("sleep")).splitlines()
    assert rewritten[:2] == [
        f'  File "{HERE}", line {_line("sleep")}, in _user_code',
        "    time.sleep(3600)  # sleep",
    ]
    assert rewritten[2].endswith('x.py", line 3, in wait') and len(rewritten) == 3


def test_several_waiting_groups_are_sorted_and_the_culprit_said_once() -> None:
    evens, odds = (0, 2, 4, 5, 6), (1, 3, 5, 7)
    gather, reduce = coll("all_gather", evens, "gather"), coll("all_reduce", odds)
    calls = {r: [gather if r % 2 == 0 else reduce] for r in range(8) if r != 5}
    calls[5] = []
    blocked = {r: c[-1] if c else None for r, c in calls.items()}
    # Given in a shuffled order, as a process tier may collect them.
    outcomes = [stopped(r, process_stack("sleep") if r == 5 else None) for r in (7, 5, 0, 3)]
    outcomes += [stopped(r) for r in (6, 1, 4, 2)]
    assert finding(8, calls, dict(sorted(blocked.items(), reverse=True)), outcomes) == (
        f"ranks 0, 2, 4, 6 wait in all_gather on group (0,2,4,5,6) at {at('gather')} for "
        f"rank 5; ranks 1, 3, 7 wait in all_reduce on group (1,3,5,7) at {at('reduce')} for "
        f"rank 5; rank 5 is outside any collective at {at('sleep', source=True)}"
    )


def test_the_awaited_rank_in_another_collective_is_named_with_its_own_wait() -> None:
    """Ranks 0, 1 wait in the world's all_reduce for 2 and 3; rank 2 waits in a pair's
    all_gather for rank 3, which sleeps: the chain down to the rank that holds everyone."""
    world, pair = coll("all_reduce"), coll("all_gather", (2, 3), "gather")
    calls: dict[int, list[Call]] = {0: [world], 1: [world], 2: [pair], 3: []}
    blocked = {0: world, 1: world, 2: pair, 3: None}
    outcomes = [stopped(r, thread_stack("sleep") if r == 3 else None) for r in range(4)]
    assert finding(4, calls, blocked, outcomes) == (
        f"ranks 0, 1 wait in all_reduce on the world at {at('reduce')} for ranks 2, 3; "
        f"rank 2 waits in all_gather on group (2,3) at {at('gather')} for rank 3; "
        f"rank 3 is outside any collective at {at('sleep', source=True)}"
    )


def test_a_mismatch_at_one_position_is_a_cycle() -> None:
    reduce, barrier = coll("all_reduce"), coll("barrier", marker="gather")
    calls = {0: [reduce], 1: [reduce], 2: [barrier]}
    blocked = {r: c[-1] for r, c in calls.items()}
    assert finding(3, calls, blocked, [stopped(r) for r in range(3)]) == (
        f"ranks 0, 1 wait in all_reduce on the world at {at('reduce')} for rank 2; "
        f"rank 2 waits in barrier on the world at {at('gather')} for ranks 0, 1; "
        "each waits for another: a cycle no rank can leave"
    )


def test_waiting_for_a_rank_that_returned_raised_or_died() -> None:
    reduce = coll("all_reduce")
    calls = {0: [reduce, reduce], 1: [reduce], 2: [reduce], 3: [reduce]}
    blocked = {0: reduce}
    outcomes = [
        stopped(0),
        RankOutcome(1, value=None),
        RankOutcome(2, status="error", error_type="KeyError", error_message="'x'\nmore"),
        RankOutcome(3, status="died", signal_name="SIGKILL"),
    ]
    assert finding(4, calls, blocked, outcomes) == (
        f"rank 0 waits in all_reduce on the world at {at('reduce')} for ranks 1-3; "
        "rank 1 already returned; rank 2 raised KeyError: 'x'; rank 3 died: killed by SIGKILL"
    )


def test_a_receive_waits_for_its_peer_in_a_cycle() -> None:
    calls = {0: [p2p("recv", 1)], 1: [p2p("recv", 0)]}
    blocked = {r: c[-1] for r, c in calls.items()}
    assert finding(2, calls, blocked, [stopped(0), stopped(1)]) == (
        "rank 0 waits in recv from rank 1 on the world for rank 1; "
        "rank 1 waits in recv from rank 0 on the world for rank 0; "
        "each waits for another: a cycle no rank can leave"
    )


def test_when_nobody_waits_the_line_says_so_and_where_ranks_are() -> None:
    outcomes = [stopped(0, thread_stack("sleep")), stopped(1, process_stack("sleep")), stopped(2)]
    assert finding(3, {}, {0: None, 1: None, 2: None}, outcomes) == (
        "no rank waits in a recorded collective or send/recv for another; "
        f"ranks 0, 1 are outside any collective at {at('sleep', source=True)}; "
        "rank 2 is outside any collective (where is unknown)"
    )


def test_a_rank_running_threads_of_its_own_is_not_guessed_at() -> None:
    """A process rank whose body called from threads of its own: its recording cannot say
    which call it waits in, so it is neither a waiter nor 'outside any collective'."""
    reduce = coll("all_reduce")
    calls = {0: [reduce], 1: [coll("all_gather", marker="gather")]}
    outcomes = [stopped(0), stopped(1, process_stack("gather"))]
    waits = Waits(2, calls, {0: reduce, 1: None}, outcomes, unfollowed=[1])
    assert waits.finding() == (
        f"rank 0 waits in all_reduce on the world at {at('reduce')} for rank 1; rank 1 runs "
        f"threads of its own (which call it waits in is unknown) at {at('gather', source=True)}"
    )


def test_the_timeout_leads_with_the_finding_and_keeps_the_summary() -> None:
    def body() -> None: ...

    gather = coll("all_gather", marker="gather")
    outcomes = [
        RankOutcome(0, status="timeout", collective="all_gather on the world (call #1)"),
        stopped(1, thread_stack("sleep")),
    ]
    summary = (
        f"meshsim.run({body.__qualname__}, world_size=2, backend='threaded') timed out after "
        "5 s; ranks 0, 1 still running, all ranks stopped"
    )
    info = {"fn": body, "backend": "threaded", "world_size": 2, "timeout": 5.0}
    waits = Waits(2, {0: [gather], 1: []}, {0: gather, 1: None}, outcomes)
    err = timeout_error(outcomes, waits=waits, **info)
    lines = str(err).splitlines()
    assert err.finding and lines[0] == f"{err.finding}; {summary}"  # type: ignore[attr-defined]
    assert err.waits == {0: (1,)}  # type: ignore[attr-defined]
    assert lines[1] == f"rank 0: blocked in all_gather on the world (call #1) at {at('gather')}"
    assert lines[2] == f"rank 1: not in a collective at {at('sleep', source=True)}"
    old = timeout_error(outcomes, **info)  # no recordings given: the summary alone, as before
    assert str(old).splitlines()[0] == summary and old.finding is None  # type: ignore[attr-defined]


def test_a_report_that_cannot_be_worked_out_keeps_the_timeout() -> None:
    class Broken(Waits):
        def finding(self) -> str:
            raise KeyError("no such rank")

    def body() -> None: ...

    info = {"fn": body, "backend": "gloo", "world_size": 1, "timeout": 5.0}
    err = timeout_error([stopped(0)], waits=Broken(1, {}, {0: None}, [stopped(0)]), **info)
    assert str(err).startswith(
        "who waits for whom could not be worked out (KeyError: 'no such rank'); meshsim.run("
    )
