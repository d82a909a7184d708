"""Where the sidecar's time goes, from a py-spy speedscope recording (`py-spy record --idle
--format speedscope`): its CPU per phase of a change, and its longest event-loop stall.

Pure functions over the recording's JSON; compare.py starts and stops py-spy. A sample is idle when
the thread's innermost frame waits (the event loop's select, a lock, a sleep). A stall is the
longest run of consecutive busy samples of the main thread: the event loop handled no new I/O in
that time (one callback, or several back to back without a select between them). Its length is
samples x the recording's real interval (wall seconds / samples: py-spy falls behind on a loaded
machine, and its nominal weights would then understate the time).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

# Phases of a change, as issue 29 names them, plus the periodic work beside them.
PHASES = ("decode", "validate", "decide", "render", "write", "confirm", "status", "split check", "resync", "http client", "other")
IDLE_FUNCTIONS = re.compile(r"(^|\.)(select|poll|epoll|wait|sleep|acquire|accept|recv|recv_into|read|readinto|_wait_for_tstate_lock)$")
IDLE_FILES = ("selectors.py", "threading.py", "queue.py", "concurrent/futures/thread.py")


@dataclass(frozen=True)
class Frame:
    name: str
    file: str


# Contexts: a sample anywhere under one of these is that phase, whatever it calls.
CONTEXTS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("status", re.compile(r"/publisher/status/|(^|\.)(write_reports|run_status_writer|_queue_report|recheck_status|write_condition)$")),
    ("split check", re.compile(r"/publisher/split/|/adapters/envoy/lrs\.py|/adapters/nginx/counts\.py")),
    ("resync", re.compile(r"(^|\.)(run_resync|reconcile|_read_back|_feed_resync_backlog|resync_now)$")),
)
# Otherwise the innermost frame matching one of these names the phase.
STEPS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("validate", re.compile(r"/publisher/core/model\.py|/pydantic")),
    ("render", re.compile(r"/adapters/(.*/)?(render|resources|xds_plan|route_json)\.py|(^|\.)(render\w*|_render\w*)$")),
    ("confirm", re.compile(r"(^|\.)(_commit|_record_apply|_settle\w*|_gateway_confirmed|\w*confirm\w*|_ack\w*|_on_ack\w*)$")),
    ("write", re.compile(r"(^|\.)(_write|write|_send\w*|send\w*|_push\w*|_post\w*)$")),
    ("decide", re.compile(r"/publisher/core/|/publisher/loop/|/adapters/engine\.py")),
    ("decode", re.compile(r"/kubernetes_asyncio/|/publisher/kube\.py|/publisher/source/")),
)


def frames_of(recording: dict[str, Any]) -> list[Frame]:
    return [Frame(str(f.get("name", "")), str(f.get("file", ""))) for f in recording["shared"]["frames"]]


def is_idle(stack: Sequence[Frame]) -> bool:
    """Waiting, not working: the innermost frame waits, or a thread sits in threading.py's or a
    thread pool's own frames (gRPC's poller thread spends its life in native code under
    Thread.run, an idle pool worker in its queue's get)."""
    if not stack:
        return True
    top = stack[-1]
    if top.file.endswith(("threading.py", "concurrent/futures/thread.py")):  # a pool's worker waiting for work
        return True
    return bool(IDLE_FUNCTIONS.search(top.name)) and (top.file.endswith(IDLE_FILES) or "/" not in top.file or "socket" in top.file)


def _matches(pattern: re.Pattern[str], frame: Frame) -> bool:
    return bool(pattern.search(frame.file) or pattern.search(frame.name))


def phase_of(stack: Sequence[Frame], *, project: str = "") -> str:
    """The phase a busy sample belongs to (stack outermost first). `project` (the checkout's path)
    keeps the project's own frames apart from a library's of the same name."""
    for phase, pattern in CONTEXTS:
        if any(_matches(pattern, frame) for frame in stack):
            return phase
    for frame in reversed(stack):
        ours = not project or frame.file.startswith(project)
        for phase, pattern in STEPS:
            if _matches(pattern, frame) and (ours or phase in ("validate", "decode")):
                return phase
    # aiohttp's own tasks (a request body written, an answer read) carry no caller's frames.
    if any("/aiohttp/" in frame.file for frame in stack):
        return "http client"
    return "other"


