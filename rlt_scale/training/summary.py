"""What a training run reports at its end: one summary per job, printed by rank 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class TrainSummary:
    steps: int
    first_loss: Optional[float]
    last_loss: Optional[float]
    tokens_per_s: float
    checkpoint: Optional[str]
    max_steps: Optional[int] = None
    eval_loss: Optional[float] = None
    losses: list[float] = field(default_factory=list)
    preempted: bool = False
    skipped_samples: int = 0
    already_complete: bool = False

    def __str__(self) -> str:
        if self.already_complete:
            return (f"== training summary ==\nnothing to do: the run is already complete at step {self.steps} "
                    f"(trainer.max_steps={self.max_steps}), "
                    f"checkpoint {self.checkpoint}\n"
                    f"to train longer, raise trainer.max_steps; to start over, use a new checkpoint.dir, or "
                    f"checkpoint.resume=false checkpoint.move_aside=true")
        first = f"{self.first_loss:.4f}" if self.first_loss is not None else "-"
        last = f"{self.last_loss:.4f}" if self.last_loss is not None else "-"
        lines = [
            "== training summary ==",
            f"steps            {self.steps}",
            f"loss start/end   {first} -> {last}",
            f"tokens/s         {self.tokens_per_s:,.0f}",
            f"checkpoint       {self.checkpoint}",
        ]
        if self.skipped_samples:
            lines.append(f"skipped samples  {self.skipped_samples} (bad data replaced by padding, data.on_error=skip)")
        if self.preempted:
            lines.append("stopped early by a preemption signal; rerun the same command to resume")
        if self.eval_loss is not None:
            lines.insert(3, f"eval loss        {self.eval_loss:.4f}")
        return "\n".join(lines)
