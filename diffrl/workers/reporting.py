"""What a training worker reports beside its passes: a part of the workers (diffrl.workers.roles).

Peak memory, the model FLOPs of a step's phases (for MFU) and the optimizer steps taken. The
controller addresses these as `report.<method>` (diffrl.workers.group).
"""

from __future__ import annotations

from diffrl.config.schema import Config
from diffrl.train.engine import TrainEngine
from diffrl.workers.staging import StagedStep


class Reporting:
    """Measurements of one worker; the prompt shape it trained last comes from its `StagedStep`."""

    def __init__(self, engine: TrainEngine, cfg: Config, staging: StagedStep):
        self.engine = engine
        self.cfg = cfg
        self.staging = staging

    def memory(self) -> dict[str, float]:
        """Peak memory since the last call (GPU allocated/reserved, host RSS)."""
        from diffrl.telemetry import memory_metrics

        return memory_metrics(self.engine.adapter.device)

    def phase_flops(self, images: int, window: int, recompute_old: bool) -> dict[str, float]:
        """Model FLOPs of one step's phases (`diffrl.telemetry.perf.phase_flops`), with the prompt
        length and condition-image tokens of this worker's last training micro-batch."""
        from diffrl.telemetry.perf import phase_flops

        return phase_flops(
            self.engine.adapter,
            self.cfg,
            images=images,
            window=window,
            text_len=self.staging.text_len,
            cond_tokens=self.staging.cond_tokens,
            recompute_old=recompute_old,
            trains_base_weights=not self.engine.lora,
        )

    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far (skipped non-finite steps excluded; restored on resume)."""
        return self.engine.optim_steps


__all__ = ["Reporting"]