def innermost_project_frame(stack: Sequence[Frame], project: str) -> str | None:
    for frame in reversed(stack):
        if frame.file.startswith(project):
            return f"{frame.name} ({frame.file[len(project):].lstrip('/')})"
    return None


def main_thread(recording: dict[str, Any]) -> dict[str, Any] | None:
    profiles = recording.get("profiles") or []
    for profile in profiles:
        if "MainThread" in str(profile.get("name", "")):
            return profile
    return profiles[0] if profiles else None


def breakdown(recording: dict[str, Any], *, seconds: float, project: str = "") -> dict[str, Any]:
    """Busy samples per phase over every thread, as CPU-seconds (samples x real interval); the
    longest stall of the main thread with its dominant phase and innermost project frames."""
    frames = frames_of(recording)
    main = main_thread(recording)
    samples_main = len(main["samples"]) if main else 0
    interval = seconds / samples_main if samples_main else 0.0
    busy: Counter[str] = Counter()
    for profile in recording.get("profiles") or []:
        for sample in profile["samples"]:
            stack = [frames[i] for i in sample]
            if not is_idle(stack):
                busy[phase_of(stack, project=project)] += 1
    stall = longest_stall([[frames[i] for i in s] for s in (main["samples"] if main else [])], project=project)
    return {
        "interval_ms": round(interval * 1000, 2),
        "samples": samples_main,
        "busy_seconds": {phase: round(busy[phase] * interval, 3) for phase in PHASES if busy[phase]},
        "stall": {**stall, "ms": round(stall["samples"] * interval * 1000, 1), "at_s": round(stall["start"] * interval, 1)},
    }


def busy_runs(stacks: Sequence[Sequence[Frame]]) -> list[tuple[int, int]]:
    """Every run of busy samples as (start index, length), longest first."""
    runs, start = [], None
    for index, stack in enumerate([*stacks, []]):
        if not is_idle(stack):
            if start is None:
                start = index
            continue
        if start is not None:
            runs.append((start, index - start))
        start = None
    return sorted(runs, key=lambda run: (-run[1], run[0]))


def describe(stacks: Sequence[Sequence[Frame]], start: int, length: int, *, project: str = "") -> dict[str, Any]:
    """A run of busy samples: where it starts (sample index), how long (samples), the phases most
    of it was in and the innermost project frames seen most in it."""
    run = stacks[start:start + length]
    phases = Counter(phase_of(stack, project=project) for stack in run)
    tops = Counter(innermost_project_frame(stack, project) for stack in run) if project else Counter()
    tops.pop(None, None)
    return {"start": start, "samples": length, "phases": dict(phases.most_common(3)),
            "frames": [f"{name} x{count}" for name, count in tops.most_common(3)]}


def longest_stall(stacks: Sequence[Sequence[Frame]], *, project: str = "") -> dict[str, Any]:
    runs = busy_runs(stacks)
    return describe(stacks, *(runs[0] if runs else (0, 0)), project=project)


def main() -> None:
    """`python benchmarks/profile_phases.py RECORDING.json SECONDS [PROJECT]`: the phases, then the
    ten longest stalls with their innermost project frames (compare.py prints the longest only)."""
    import json
    import sys

    recording = json.loads(open(sys.argv[1]).read())
    seconds, project = float(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else ""
    summary = breakdown(recording, seconds=seconds, project=project)
    print(json.dumps({k: v for k, v in summary.items() if k != "stall"}))
    main_profile = main_thread(recording)
    frames = frames_of(recording)
    stacks = [[frames[i] for i in sample] for sample in (main_profile["samples"] if main_profile else [])]
    interval = summary["interval_ms"]
    for start, length in busy_runs(stacks)[:10]:
        stall = describe(stacks, start, length, project=project)
        print(f"{length * interval:.0f} ms at {start * interval / 1000:.1f} s: {stall['phases']} {stall['frames']}")


if __name__ == "__main__":
    main()
