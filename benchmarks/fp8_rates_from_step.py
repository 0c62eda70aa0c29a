"""FP8 matmul rates for a hardware profile, derived from a measured training step: the lines of its [measured]
section that `hlat plan --fp8` prices from.

FP8 converts only the blocks' linear layers, so the step time FP8 saves (or costs) against bf16, measured on the
same GPU at the same setting (benchmarks/gpu_suite.py speed, compiled), is what those linears save. Their bf16
time is the profile's own measured bf16 rates at their shapes (forward, and twice that for backward); less the
saving, it gives their FP8 time, casts and scaling included as the compiled step fuses them. Each FP8 row is the
bf16 rate at a linear's FLOP count times that ratio.

    python benchmarks/fp8_rates_from_step.py hardware/p5.48xlarge.toml benchmarks/results/gpu_suite_speed.jsonl
"""

from __future__ import annotations

import json
import sys

from hlat.models.config import model_config
from hlat.planner.comms import rate
from hlat.planner.costs import block_linears, matmul_flops
from hlat.profiles import load_profile

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from gpu_step import SETTINGS  # noqa: E402


def linears_seconds(bf16: list[list[float]], model, tokens: int) -> float:
    """Forward + backward seconds of one step's block linears at the measured bf16 rates."""
    per_layer = sum(
        matmul_flops(s) / rate(bf16, matmul_flops(s), 1e12) for s in block_linears(model, tokens, 1).values()
    )
    return 3 * per_layer * model.n_layers


def fp8_rows(profile_path: str, speed_path: str) -> dict[str, list[list[float]]]:
    rows = [json.loads(line) for line in open(speed_path)]
    hlat = {r["fp8"]: r for r in rows if r["system"] == "hlat" and r["setting"] == "1b" and "step_s" in r}
    setting = SETTINGS["1b"]
    model, tokens = model_config(**setting["model"]), setting["batch"] * setting["seq"]
    bf16 = load_profile(profile_path).measured.matmul_bf16
    bf16_s = linears_seconds(bf16, model, tokens)
    flops = sorted({matmul_flops(s) for s in block_linears(model, tokens, 1).values()})
    tables = {}
    for recipe in ("tensorwise", "rowwise"):
        fp8_s = bf16_s - (hlat["none"]["step_s"] - hlat[recipe]["step_s"])
        ratio = bf16_s / fp8_s
        print(f"# {recipe}: block linears {bf16_s * 1e3:.1f} ms in bf16, {fp8_s * 1e3:.1f} ms in FP8 ({ratio:.3f}x)")
        tables[recipe] = [[f, round(rate(bf16, f, 1) * ratio, 1)] for f in flops]
    return tables


if __name__ == "__main__":
    for recipe, table in fp8_rows(sys.argv[1], sys.argv[2]).items():
        print(f"matmul_fp8_{recipe} = {table}")
