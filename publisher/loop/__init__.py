"""The loop: the one place that wires source -> gate -> verify -> plan -> engine -> report.

A source fills the Stores and marks keys dirty in a KeyQueue. One applier takes every dirty key at
once, decides each map from the newest objects, and hands the engine the maps whose route changed:
a burst costs one write, and the applier is the only caller of the engine, so a resync's read-back
runs between two writes, never beside one. A failed map backs off on its own key; an unexpected
error holds that map alone. Reports go to a second queue drained by the status writer into a
StatusSink, so a slow API server never delays the gateway. `sync_once` is one full pass; `run`
schedules around it.

The package owns the loop's runtime state, each piece in one module (its docstring says which):
the dirty keys and a resync's backlog (keys.py), whether the source and the gateway are ready and
the split check it was given (pipeline.py, the Publisher), each map's state, counts, provenance
and write backoff (settle.py, with states.py and probes.py), the verdicts on their way to the
StatusSink and whether this replica leads (outbox.py), and what the gateway said last (gateway.py).
decide.py, states.py and debug.py are pure. Its modules, top-down: sidecar.py and leader.py run
the Publisher (pipeline.py), which wires decide, gateway, settle, outbox and debug.

It may import publisher.core, publisher.source, publisher.status, publisher.split, adapters,
publisher.kube, publisher.metrics and publisher.retry; only publisher.cli imports it.
"""

from publisher.loop.keys import KeyQueue
from publisher.loop.leader import LeaderOptions, run_leader_election
from publisher.loop.options import DECIDE_SLICE, PENDING_RETRY_CAP, STARTUP_GC_OLDER, STARTUP_GC_THRESHOLD, LoopOptions
from publisher.loop.pipeline import Publisher
from publisher.loop.sidecar import ListenError, Source, SyncTimeout, once, run, serve, start_server
from publisher.loop.states import MapState

__all__ = [
    "DECIDE_SLICE",
    "PENDING_RETRY_CAP",
    "STARTUP_GC_OLDER",
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
