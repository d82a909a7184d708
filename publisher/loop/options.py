"""The loop's options and the constants that pace it. Owns nothing mutable."""

from __future__ import annotations

from dataclasses import dataclass, field

from publisher.core import gate, plan

# Deciding a map takes about 30 us: a slice of 256 holds the event loop for under 10 ms. A pass
# yields after each slice, and a resync feeds its backlog to the queue a slice at a time.
DECIDE_SLICE = 256
# Until the first sync is done the heap only grows (every object listed is kept), so the cyclic
# collector's default 700-allocation trigger only rescans survivors: at 10,000 maps it was half of
# the first list's CPU and of deciding. Young collections run 30x less often, each 2-3 ms (at
# 100,000 each took 10-20 ms), and the older generations are not collected until the first sync
# freezes them (at 10, a collection of the middle one walked the list: 35-45 ms).
STARTUP_GC_THRESHOLD = 20_000
STARTUP_GC_OLDER = 1_000
# The status writer hands its sink at most this many verdicts at a time (at 8 writes in flight,
# about 5 ms of the event loop), and before each chunk lets the applier finish the pass it is in:
# 10,000 first conditions at start no longer delay the changes that arrive meanwhile. A busy
# applier holds a chunk back at most STATUS_YIELD_CAP seconds, so status is never starved.
STATUS_CHUNK = 64
STATUS_YIELD_CAP = 0.25
# Between two slices of a resync the applier rests as long as the last pass took, at most this.
RESYNC_REST_CAP = 0.05
# A map waiting for a gateway client to connect is retried at least this often, so a gateway that
# comes up is written within seconds, however long it took.
PENDING_RETRY_CAP = 5.0


@dataclass(frozen=True)
class LoopOptions:
    region: str = "default"
    adapter_name: str = "json"
    gate: gate.GateOptions = field(default_factory=gate.GateOptions)
    host_template: str = plan.DEFAULT_HOST_TEMPLATE
    # Resync re-reads the gateway and repairs drift; a minute bounds how long drift can last.
    resync: float = 60.0
    # A hold is news once it has stood this long: between OME's two writes of a change (entries,
    # then Routable) a published map stays published (issue 29), and a verdict other than
    # published is written only then (issue 20).
    status_delay: float = 0.5
    backoff_base: float = 0.5
    backoff_cap: float = 60.0
    # None: stale probe results are not looked for.
    probe_max_age: float | None = None
    # A control plane's replica is ready once synced, before any Envoy connects: its Envoys reach
    # it only through a Service that lists ready replicas.
    ready_without_gateway: bool = False
