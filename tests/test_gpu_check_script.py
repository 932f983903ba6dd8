"""bench/gpu_check.py runs: its --smoke mode is the GPU checks' own code at tiny sizes on the CPU.

The GPU figures come from a lent GPU (docs/PERFORMANCE.md); this keeps the
script from rotting between those runs, so device time goes to measuring.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_gpu_check_smoke_runs_every_check_on_cpu(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--smoke", "--device", "cpu",
                           "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for name in ("bf16_step", "throughput", "memory", "generation", "checkpoint", "attention"):
        assert "error" not in results[name], (name, results[name])
    assert results["bf16_step"]["tiny"]["rel"] <= 2e-2
    assert results["checkpoint"]["round_trip_equal"]
