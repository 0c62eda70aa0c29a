"""The matmul tables of hardware profiles merged, as the lines of a [measured] section: a shipped profile's own
rows and those of `hlat preflight --out` profiles, one [FLOPs per call, TFLOP/s] row per FLOP count (a later
file's where two measured the same count), sorted by FLOPs as the planner interpolates them.

    python benchmarks/measured_rows.py hardware/p5.48xlarge.toml benchmarks/results/preflight_gpu_fp8_1b.toml \
        benchmarks/results/preflight_gpu_fp8_7b.toml
"""

from __future__ import annotations

import sys

from hlat.profiles import load_profile

TABLES = ("matmul_bf16", "matmul_fp8_tensorwise", "matmul_fp8_rowwise")


def merged(paths: list[str], table: str) -> list[list[float]]:
    rows: dict[float, float] = {}
    for path in paths:
        rows.update((flops, tflops) for flops, tflops in getattr(load_profile(path).measured, table))
    return sorted([flops, tflops] for flops, tflops in rows.items())


if __name__ == "__main__":
    for name in TABLES:
        print(f"{name} = {merged(sys.argv[1:], name)}")
