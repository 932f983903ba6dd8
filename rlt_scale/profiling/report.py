"""Terminal tables, JSON and a PNG chart of the cost model (and the measured step)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from rlt_scale.profiling.flops import FlopReport
from rlt_scale.profiling.measure import MeasuredStep
from rlt_scale.profiling.memory import MemoryReport
from rlt_scale.profiling.peak import PeakFlops

MB = 2**20


def human(n: float, unit: str = "") -> str:
    """1234567 -> '1.23M' (SI for FLOPs and counts)."""
    for div, suffix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= div:
            return f"{n / div:.3g}{suffix}{unit}"
    return f"{n:.3g}{unit}"


def table(headers: list[str], rows: list[list], title: str = "") -> str:
    """A plain fixed-width table: first column left-aligned, the rest right-aligned."""
    cells = [[str(c) for c in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(r):
        return "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(r))

    out = [title] if title else []
    out += [line(headers), "  ".join("-" * w for w in widths)]
    out += [line(r) for r in cells]
    return "\n".join(out)


@dataclass
class Utilisation:
    """Step time against the peak: tokens/s, MFU (useful FLOPs) and HFU (executed FLOPs)."""

    step_s: float
    tokens_per_s: float
    model_flops: int
    hardware_flops: int
    peak_flops_per_s: float
    mfu: float
    hfu: float

    @classmethod
    def of(cls, flops: FlopReport, step_s: float, peak: PeakFlops) -> "Utilisation":
        achieved = 1.0 / step_s
        return cls(step_s, flops.work.tokens * achieved, flops.model_flops, flops.hardware_flops,
                   peak.flops_per_s, flops.model_flops * achieved / peak.flops_per_s,
                   flops.hardware_flops * achieved / peak.flops_per_s)


def flops_table(flops: FlopReport, measured: Optional[MeasuredStep] = None) -> str:
    """Per-layer FLOPs: useful, executed by phase, and measured beside them."""
    meas = measured.by_layer() if measured else {}
    total_exec = flops.hardware_flops or 1
    step_s = sum(r.seconds for r in meas.values()) or 1.0
    headers = ["layer", "model", "fwd", "bwd", "recomp", "executed", "share"]
    if measured:
        headers += ["measured", "diff", "op time", "time share"]
    rows = []
    for name, r in list(flops.by_layer().items()) + [("total", flops.total())]:
        row = [name, human(r.model_step), human(r.fwd), human(r.bwd), human(r.attn_recompute + r.ckpt_recompute),
               human(r.executed), f"{100 * r.executed / total_exec:.1f}%"]
        if measured:
            m = measured.rows if name == "total" else ([meas[name]] if name in meas else [])
            got = sum(x.flops for x in m)
            sec = sum(x.seconds for x in m)
            diff = f"{100 * (got - r.executed) / r.executed:+.2f}%" if r.executed else ("0" if not got else "n/a")
            row += [human(got), diff, f"{1e3 * sec:.1f}ms", f"{100 * sec / step_s:.1f}%"]
        rows.append(row)
    if measured:
        other = meas.get("other")
        if other is not None:
            rows.append(["(glue, loss)", "-", "-", "-", "-", "-", "-", human(other.flops), "",
                         f"{1e3 * other.seconds:.1f}ms", f"{100 * other.seconds / step_s:.1f}%"])
    title = (f"FLOPs per step ({flops.work.describe()}, TP rank 1/{flops.tp}); model = 3 x useful forward, "
             f"executed = what runs (masked attention, recomputation)")
    return table(headers, rows, title)


def memory_table(mem: MemoryReport, measured: Optional[MeasuredStep] = None) -> str:
    """Per-layer parameters, activations (plain and checkpointed) and recurrent state."""
    held = {}
    if measured:
        for r in measured.rows:
            held[r.layer] = held.get(r.layer, 0) + r.held_bytes
    headers = ["layer", "stages", "params", "act/token", "act", "act ckpt", "rebuilt/chunk", "state"]
    if measured:
        headers += ["measured act"]
    rows = []
    tokens = mem.work.tokens
    for m in mem.layers:
        row = [m.layer, ",".join(map(str, m.stages)), human(m.params), f"{m.activation_bytes / tokens:,.0f}B",
               f"{m.activation_bytes / MB:.2f}MB", f"{m.activation_bytes_ckpt / MB:.2f}MB",
               f"{m.recompute_bytes / MB:.2f}MB", f"{m.state_bytes / MB:.3f}MB"]
        if measured:
            row.append(f"{held.get(m.layer, 0) / MB:.2f}MB")
        rows.append(row)
    tot_plain = sum(m.activation_bytes for m in mem.layers)
    tot_ckpt = sum(m.activation_bytes_ckpt for m in mem.layers)
    row = ["total", "", human(sum(m.params for m in mem.layers)), f"{tot_plain / tokens:,.0f}B",
           f"{tot_plain / MB:.2f}MB", f"{tot_ckpt / MB:.2f}MB", "", f"{sum(m.state_bytes for m in mem.layers) / MB:.3f}MB"]
    if measured:
        row.append(f"{measured.held_bytes / MB:.2f}MB")
    rows.append(row)
    title = (f"Memory per layer, one micro-batch ({mem.work.describe()}, TP rank 1/{mem.layout.tp}); "
             f"act = kept for backward after forward; 'act ckpt' with chunks of {mem.work.chunk} checkpointed")
    return table(headers, rows, title)


def rank_table(mem: MemoryReport) -> str:
    """Per-rank memory of each pipeline stage."""
    lay = mem.layout
    headers = ["stage", "params", "grads", "optimizer", "activations", "acts (ckpt)", "comm", "total", "total (ckpt)"]
    rows = [[r.stage] + [f"{v / MB:,.1f}MB" for v in (r.params, r.grads, r.optimizer, r.activations,
                                                       r.activations_ckpt, r.comm_buffers, r.total, r.total_ckpt)]
            for r in mem.ranks]
    title = (f"Per rank: TP={lay.tp} PP={lay.pp} DP={lay.dp} ZeRO-{lay.zero_stage}, "
             f"{lay.in_flight} micro-batch(es) in flight per stage, AdamW")
    return table(headers, rows, title)


def summary_lines(flops: FlopReport, peak: Optional[PeakFlops], measured: Optional[MeasuredStep]) -> str:
    w = flops.work
    lines = [
        f"model FLOPs/token    {human(flops.model_flops / w.tokens)}  (MFU numerator: 3 x useful forward)",
        f"executed FLOPs/token {human(flops.hardware_flops / w.tokens)}  (HFU numerator: as run, recomputation included)",
    ]
    if peak:
        lines.append(f"peak                 {human(peak.flops_per_s, 'FLOP/s')}  ({peak.source}"
                     + (f"; median {human(peak.median, 'FLOP/s')}" if peak.samples else "") + ")")
    if measured:
        lines.append(f"measured FLOPs       {human(measured.counted.total)} by FlopCounterMode vs "
                     f"{human(flops.hardware_flops)} analytic "
                     f"({100 * (measured.counted.total - flops.hardware_flops) / flops.hardware_flops:+.2f}%)")
        lines.append(f"step time            {1e3 * measured.step_s:.1f} ms (median of {len(measured.step_times_s)}, "
                     f"{measured.device}, {measured.threads} threads)")
        if peak:
            u = Utilisation.of(flops, measured.step_s, peak)
            lines.append(f"throughput           {u.tokens_per_s:,.0f} tokens/s   MFU {100 * u.mfu:.2f}%   "
                         f"HFU {100 * u.hfu:.2f}%")
        lines.append(f"peak tensor memory   {measured.peak_live_bytes / MB:.2f} MB live tensors (at {measured.peak_live_phase})"
                     + (f"; step peak {measured.step_peak_bytes / MB:.2f} MB above start"
                        if measured.step_peak_bytes is not None else ""))
    return "\n".join(lines)


def write_json(path: str | Path, payload: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


COLORS = {
    "qkv": "#4c72b0", "attn": "#8172b3", "out": "#64b5cd", "ffn": "#55a868", "cross_q": "#dd8452",
    "cross": "#c44e52", "cross_out": "#937860", "kv": "#da8bc3", "gate": "#8c8c8c", "proj": "#ccb974",
    "readout": "#e5ae38", "norm": "#b0b0b0", "embed": "#6d904f", "loss": "#fc4f30",
}


def _legend(ax) -> None:
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=4, frameon=False)


def plot(path: str | Path, flops: FlopReport, mem: MemoryReport, measured: Optional[MeasuredStep] = None) -> Path:
    """PNG: executed FLOPs per layer stacked by component; memory per layer stacked by kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [m.layer for m in mem.layers if m.layer != "other"]
    panels = 3 if measured else 2
    fig, axes = plt.subplots(1, panels, figsize=(6.5 * panels, 0.42 * len(layers) + 3.8), sharey=True)
    y = list(range(len(layers)))

    ax = axes[0]
    comps = list(dict.fromkeys(r.component for r in flops.rows if r.executed))
    left = [0.0] * len(layers)
    for comp in comps:
        vals = [sum(r.executed for r in flops.rows if r.layer == name and r.component == comp) / 1e9 for name in layers]
        ax.barh(y, vals, left=left, color=COLORS.get(comp, None), label=comp, edgecolor="white", linewidth=0.4)
        left = [a + b for a, b in zip(left, vals)]
    model = [flops.by_layer()[name].model_step / 1e9 if name in flops.by_layer() else 0 for name in layers]
    ax.scatter(model, y, marker="|", s=160, color="black", label="model (useful)", zorder=3)
    if measured:
        got = measured.by_layer()
        ax.scatter([got[n].flops / 1e9 if n in got else 0 for n in layers], y, marker="x", color="red",
                   label="measured", zorder=4)
    ax.set_title(f"GFLOP per step, executed, by component\n{flops.work.describe()}")
    ax.set_yticks(y, layers)
    ax.margins(x=0.04)
    ax.invert_yaxis()
    _legend(ax)
    ax.grid(axis="x", alpha=0.3)

    ax = axes[1]
    p = mem.dtype_bytes
    kinds = {
        "parameters": [m.params * p / MB for m in mem.layers if m.layer != "other"],
        "grads + AdamW": [m.params * (p + 8) / MB for m in mem.layers if m.layer != "other"],
        "activations": [m.activation_bytes / MB for m in mem.layers if m.layer != "other"],
        "state (caches, memory)": [m.state_bytes / MB for m in mem.layers if m.layer != "other"],
    }
    colors = ["#4c72b0", "#8da0cb", "#fc8d62", "#66c2a5"]
    left = [0.0] * len(layers)
    for (kind, vals), color in zip(kinds.items(), colors):
        ax.barh(y, vals, left=left, color=color, label=kind, edgecolor="white", linewidth=0.4)
        left = [a + b for a, b in zip(left, vals)]
    ckpt = [m.activation_bytes_ckpt / MB for m in mem.layers if m.layer != "other"]
    ax.scatter([a - b + c for a, b, c in zip(left, kinds["activations"], ckpt)], y, marker="|", s=160,
               color="black", label="total with chunk ckpt", zorder=3)
    ax.set_title(f"MB per layer (TP rank, one micro-batch)\nother (rotary, loss): "
                 f"{mem.layers[-1].activation_bytes / MB:.1f} MB")
    _legend(ax)
    ax.grid(axis="x", alpha=0.3)

    if measured:
        ax = axes[2]
        got = measured.by_layer()
        left = [0.0] * len(layers)
        for phase, color in (("fwd", "#4c72b0"), ("bwd", "#dd8452"), ("recompute", "#55a868")):
            vals = [1e3 * getattr(got[n], f"{phase}_s") if n in got else 0 for n in layers]
            ax.barh(y, vals, left=left, color=color, label=phase)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_title(f"measured op time per layer (ms)\nstep {1e3 * measured.step_s:.0f} ms uninstrumented")
        _legend(ax)
        ax.grid(axis="x", alpha=0.3)

    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
