"""Peak resident memory of this process on Linux, resettable.

CPU tensors come from malloc, so the honest CPU number for "how much memory
does a step need" is the process's resident set. ``VmHWM`` is its
high-water mark, and writing ``5`` to ``/proc/self/clear_refs`` resets it to
the current RSS, so the peak *of one step* is ``VmHWM`` after the step minus
``VmRSS`` before it. (``ru_maxrss`` cannot be reset, which is why the
benches otherwise need a fresh process per measurement.)
"""

from __future__ import annotations

import re
from pathlib import Path

_STATUS = Path("/proc/self/status")
_CLEAR = Path("/proc/self/clear_refs")


def _field(name: str) -> int:
    match = re.search(rf"^{name}:\s+(\d+) kB", _STATUS.read_text(), re.M)
    if match is None:
        raise RuntimeError(f"{name} not in {_STATUS}")
    return int(match.group(1)) * 1024


def available() -> bool:
    try:
        _field("VmHWM")
        return _CLEAR.exists()
    except (OSError, RuntimeError):
        return False


def current_rss() -> int:
    return _field("VmRSS")


def peak_rss() -> int:
    return _field("VmHWM")


def reset_peak() -> int:
    """Reset the high-water mark to the current RSS; returns that RSS."""
    _CLEAR.write_text("5")
    return current_rss()
