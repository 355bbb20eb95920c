"""The real-time driver of a MoE data-parallel group (``serve -dp N`` of a MoE model, all ranks in one process).

vLLM steps such ranks together: their MoE layers form one (expert-parallel) group, so while any rank has work every
rank runs a forward pass (an idle one a dummy batch, woken by the DP coordinator), and each pass ends when the
slowest rank's work and the dispatch/combine all-to-all end. The model of that is fast-forward's own
(:class:`kernelsight.simcore.dp_group.DPGroup`); this driver runs it against wall time. One asyncio task, one
virtual clock for the group: each loop turn steps the group once, waits for the common step end's wall deadline, and
releases every rank's tokens then.

Each rank keeps its own :class:`~kernelsight.server.engine.bridge.EngineBridge` (queue and KV cache, handlers, /metrics
``engine`` label, KV-event publisher, P/D agent): the front end still picks a bridge per request and submits to it,
and the bridge renders and books its rank's share of each step exactly as when it drives its engine itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence

from kernelsight.server.engine.bridge import EngineBridge, Submission
from kernelsight.server.engine.turns import turn_gate
from kernelsight.server.gc_policy import collect_in_slack, collect_when_idle, gc_owner
from kernelsight.simcore.dp_group import DPGroup

log = logging.getLogger("kernelsight.server")


class LockstepDriver:
    """Steps ``group``'s ranks in lockstep on one clock; ``bridges[i]`` serves ``group.engines[i]``."""

    def __init__(self, group: DPGroup, bridges: Sequence[EngineBridge]) -> None:
        if group.moe is None:
            raise ValueError("a lockstep driver needs a MoE data-parallel group")
        if [b.engine for b in bridges] != group.engines:
            raise ValueError("the bridges must serve the group's engines, in rank order")
        self.group = group
        self.bridges = list(bridges)
        for b in self.bridges:
            b.driver = self
        self._task: asyncio.Task | None = None
        self._wake: asyncio.Event | None = None

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._task is not None:
            return
        self._wake = asyncio.Event()
        lead = self.bridges[0]
        wall0 = time.perf_counter() - self.group.now_s / lead.time_scale
        for b in self.bridges:
            b.join_loop(wall0, self._wake)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kernelsight-lockstep")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    @property
    def is_running(self) -> bool:
        return self._task is not None and not self._task.done()

    def set_step_time_factor(self, factor: float) -> None:
        """The "slow" fault: every group step from now on lasts ``factor`` times its simulated time."""
        self.group.step_time_factor = factor

    # -- the loop -------------------------------------------------------------------------------
    def _has_unfinished(self) -> bool:
        return any(e.has_unfinished() for e in self.group.engines)

    def _next_release_s(self) -> float | None:
        """P/D: when held blocks of some rank are due to be freed next."""
        due = [t for t in (e.next_release_s() for e in self.group.engines if e.num_held) if t is not None]
        return min(due, default=None)

    def _free_expired(self) -> None:
        group = self.group
        group.idle_until(self.bridges[0].virtual_now())
        for e in group.engines:
            e.free_expired()

    async def _run(self) -> None:
        group = self.group
        bridges = self.bridges
        lead = bridges[0]                 # the group's clock (every bridge shares its wall origin) and pacing
        wake = self._wake
        assert wake is not None
        while True:
            if not self._has_unfinished():
                wake.clear()
                for b in bridges:
                    b.refresh_gauges()
                if gc_owner():
                    collect_when_idle()
                due = self._next_release_s()
                if due is None:
                    await wake.wait()
                elif not await lead._wait_wake(due):
                    self._free_expired()
                    for b in bridges:
                        b.refresh_gauges()
                continue
            await lead._read_window(True)
            await turn_gate().wait(first=True)
            try:
                t_busy = time.perf_counter()
                # the group's clock never runs ahead of wall time: an arrival still to come (a P/D pull's end) is
                # waited for, not jumped to
                step = group.step(until_s=lead.virtual_now())
            except Exception:  # noqa: BLE001 - keep serving; the failing requests are aborted
                log.exception("engine step failed; aborting in-flight requests")
                for b in bridges:
                    b.abort_all()
                continue
            if step is None:
                nxt = group.next_event_s()
                wake.clear()
                if nxt is None:                       # only pulls waiting for blocks that held ones keep
                    await lead._wait_wake(self._next_release_s())
                    self._free_expired()
                else:
                    await lead._wait_wake(nxt)
                continue
            for b in bridges:
                if b.kv_agent is not None:
                    b.kv_agent.announce_pulls()
            await asyncio.sleep(0)
            # fast-path streams of every rank render their chunk while the simulated GPUs "run" the step
            ready: list[tuple[EngineBridge, list[Submission]]] = []
            for rank, res in step:
                b = bridges[rank]
                subs = await b._prepare(res)
                if subs:
                    ready.append((b, subs))
            res0 = step[0][1]
            deadline = lead.wall_of(res0.end_s)         # every rank's step ends then
            lead._busy_s = 0.8 * lead._busy_s + 0.2 * (time.perf_counter() - t_busy)
            lead._step_walls_s.append((res0.end_s - res0.start_s) / lead.time_scale)
            if gc_owner():
                collect_in_slack(deadline - time.perf_counter())
            late_s, now = await lead.wait_deadline(deadline)
            for rank, _ in step:
                bridges[rank].observe_release(late_s, now)
            for b, subs in ready:
                b._flush(subs)        # first: the writes are what clients time
            if ready:
                await asyncio.sleep(0)
            for rank, res in step:
                await bridges[rank]._dispatch(res)
            await asyncio.sleep(0)
            await asyncio.sleep(0)


__all__ = ["LockstepDriver"]
