"""Per-layer FLOPs and memory of an RLT config: ``python tools/profile_layers.py --help``.

The same program as the ``rlt-profile`` console script (rlt_scale.profiling.cli).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlt_scale.profiling.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
