"""Training precision modes and what each stores per parameter (torch-free: `hlat describe` and the planner
read this table without importing torch)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrecisionMode:
    name: str
    summary: str
    weight_bytes: int  # persistent weights (the master copy where there is one)
    grad_bytes: int
    optimizer_bytes: int  # AdamW first and second moments (+ any compensation buffer)
    # pure bf16: how BF16AdamW writes its updates back to the bf16 weights ("" for torch's AdamW on fp32 weights)
    rounding: str = ""

    @property
    def bytes_per_param(self) -> int:
        return self.weight_bytes + self.grad_bytes + self.optimizer_bytes

    @property
    def optimizer(self) -> str:
        """The update build_optimizer makes for the mode (and preflight times under that name)."""
        return "BF16AdamW" if self.rounding else "AdamW"


MODES: dict[str, PrecisionMode] = {
    m.name: m
    for m in (
        PrecisionMode("fp32", "fp32 weights, gradients, optimizer states and compute", 4, 4, 8),
        PrecisionMode("bf16_mixed", "bf16 compute; fp32 master weights, gradients and optimizer states", 4, 4, 8),
        PrecisionMode(
            "bf16_sr", "pure bf16 weights, gradients and states; stochastic rounding on update", 2, 2, 4, "stochastic"
        ),
        PrecisionMode(
            "bf16_kahan",
            "pure bf16 weights, gradients and states; a bf16 Kahan compensation buffer "
            "keeps what rounding the weights loses",
            2,
            2,
            6,
            "kahan",
        ),
    )
}
