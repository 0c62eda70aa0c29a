"""One rank of each seed recipe and long-context stage, rehearsed on this CPU (`hlat rehearse`): the first and the
last pipeline stage of the job as the recipe states it (world size from its [cluster]), its bytes measured against
the planner's, its compute time, its collective bytes per step, and whether it fits one device of the recipe's
hardware.

A whole rank's compute takes this 2-core host from several minutes (7B at TP 8) to an hour (70B at TP 32 and PP 8,
whose 1F1B schedule needs at least 8 micro-batches); so each rank is rehearsed with 1 and with 2 blocks per
pipeline stage (the model's `n_layers` cut to match, everything else as the recipe states: sequence length,
micro-batch, layout, precision, world size) and every figure is extrapolated linearly in the rank's blocks to
the recipe's own (exact for the model states, which are linear in the blocks; for the rest, what a block adds is
what the two rehearsals differ by). Micro-batches: one without a pipeline; with one, the fewest its schedule
runs (pp). Compute is then scaled to the step's micro-batches, and what the last stage's head keeps (for every
micro-batch under GPipe: `head_bytes`) to the step's count. The planner's figures are for the full-size rank.

    .venv/bin/python benchmarks/rehearse_recipes.py [--recipes hlat-7b,...] [--budget-s 3600]

Each rehearsal runs in its own process group (setsid), one at a time; finished ones are kept in
results/rehearse_recipes_runs.json, so an interrupted run resumes where it stopped."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
from pathlib import Path

from results_io import RESULTS, markdown_table, write_results

from hlat.config.job import load_config
from hlat.planner.layout import Layout, Workload
from hlat.planner.memory import GIB, head_bytes
from hlat.planner.rehearsal import rank_layers, rank_plan, rank_traffic
from hlat.profiles import load_profile

RECIPES = ("hlat-7b", "hlat-70b", "neox-20b", "pythia-6.9b", "hlat-7b-long", "hlat-70b-long")
BLOCKS = (1, 2)  # blocks per pipeline stage rehearsed
STATES = ("params", "grads", "optimizer", "gathered", "activations", "parameter_casts")
RUNS = RESULTS / "rehearse_recipes_runs.json"
ROOT = Path(__file__).resolve().parents[1]


def rehearse(recipe: str, rank: int, blocks: int, stages: int, micro: int, budget_s: float) -> dict:
    """`hlat rehearse` of one rank with `blocks` per stage, in a process group of its own."""
    cmd = [
        sys.executable,
        "-m",
        "hlat",
        "rehearse",
        "--config",
        recipe,
        "--rank",
        str(rank),
        "--steps",
        "1",
        "--micro-batches",
        str(micro),
        "--json",
        "--train.device",
        "cpu",
        "--model.n_layers",
        str(stages * blocks),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=budget_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise SystemExit(f"{recipe} rank {rank} ({blocks} blocks per stage) ran past --budget-s {budget_s:g}") from None
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{err[-3000:]}")
    return json.loads(out)


def extrapolate(small: float, large: float, small_blocks: int, large_blocks: int, blocks: int) -> float:
    """The figure at `blocks` blocks, linear through its values at the two rehearsed sizes."""
    return small + (large - small) / (large_blocks - small_blocks) * (blocks - small_blocks)


class Rank:
    """A recipe's rank at full size: its layout and blocks, and a line through its two rehearsals' figures."""

    def __init__(self, recipe: str, runs: list[dict], rank: int):
        cfg = load_config(recipe)
        self.recipe, self.runs, self.rank, self.world = recipe, runs, rank, cfg.cluster.world_size
        self.layout = Layout(cfg.resolved_parallel(self.world), cfg.train.micro_batch)
        self.work = Workload(
            cfg.model, cfg.train.seq_len, cfg.train.global_batch, cfg.precision.mode, cfg.parallel.compile
        )
        self.pp_rank = rank // (self.world // self.layout.pp)
        self.stages = rank_layers(cfg.model, self.layout, self.pp_rank)
        self.blocks = sum(self.stages.values())
        self.small, self.large = [run["ranks"][0] for run in runs]
        self.micro, self.step = runs[0]["micro_batches"]["rehearsed"], runs[0]["micro_batches"]["step"]
        self.target = load_profile(cfg.cluster.hardware)

    def line(self, figure) -> float:
        """`figure` (of a rehearsed rank's report) extrapolated to the rank's blocks."""
        return extrapolate(
            figure(self.small), figure(self.large), self.small["layers"], self.large["layers"], self.blocks
        )

    def memory(self) -> dict[str, float]:
        measured = {k: self.line(lambda r, k=k: r["memory"][k]["measured"]) for k in STATES}
        if self.layout.pp == 1 and self.layout.param_shard > 1:
            # FSDP without a pipeline holds a block or two gathered at a time (the one in backward, the one it
            # prefetches), whatever the blocks: the two-block rehearsal's peak, not a line through the blocks
            measured["gathered"] = self.large["memory"]["gathered"]["measured"]
        if self.layout.parallel.stages() - 1 in self.stages:  # GPipe keeps every micro-batch's head
            measured["activations"] += head_bytes(self.work, self.layout, self.step) - head_bytes(
                self.work, self.layout, self.micro
            )
        return measured

    def collectives(self) -> dict[str, float]:
        """Bytes per step (of the real step's micro-batches) by kind and mesh dimension."""
        keys = {(row["kind"], row["dim"]) for r in (self.small, self.large) for row in r["collectives"]}
        return {
            f"{kind} {dim}": self.line(
                lambda r, kind=kind, dim=dim: sum(
                    row["step_bytes"] for row in r["collectives"] if (row["kind"], row["dim"]) == (kind, dim)
                )
            )
            for kind, dim in sorted(keys)
        }


def full_size(recipe: str, runs: list[dict], rank: int) -> dict:
    """One row: the two rehearsals of `rank`, extrapolated to the recipe's blocks, beside the planner's figures
    for the full-size rank (its memory as rehearsed: the gathered gradients accumulate whole only from a step's
    second micro-batch on; the fit counts them at the step's micro-batches)."""
    r = Rank(recipe, runs, rank)
    plan = rank_plan(r.work, r.layout, load_profile("cpu"), r.pp_rank)
    gathered = rank_plan(r.work, r.layout, load_profile("cpu"), r.pp_rank, r.micro).gathered
    planned = {
        "params": plan.params,
        "grads": plan.grads,
        "optimizer": plan.optimizer,
        "gathered": gathered,
        "activations": plan.activations,
        "parameter_casts": plan.casts,
    }
    measured = r.memory()
    needed = sum(measured.values()) + plan.gathered - gathered + r.target.overhead_gib * GIB
    traffic = rank_traffic(r.work, r.layout, load_profile("cpu"), r.pp_rank, r.step)
    return {
        "recipe": recipe,
        "rank": rank,
        "pp_rank": r.pp_rank,
        "blocks": r.blocks,
        "rehearsed_blocks": [r.small["layers"], r.large["layers"]],
        "world_size": r.world,
        "micro_batches": {"rehearsed": r.micro, "step": r.step},
        "layout": r.layout.describe(),
        "measured": measured,
        "planned": planned,
        "exact_at_rehearsed_size": exact_states(runs),
        "startup_s": [r.small["time"]["startup_s"], r.large["time"]["startup_s"]],
        "step_compute_s": {
            "measured": r.line(lambda x: x["time"]["step_compute_s"]["measured"]),
            "planned_cpu_profile": plan.compute_s,
        },
        "collective_bytes": r.collectives(),
        "planned_collective_bytes": {f"{kind} {dim}": v for (kind, dim), v in traffic.items()},
        "fits": {
            "hardware": r.target.name,
            "needed_gib": needed / GIB,
            "capacity_gib": r.target.memory_gib,
            "fits": needed <= r.target.memory_gib * GIB,
        },
        "peak_rss_gib": [run["ranks"][0]["peak_memory"]["bytes"] / GIB for run in runs],
    }


def exact_states(runs: list[dict]) -> bool:
    """Whether the planner gave exactly the measured parameter, gradient and optimizer bytes at both sizes."""
    return all(
        r["ranks"][0]["memory"][k]["measured"] == r["ranks"][0]["memory"][k]["planned"]
        for r in runs
        for k in ("params", "grads", "optimizer")
    )


def ranks_of(recipe: str) -> tuple[list[int], int, int]:
    """The first rank of the first and of the last pipeline stage; the stages; the micro-batches to rehearse."""
    cfg = load_config(recipe)
    p = cfg.resolved_parallel(cfg.cluster.world_size)
    world = cfg.cluster.world_size
    micro = 1 if p.pp == 1 else p.pp  # 1F1B runs no fewer micro-batches than stages
    return sorted({0, world - world // p.pp}), p.stages(), micro


def collect(recipes: list[str], budget_s: float) -> list[dict]:
    done = json.loads(RUNS.read_text()) if RUNS.exists() else {}
    rows = []
    for recipe in recipes:
        ranks, stages, micro = ranks_of(recipe)
        for rank in ranks:
            runs = []
            for blocks in BLOCKS:
                key = f"{recipe} rank {rank} blocks {blocks} micro {micro}"
                if key not in done:
                    print(f"rehearsing {key}", flush=True)
                    done[key] = rehearse(recipe, rank, blocks, stages, micro, budget_s)
                    RUNS.write_text(json.dumps(done, indent=1) + "\n")
                runs.append(done[key])
            rows.append(full_size(recipe, runs, rank))
    return rows


def gib(x: float) -> str:
    return f"{x / GIB:.2f}"


def table(rows: list[dict]) -> str:
    header = [
        "recipe",
        "rank (stage)",
        "blocks",
        "params GiB meas/plan",
        "grads",
        "optimizer",
        "gathered",
        "activations",
        "weight casts",
        "compute s/step (cpu)",
        "collectives GiB/step",
        "fits",
    ]
    lines = []
    for r in rows:
        m, p = r["measured"], r["planned"]
        pair = lambda k: f"{gib(m[k])} / {gib(p[k])}"  # noqa: E731
        fit = r["fits"]
        lines.append(
            [
                r["recipe"],
                f"{r['rank']} ({r['pp_rank']})",
                f"{r['blocks']} (from {r['rehearsed_blocks']})",
                pair("params"),
                pair("grads"),
                pair("optimizer"),
                pair("gathered"),
                pair("activations"),
                pair("parameter_casts"),
                f"{r['step_compute_s']['measured']:.4g} / {r['step_compute_s']['planned_cpu_profile']:.3g}",
                f"{sum(r['collective_bytes'].values()) / GIB:.2f} / "
                f"{sum(r['planned_collective_bytes'].values()) / GIB:.2f}",
                f"{'yes' if fit['fits'] else 'NO'}: {fit['needed_gib']:.1f} of {fit['capacity_gib']:g} "
                f"GiB ({fit['hardware']})",
            ]
        )
    return markdown_table(header, lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--budget-s", type=float, default=3600.0, help="per rehearsal")
    args = parser.parse_args()
    rows = collect([r for r in args.recipes.split(",") if r], args.budget_s)
    caption = (
        "hlat rehearse, one rank of each seed recipe and long-context stage on this CPU "
        "(benchmarks/rehearse_recipes.py): measured / planner per device at the recipe's world size, "
        "extrapolated from 1 and 2 blocks per stage to the recipe's (activations at the step's micro-batches; "
        "gathered as rehearsed, FSDP's without a pipeline at its two-block peak); compute "
        "on this CPU (forward and backward of the step's micro-batches, the update apart) against the "
        "planner's nominal `cpu` profile; collectives: bytes per step, all kinds and mesh dimensions, "
        "against what the planner prices; fits: the measured bytes, the gradients that accumulate whole "
        "at the step's micro-batches and the profile's overhead against one device of the recipe's cluster."
    )
    meta = {"host": platform.node(), "cpus": os.cpu_count(), "blocks": BLOCKS}
    write_results("rehearse_recipes", meta, rows, caption, table(rows))


if __name__ == "__main__":
    main()
