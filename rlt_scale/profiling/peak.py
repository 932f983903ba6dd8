"""The machine's matmul peak, measured in the same process that is being rated.

MFU/HFU need a peak. A datasheet number is often the wrong one (a sparse or
boost-clock figure, another dtype); on a shared CPU the useful peak is what
a large dense matmul reaches *now*, on the same cores and threads as the
training step. :func:`measure_peak` times a square matmul in the training
dtype and keeps the best of a few runs (the sustainable ceiling; the median
is reported too, to show contention).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class PeakFlops:
    """A FLOP/s ceiling and where it came from."""

    flops_per_s: float
    source: str
    size: int = 0
    dtype: str = ""
    device: str = ""
    threads: int = 0
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else self.flops_per_s

    def to_dict(self) -> dict:
        return dict(asdict(self), median=self.median)


def named_peak(tflops: float) -> PeakFlops:
    """A peak the user states (e.g. the dense bf16 datasheet figure of the GPU)."""
    return PeakFlops(tflops * 1e12, "named by the user")


def measure_peak(device: str = "cpu", dtype: torch.dtype = torch.float32, size: int = 0,
                 repeats: int = 5) -> PeakFlops:
    """Best FLOP/s of ``repeats`` ``size x size`` matmuls (after one warm-up)."""
    dev = torch.device(device)
    size = size or (8192 if dev.type == "cuda" else 2048)
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen, dtype=torch.float32).to(dev, dtype)
    b = torch.randn(size, size, generator=gen, dtype=torch.float32).to(dev, dtype)
    flops = 2 * size**3
    samples = []
    for i in range(repeats + 1):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        torch.mm(a, b)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        if i:  # the first run warms up the kernel and the caches
            samples.append(flops / (time.perf_counter() - start))
    return PeakFlops(max(samples), f"measured: {size}x{size} {str(dtype).replace('torch.', '')} matmul, best of {repeats}",
                     size, str(dtype).replace("torch.", ""), str(dev), torch.get_num_threads(), samples)
