"""The loop: the one place that wires source -> gate -> verify -> plan -> engine -> report.

A source fills the Stores and marks keys dirty in a KeyQueue. One applier takes every dirty key at
once, decides each map from the newest objects, and hands the engine the maps whose route changed:
a burst costs one write, and the applier is the only caller of the engine, so a resync's read-back
runs between two writes, never beside one. A failed map backs off on its own key; an unexpected
error holds that map alone. Reports go to a second queue drained by the status writer into a
StatusSink, so a slow API server never delays the gateway. `sync_once` is one full pass; `run`
schedules around it.
"""


from publisher.loop.keys import KeyQueue
from publisher.loop.leader import LeaderOptions, run_leader_election
from publisher.loop.options import DECIDE_SLICE, PENDING_RETRY_CAP, STARTUP_GC_THRESHOLD, LoopOptions
from publisher.loop.pipeline import _WHOLE_SINK, MapState, Publisher
from publisher.loop.sidecar import ListenError, Source, SyncTimeout, once, run, serve, start_server

__all__ = [
    "DECIDE_SLICE",
    "PENDING_RETRY_CAP",
    "STARTUP_GC_THRESHOLD",
    "KeyQueue",
    "LeaderOptions",
    "ListenError",
    "LoopOptions",
    "MapState",
    "Publisher",
    "Source",
    "SyncTimeout",
    "once",
    "run",
    "run_leader_election",
    "serve",
    "start_server",
]
