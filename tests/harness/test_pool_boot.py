"""Pool boot: workers forked from the template (default) or spawned fresh, same behaviour."""

from __future__ import annotations

import os

import pytest

from meshsim.errors import RankFailure
from meshsim.harness import pool, run, shutdown

from .conftest import child_pids, process_alive


def _body() -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    return int(t.item()), os.getpid()


@pytest.mark.parametrize("mode", ["template", "spawn"])
def test_both_boot_modes_run_and_report_deaths(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    shutdown()
    monkeypatch.setattr(pool, "BOOT_MODE", mode)
    try:
        out = run(_body, 2, "gloo", timeout=120)
        assert [v[0] for v in out] == [2, 2]
        pids = {v[1] for v in out}
        # Forked workers are the template's children, not ours; spawned ones are ours.
        assert bool(pids & child_pids()) == (mode == "spawn")

        def dies() -> None:
            import torch.distributed as dist

            if dist.get_rank() == 1:
                os._exit(7)

        with pytest.raises(RankFailure) as info:
            run(dies, 2, "gloo", timeout=120)
        dead = info.value.outcomes[1]
        assert (dead.status, dead.exit_code) == ("died", 7)
    finally:
        shutdown()


def test_shutdown_ends_the_template() -> None:
    shutdown()
    run(_body, 2, "gloo", timeout=120)
    live = pool.get_pool()
    assert live.template is not None
    template = live.template.proc.pid
    assert template in pool.pool_pids()
    shutdown()
    assert not process_alive(template)
