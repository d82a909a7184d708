"""benchmarks/regions.py at tiny scale, so the script keeps working: two regions' sidecars run end
to end, every update reaches both, and each writes one condition per map at start. No timing is
asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "regions.py"


def test_two_regions_end_to_end_at_tiny_scale():
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--regions", "2", "--maps", "20", "--seconds", "2", "--rate", "10"],
        capture_output=True, text=True, timeout=300, cwd=SCRIPT.parent.parent,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("JSON "))[5:])
    assert run["start_writes"] == 2 * 20 and run["settled_seconds"] is not None
    assert run["sent"] > 0 and run["served_updates"] == 2 * run["sent"] and run["status_updates"] == 2 * run["sent"]
    assert "logs" not in run


def test_one_event_is_measured_in_process():
    result = subprocess.run([sys.executable, str(SCRIPT), "--per-event", "--regions", "3"],
                            capture_output=True, text=True, timeout=120, cwd=SCRIPT.parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    costs = json.loads(result.stdout.split("PER_EVENT ", 1)[1])
    assert costs["regions"] == 3 and costs["event_bytes"] > 0 and costs["noted_us"] > 0
