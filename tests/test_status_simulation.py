"""What `status` says of a region equals what the region decided, within one resync (issue 27).

A stateful simulation of one region ("eu") with two replicas under leader election, against the
fake API server over real HTTP: the real Publisher status path (its queue, `lead`, `resync_now`,
`write_reports`), the real sinks of both modes as `app.status_sink` wires them, and the real
reading code of `ome-publisher status` (`fleet.read_fleet`). The rules change verdicts, write (or
not: a leader may die before it writes), change the leader, delete or edit the region's reports by
hand or by `--forget-region`, delete and recreate maps (a new uid), and switch the region's mode.
After each resync, every map's verdict as `status` reads it must be the region's own decision (no
verdict where it decided nothing about the map of that uid).

Replicas refresh their watch cache from the server before each write (the watch is assumed to
have caught up); time is a counter, so the backoff of a failed write is skipped deterministically.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from adapters import ADAPTERS
from adapters.json import JsonOptions
from publisher.cli import app
from publisher.status import fleet
from publisher import status
from publisher.kube import Kube
from publisher.loop import LoopOptions, Publisher
from publisher.core.model import parse_traffic_map
from publisher.core.values import MapKey, Reason
from publisher.source.store import Stores
from tests.builders import make_map
from tests.fakes.kube_api import FakeKubeAPI, write_kubeconfig

TM = "ome.io/v1beta1/trafficmaps"
RR = "gateway-publisher.ome.io/v1alpha1/regionreports"
REGION = "eu"
NAMESPACE = "prod"
NAMES = ("chat", "embed")
REPLICAS = ("replica-a", "replica-b")
VERDICTS = (
    (True, Reason.PUBLISHED, "served"),
    (False, Reason.ROUTABLE_OUTDATED, "waiting for Routable"),
)
# Fixed examples in CI (a few seconds); OME_SIMULATION_EXAMPLES=2000 explores at random for longer.
EXAMPLES = int(os.environ.get("OME_SIMULATION_EXAMPLES", "60"))


class Replica:
    """One replica of the region: its watch cache, its Publisher and its sink."""

    def __init__(self, kube: Kube, mode: str, out: Path, clock: list[float]) -> None:
        self.stores = Stores.empty()
        sink = app.status_sink(mode, kube, self.stores, REGION, ())
        adapter = ADAPTERS["json"].engine("json", JsonOptions(json_path=out))
        self.publisher = Publisher(self.stores, adapter, LoopOptions(region=REGION, status_delay=0.0, resync=3600),
                                   status_sink=sink, clock=lambda: clock[0])
        self.publisher.outbox.follow()


class StatusSimulation(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = asyncio.new_event_loop()
        self.tmp = tempfile.TemporaryDirectory()
        self.api = FakeKubeAPI()
        self.run(self.api.start())
        self.kube = self.run(Kube.connect(write_kubeconfig(Path(self.tmp.name) / "kubeconfig", self.api.url)))
        self.clock = [0.0]
        self.mode = "report"
        self.leader = REPLICAS[0]
        self.replicas = self._start_replicas()
        # What the region decided, by map name: (uid the verdict is about, the verdict); a map it
        # has not decided since it was (re)created has no entry.
        self.decided: dict[str, tuple[str, status.Verdict]] = {}
        # Whether a report was removed or edited behind the region since the last resync: until the
        # next one, only a new leader's first writes are checked, and only when this is False.
        self.tampered = False

    def run(self, coroutine: Any) -> Any:
        return self.loop.run_until_complete(coroutine)

    def teardown(self) -> None:
        self.run(self.kube.close())
        self.run(self.api.stop())
        self.loop.close()
        self.tmp.cleanup()

    def _start_replicas(self) -> dict[str, Replica]:
        replicas = {name: self._replica(name) for name in REPLICAS}
        replicas[self.leader].publisher.outbox.lead()
        return replicas

    def _replica(self, name: str) -> Replica:
        return Replica(self.kube, self.mode, Path(self.tmp.name) / f"{name}.json", self.clock)

    def _redecide(self, replicas: list[Replica]) -> None:
        """Replicas that just started decide every map the region decided."""
        self._watch()
        for name, (_, report) in sorted(self.decided.items()):
            for replica in replicas:
                replica.publisher.outbox.put(MapKey(NAMESPACE, name), report)

    # --- the world ---------------------------------------------------------------------------------

    def _uid(self, name: str) -> str | None:
        raw = self.api.get(TM, NAMESPACE, name)
        return raw["metadata"]["uid"] if raw is not None else None

    def _watch(self) -> None:
        """Every replica's watch cache catches up with the server."""
        objects = [(MapKey(NAMESPACE, raw["metadata"]["name"]), parse_traffic_map(raw), raw["metadata"]["resourceVersion"])
                   for raw in self.api.objects(TM, NAMESPACE)]
        for replica in self.replicas.values():
            replica.stores.maps.replace(objects)

    def _flush(self) -> None:
        """The leader writes what fell due; a failed write is retried (time jumps past its backoff)."""
        publisher = self.replicas[self.leader].publisher
        for _ in range(5):
            self._watch()
            self.clock[0] += 1000.0
            keys = publisher.outbox.due.take_ready()
            if not keys:
                return
            self.run(publisher.outbox.write(keys))

    @initialize()
    def published_everywhere(self) -> None:
        for name in NAMES:
            self.api.create(make_map(name, namespace=NAMESPACE, generation=1))
            self.decide(name, VERDICTS[0], write=True)

    @rule(name=st.sampled_from(NAMES), verdict=st.sampled_from(VERDICTS), write=st.booleans())
    def decide(self, name: str, verdict: tuple[bool, Reason, str], write: bool) -> None:
        """Every replica decides the map; the leader writes it now, or later (or dies first)."""
        raw = self.api.get(TM, NAMESPACE, name)
        if raw is None:
            return
        published, reason, message = verdict
        report = status.Verdict(published, reason, message, raw["metadata"]["generation"], raw["metadata"]["uid"])
        self.decided[name] = (raw["metadata"]["uid"], report)
        for replica in self.replicas.values():
            replica.publisher.outbox.put(MapKey(NAMESPACE, name), report)
        if write:
            self._flush()

    @rule(name=st.sampled_from(NAMES), recreate=st.booleans())
    def delete_map(self, name: str, recreate: bool) -> None:
        """OME deletes the map (and makes it again under the same name: a new uid, generation 1,
        not decided by the region yet; its watch may see only a changed map, as after a relist)."""
        if self._uid(name) is not None:
            self.api.delete(TM, NAMESPACE, name)
            self.decided.pop(name, None)
            if not recreate:
                # Every replica sees it go and forgets the map (the leader's sink drops its verdict).
                for replica in self.replicas.values():
                    replica.publisher.settler.forget(MapKey(NAMESPACE, name))
        if recreate:
            self.api.create(make_map(name, namespace=NAMESPACE, generation=1))

    @rule()
    def change_leader(self) -> None:
        """The leader dies or loses its Lease with its queue unwritten; the other replica leads and
        writes at once what differs from the server, resync or not."""
        self.replicas[self.leader].publisher.outbox.follow()
        self.leader = REPLICAS[1] if self.leader == REPLICAS[0] else REPLICAS[0]
        self.replicas[self.leader].publisher.outbox.lead()
        self._flush()
        if not self.tampered:
            self._check()

    @rule()
    def restart_the_follower(self) -> None:
        follower = REPLICAS[1] if self.leader == REPLICAS[0] else REPLICAS[0]
        self.replicas[follower] = self._replica(follower)
        self._redecide([self.replicas[follower]])

    @precondition(lambda self: bool(self.api.objects(RR)))
    @rule(data=st.data())
    def delete_a_report(self, data: st.DataObject) -> None:
        report = data.draw(st.sampled_from(self.api.objects(RR)))
        self.delete_a_report_by_name(report["metadata"]["name"])

    def delete_a_report_by_name(self, name: str) -> None:
        self.api.delete(RR, NAMESPACE, name)
        self.tampered = True

    @precondition(lambda self: any(report["maps"] for report in self.api.objects(RR)))
    @rule(data=st.data())
    def edit_a_report(self, data: st.DataObject) -> None:
        """Someone edits a verdict by hand (kubectl edit)."""
        report = data.draw(st.sampled_from([r for r in self.api.objects(RR) if r["maps"]]))
        name = data.draw(st.sampled_from(sorted(report["maps"])))
        report["maps"][name] = {**report["maps"][name], "status": "True", "reason": "Published", "observedGeneration": 99}
        self.api.update(report)
        self.tampered = True

    @rule()
    def forget_the_live_region(self) -> None:
        self.run(fleet.forget_region(self.kube, REGION))
        self.tampered = True

    @rule()
    def switch_mode(self) -> None:
        """The region is upgraded into the other mode: both replicas restart and decide every map again."""
        self.mode = "condition" if self.mode == "report" else "report"
        self.replicas = self._start_replicas()
        self._redecide(list(self.replicas.values()))

    @rule()
    def resync(self) -> None:
        """The leader's resync: every verdict compared with the server, what differs rewritten. Then
        `status` must say, of every map, what the region decided."""
        publisher = self.replicas[self.leader].publisher
        self._watch()
        publisher.resync_now()
        for name, (_, report) in sorted(self.decided.items()):  # the applier re-decides every map
            publisher.outbox.put(MapKey(NAMESPACE, name), report)
        self._flush()
        self.tampered = False
        self._check()

    def _check(self) -> None:
        """What `status` says of each map is what the region decided about the map of that uid."""
        view, unread = self.run(fleet.read_fleet(self.kube))
        assert unread is None
        said = {item.key.name: item.verdicts.get(REGION) for item in view}
        for name in NAMES:
            uid = self._uid(name)
            if uid is None:
                continue
            decided = self.decided.get(name)
            expected = None
            if decided is not None and decided[0] == uid:
                report = decided[1]
                expected = ("True" if report.published else "False", str(report.reason), report.message, report.generation)
            verdict = said.get(name)
            seen = None if verdict is None else (verdict.status, verdict.reason, verdict.message, verdict.observed_generation)
            assert seen == expected, f"{name}: status says {seen} ({verdict.mode if verdict else '-'}), the region decided {expected}"


