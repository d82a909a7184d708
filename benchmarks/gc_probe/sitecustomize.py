"""A probe of Python's cyclic collector in every process started with this directory on PYTHONPATH:

    PYTHONPATH=benchmarks/gc_probe:$PWD GC_PROBE_DIR=/tmp/gc-probe python benchmarks/compare.py ...

Each process writes GC_PROBE_DIR/out-PID.txt every 2 s: its command line, the seconds spent in
collections, the collections and the objects they found per generation, the frozen count, then
one line per collection that took over 10 ms (Unix time, generation, ms, objects found). With
GC_PROBE_TYPES=1, each full collection over 10 ms also lists what it left in the generation it
walked, by type (the 15 commonest), and how many: what a process keeps that the next one walks.
py-spy shows a collection as one Python frame sampled many times in a row (the frame whose
allocation triggered it); this says which it was. Not imported by anything else.
"""

import gc
import os
import sys
import threading
import time
from collections import Counter

_DIR = os.environ.get("GC_PROBE_DIR", "/tmp/gc-probe")
_TYPES = os.environ.get("GC_PROBE_TYPES") == "1"
_started = [0.0]
_seconds = [0.0, 0.0, 0.0]
_collections = [0, 0, 0]
_found = [0, 0, 0]
_long: list[tuple] = []


def _timed(phase: str, info: dict) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
        return
    generation = info["generation"]
    took = time.perf_counter() - _started[0]
    _seconds[generation] += took
    _collections[generation] += 1
    _found[generation] += info["collected"]
    if took > 0.01:
        row: tuple = (round(time.time(), 2), generation, round(took * 1000, 1), info["collected"])
        if _TYPES and generation == 2:
            kept = gc.get_objects(2)
            row += (len(kept), Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in kept).most_common(15))
            del kept
        _long.append(row)


def _write() -> None:
    os.makedirs(_DIR, exist_ok=True)
    while True:
        time.sleep(2)
        with open(os.path.join(_DIR, f"out-{os.getpid()}.txt"), "w") as out:
            out.write(f"{' '.join(sys.argv)[:160]}\n")
            out.write(f"seconds={[round(s, 3) for s in _seconds]} collections={_collections} found={_found} frozen={gc.get_freeze_count()}\n")
            out.writelines(f"{row}\n" for row in _long)


gc.callbacks.append(_timed)
threading.Thread(target=_write, daemon=True).start()
