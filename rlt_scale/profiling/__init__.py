"""Cost model and profiler of the RLT (DESIGN.md section 6).

* :mod:`.flops`    analytic FLOPs per layer application, useful and executed.
* :mod:`.memory`   analytic memory per layer and per rank of a TP x PP x DP x ZeRO layout.
* :mod:`.measure`  the same quantities measured on the real model (:mod:`.scopes`, :mod:`.counting`).
* :mod:`.peak`     the machine's matmul peak, measured, for MFU / HFU.
* :mod:`.report`   terminal tables, JSON and the PNG chart; :mod:`.cli` is ``rlt-profile``.
"""

from rlt_scale.profiling.flops import ComponentFlops, FlopReport, analytic_flops
from rlt_scale.profiling.memory import Layout, MemoryReport, analytic_memory
from rlt_scale.profiling.workload import Workload

__all__ = ["ComponentFlops", "FlopReport", "analytic_flops", "Layout", "MemoryReport", "analytic_memory", "Workload"]
