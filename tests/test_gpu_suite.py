"""The GPU suite's CPU mode end to end (benchmarks/gpu_suite.py --cpu): every part runs its real code paths at tiny
shapes, so the script cannot break unseen before a GPU is lent."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SUITE = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_suite.py"


def run_part(part: str, out: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SUITE), part, "--out", str(out), "--cpu", "--work-dir", str(out / "runs")],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_the_suites_cpu_mode_runs_every_part(tmp_path):
    for part in ("speed", "7b", "figure"):
        run_part(part, tmp_path)
    speed = rows(tmp_path / "speed.jsonl")
    hlat = {(r["setting"], r["fp8"]): r for r in speed if r["system"] == "hlat"}
    assert set(hlat) == {("1b", "none"), ("1b", "tensorwise")}  # one case of each kind (the CPU mode)
    assert all(r["tokens_per_s"] > 0 for r in hlat.values()), hlat
    assert all(
        "tokens_per_s" in r or r["error"] == "skipped: torchtitan is not installed"
        for r in speed
        if r["system"] == "torchtitan"
    )
    assert hlat["1b", "tensorwise"]["loss"] != hlat["1b", "none"]["loss"]  # FP8 (emulated) ran
    assert "FP8 / bf16" in (tmp_path / "speed.md").read_text()
    assert (tmp_path / "profile_1b.txt").read_text().count("\n") > 10

    seven_b = rows(tmp_path / "7b.jsonl")
    assert seven_b[0]["chosen_by"] == "planner" and all(r["tokens_per_s"] > 0 for r in seven_b)
    planners = (seven_b[0]["batch"], seven_b[0]["ac"])  # FP8 on top of the planner's layout, then the others
    assert [(r["fp8"], (r["batch"], r["ac"])) for r in seven_b[1:]] == [("tensorwise", planners), ("none", (2, "full"))]
    assert (tmp_path / "profile_7b.txt").read_text().count("\n") > 10
    assert "planner's tokens/s" in (tmp_path / "7b.md").read_text()
    for setting in ("1b", "7b"):
        assert "[measured]" in (tmp_path / f"preflight_{setting}.toml").read_text()
        assert "FP8 matmuls: not measured" in json.loads((tmp_path / f"preflight_{setting}.json").read_text())["fp8"]

    assert (tmp_path / "figure.png").stat().st_size > 10_000
    deviations = {d["run"]: d for d in json.loads((tmp_path / "figure.json").read_text())["deviations"]}
    assert set(deviations) == {"bf16_sr", "fp8_tensorwise", "bf16_mixed_seed1"}
    assert all(d["loss"]["max"] > 0 for d in deviations.values())  # each differs from bf16_mixed: another seed too
    assert {r["run"] for r in rows(tmp_path / "figure_metrics.jsonl")} == {"bf16_mixed", *deviations}