StatusSimulation.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=25, deadline=None)
test_status_simulation = StatusSimulation.TestCase


def run_steps(*steps: tuple[str, dict[str, Any]]) -> None:
    """One fixed run of the simulation: the shortest story of a finding, kept as its regression test."""
    machine = StatusSimulation()
    try:
        machine.published_everywhere()
        for step, arguments in steps:
            getattr(machine, step)(**arguments)
    finally:
        machine.teardown()


def test_a_new_leader_corrects_a_verdict_equal_to_what_it_read_at_start() -> None:
    """Item 10: follower B read V0; leader A wrote V1; the verdict went back to V0 and A died
    before writing it; B leads and must write V0 over the server's V1 (at once, not at a resync)."""
    run_steps(
        ("restart_the_follower", {}),
        ("decide", {"name": "chat", "verdict": VERDICTS[1], "write": True}),
        ("decide", {"name": "chat", "verdict": VERDICTS[0], "write": False}),
        ("change_leader", {}),
    )
    # B led before: what it remembers from then is as old as a start-up read.
    run_steps(
        ("change_leader", {}),
        ("change_leader", {}),
        ("decide", {"name": "chat", "verdict": VERDICTS[1], "write": True}),
        ("decide", {"name": "chat", "verdict": VERDICTS[0], "write": False}),
        ("change_leader", {}),
    )


def test_a_report_removed_by_hand_or_by_forget_region_is_repaired_by_the_next_resync() -> None:
    """Item 11."""
    run_steps(("delete_a_report_by_name", {"name": "eu-0"}), ("resync", {}))
    run_steps(("forget_the_live_region", {}), ("resync", {}))


def test_a_recreated_map_inherits_no_verdict() -> None:
    """Item 12: the same name, a new uid; the region has decided nothing about it yet."""
    run_steps(("change_leader", {}), ("delete_map", {"name": "chat", "recreate": True}), ("resync", {}))


def test_a_region_back_in_condition_mode_is_read_from_its_condition() -> None:
    """Item 12: report -> condition; the report left behind must not speak for the region."""
    run_steps(("switch_mode", {}), ("decide", {"name": "chat", "verdict": VERDICTS[1], "write": False}), ("resync", {}))
