"""What a measurement or a training run ran on: the CPU, and the versions of the numerical libraries.

Why it is recorded: an answer-only curriculum run is chaotic enough that the
rounding of another CPU's kernels, or another numpy, gives another run from
the same code and seed (docs/RESULTS.md, round three, section 3). A record
that names its machine says which runs can be compared.
"""

from __future__ import annotations

import os
import platform

import numpy
import torch


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says."""
    try:
        with open("/proc/cpuinfo") as info:
            return next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()


def environment() -> dict:
    """The CPU, its cores, the torch threads and the versions of Python, torch and numpy."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}
