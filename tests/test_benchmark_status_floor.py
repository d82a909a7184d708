"""benchmarks/status_floor.py at tiny scale, so the script keeps working. No timing is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "status_floor.py"


def test_condition_writes_are_measured_end_to_end():
    result = subprocess.run([sys.executable, str(SCRIPT), "--maps", "5", "--writes", "10"],
                            capture_output=True, text=True, timeout=120, cwd=SCRIPT.parent.parent)  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.split("JSON ", 1)[1])
    assert report["writes"] == 10 and report["client_cpu_ms_per_write"] > 0
