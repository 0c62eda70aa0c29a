"""Published and measured training runs as planner samples: the data the profiles' factors are fitted on and the
predictions are checked against (`docs/planner-validation.md`, by `benchmarks/planner_validation.py` and
tests/test_planner.py).

The data lives outside the repository, in the steering checkout's `shared/validation/` (or $HLAT_VALIDATION_DIR);
a user's machine need not have it.
"""

from __future__ import annotations

import csv
import os
from dataclasses import replace
from pathlib import Path

from hlat.models.config import model_config
from hlat.planner.calibration import Sample, fit_factors
from hlat.planner.layout import Layout, Workload, layout_problem
from hlat.planner.timing import step_time
from hlat.profiles import FACTORS, Fit, HardwareProfile, load_profile

VALIDATION_DIR = Path(
    os.environ.get("HLAT_VALIDATION_DIR", Path(__file__).resolve().parents[2] / "shared" / "validation")
)


def _rows(name: str) -> list[dict]:
    with (VALIDATION_DIR / name).open(encoding="utf-8-sig") as f:
        return list(csv.DictReader(f))


def gpt(dim: int, layers: int, heads: int, seq_len: int, vocab: int = 51200, ffn: int = 0, pp: int = 1):
    """Megatron's GPT: LayerNorm, biases, a 4x GeLU MLP and tied embeddings, i.e. hlat's neox family with full
    rotary (the learned position table Megatron uses instead is negligible). Under a pipeline Megatron keeps a
    copy of the embedding on the first and the last stage, which is what an untied model costs there (and what
    hlat's trainer runs)."""
    return model_config(
        family="neox",
        dim=dim,
        n_layers=layers,
        n_heads=heads,
        ffn_dim=ffn or 4 * dim,
        vocab_size=vocab,
        max_seq_len=seq_len,
        rotary_pct=1.0,
        tie_embeddings=pp == 1,
    )


def a100_cluster(inter_gbps: float) -> HardwareProfile:
    """The measurement clusters: DGX-A100-like nodes of 8 A100 80GB, with the p4d profile's A100 factors and
    their own network (vTrain: 800 Gbit/s per node; Selene: 8 x 200 Gbit/s HDR InfiniBand)."""
    return replace(
        load_profile("p4d.24xlarge"),
        name=f"a100-80gb-{inter_gbps:g}gbps",
        memory_gib=80.0,
        hbm_gbs=2039.0,
        inter_gbps=inter_gbps,
        flash_attention=False,
        activations="megatron",
    )


def vtrain_samples(which: str) -> list[Sample]:
    """vTrain's measured iteration times (`which`: 'multi' or 'single'): Megatron GPT, 1F1B, full activation
    checkpointing, fp16 mixed precision, no sequence parallelism. Grouped by model, GPU count and batch."""
    hw = a100_cluster(800.0)
    samples = []
    for i, r in enumerate(_rows(f"vtrain_ground_truth_{which}.csv")):
        n = {k: int(float(v)) for k, v in r.items() if k != "iteration time (ms)"}
        pp = n["pipeline parallelism"]
        model = gpt(n["hidden size"], n["# layers"], n["attention heads"], n["sequence length"], pp=pp)
        work = Workload(model, n["sequence length"], n["global batch"], "bf16_mixed")
        layout = Layout.of(
            tp=n["tensor parallelism"],
            pp=pp,
            dp_replicate=n["data parallelism"],
            micro_batch=n["micro batch"],
            sequence_parallel=False,
            activation_checkpoint="full",
        )
        tied = gpt(model.dim, model.n_layers, model.n_heads, work.seq_len)  # the model's size, wherever it runs
        group = (
            f"{which}: {tied.num_params() / 1e9:.2f}B h{model.dim} L{model.n_layers} s{work.seq_len}, "
            f"{n['# GPUs']} GPUs, batch {work.global_batch}"
        )
        samples.append(Sample(f"vtrain-{which}-{i}", work, layout, hw, float(r["iteration time (ms)"]) / 1e3, group))
    return samples


def split(samples: list[Sample]) -> tuple[list[Sample], list[Sample]]:
    """The fitting part and the held-out part: alternate measurements within each group, so both parts cover
    every model, cluster size and layout family."""
    seen: dict[str, int] = {}
    fit, held = [], []
    for s in samples:
        seen[s.group] = seen.get(s.group, 0) + 1
        (fit if seen[s.group] % 2 else held).append(s)
    return fit, held


def trainium_samples() -> list[Sample]:
    """Published trn1 throughput (AWS blog and Neuron docs). Degrees count NeuronCores. What the rows do not
    state is taken from the public recipes that produced them: neuronx-nemo-megatron's GPT-NeoX-20B and
    Pythia-6.9B scripts (full recomputation, sequence parallelism, no optimizer sharding, micro-batch 1 and 2)
    and NeuronX Distributed's Llama-2 examples (selective recomputation, sequence parallelism, ZeRO-1,
    micro-batch 1)."""
    hw = load_profile("trn1.32xlarge")
    precision = {"bf16+SR": "bf16_sr", "bf16 autocast + fp32 optimizer": "bf16_mixed"}
    samples = []
    for r in _rows("trainium_published.csv"):
        seq, batch = int(r["seq_len"]), int(r["global_batch_seqs"])
        work = Workload(model_config(r["model"]), seq, batch, precision[r["precision"]])
        nemo = r["model"] in ("neox-20b", "pythia-6.9b")
        dp = int(r["dp"])
        layout = Layout.of(
            tp=int(r["tp"]),
            pp=int(r["pp"]),
            dp_replicate=dp if nemo else 1,
            dp_shard=1 if nemo else dp,
            micro_batch=int(r["micro_batch"] or (2 if r["model"] == "pythia-6.9b" else 1)),
            sequence_parallel=True,
            zero1=not nemo and dp > 1,
            activation_checkpoint="full" if nemo else "selective",
        )
        step_s = batch / float(r["seq_per_s"])
        samples.append(Sample(f"{r['model']} {r['nodes']} nodes", work, layout, hw, step_s, r["model"]))
    return samples


def a100_published() -> list[tuple[Sample, list[Layout]]]:
    """Megatron-LM's published A100 runs (Narayanan et al. 2021, Table 1; Korthikanti et al. 2022, Table 5) on
    Selene, each with the layouts it may have used: Table 1 does not give the micro-batch size or the
    interleaving, so every micro-batch of 1 to 8 and every interleaving is a candidate (the prediction is the
    fastest that fits, as the authors tuned theirs). Table 1's measurement is TFLOP/s per GPU counted with
    recomputation (96 B s L h^2 (1 + s/6h + V/16Lh)); it is turned into a step time by that formula."""
    hw = a100_cluster(1600.0)
    out = []
    for r in _rows("published_configs_a100.csv"):
        n = {
            k: int(float(r[k]))
            for k in (
                "layers",
                "hidden",
                "heads",
                "ffn",
                "vocab",
                "seq_len",
                "gpus",
                "tp",
                "pp",
                "dp",
                "global_batch_seqs",
            )
        }
        model = gpt(n["hidden"], n["layers"], n["heads"], n["seq_len"], n["vocab"], n["ffn"], n["pp"])
        work = Workload(model, n["seq_len"], n["global_batch_seqs"], "bf16_mixed")
        selective = r["act_recompute"] == "selective+SP"

        def layout(mb: int, v: int) -> Layout:
            return Layout.of(
                tp=n["tp"],
                pp=n["pp"],
                dp_replicate=n["dp"],
                sequence_parallel=selective,
                activation_checkpoint="selective" if selective else "full",
                micro_batch=mb,
                virtual_stages=v,
            )

        if r["iter_time_s"]:
            step_s = float(r["iter_time_s"])
            layouts = [layout(int(r["micro_batch"]), int(r["vpp"] or 1))]
        else:
            b, s, L, h, V = work.global_batch, work.seq_len, model.n_layers, model.dim, model.vocab_size
            flops = 96 * b * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
            step_s = flops / (float(r["tflops_per_gpu"]) * 1e12 * n["gpus"])
            per_stage = L // n["pp"]
            layouts = [
                layout(mb, v)
                for mb in (1, 2, 4, 8)
                for v in range(1, per_stage + 1)
                if per_stage % v == 0 and (v == 1 or n["pp"] > 1)
            ]
            layouts = [lay for lay in layouts if not layout_problem(work, lay, n["gpus"])]
        name = f"{r['model']} {r['source'].split(' ')[0]} {r['act_recompute']}"
        out.append((Sample(name, work, layouts[0], hw, step_s, r["source"].split(" ")[0]), layouts))
    return out


# --- the fits stored in hardware/*.toml, and the checks of the validation report ----------------------------------

TRN1_FACTORS = ("flops_factor",)  # one factor explains the ten published rows (see the report)


def fit_a100(multi_part: list[Sample], single_part: list[Sample]) -> Fit:
    """The A100 factors, all of them, fitted to vTrain measurements with the multi-node and single-node files
    weighted equally (the 1,440 small single-node runs would otherwise swamp the 109 large ones)."""
    weights = [1 / len(multi_part)] * len(multi_part) + [1 / len(single_part)] * len(single_part)
    return fit_factors(
        multi_part + single_part,
        FACTORS,
        Fit(),
        "fitted to half of vTrain's A100 measurements (benchmarks/planner_validation.py)",
        weights,
    )


def fit_trn1(samples: list[Sample]) -> Fit:
    return fit_factors(
        samples, TRN1_FACTORS, Fit(), "fitted to the published trn1 runs (benchmarks/planner_validation.py)"
    )


def relative_errors(samples: list[Sample], fit: Fit) -> list[float]:
    """(predicted - measured) / measured for each sample."""
    return [step_time(s.workload, s.layout, s.hardware, fit).total / s.step_s - 1 for s in samples]


def mape(samples: list[Sample], fit: Fit) -> float:
    errors = relative_errors(samples, fit)
    return sum(abs(e) for e in errors) / len(errors)


def best_layout_ranks(samples: list[Sample], fit: Fit) -> dict[str, tuple[int, int, float]]:
    """For each group: where the planner ranks the layout measured fastest among the group's distinct
    layouts, how many distinct layouts the group has, and how much slower (measured) the planner's first choice
    ran than the measured best (0 when it is the best)."""
    groups: dict[str, dict[Layout, float]] = {}
    for s in samples:  # a layout measured twice counts once, at its faster time
        times = groups.setdefault(s.group, {})
        times[s.layout] = min(times.get(s.layout, s.step_s), s.step_s)
    hw_of = {s.group: (s.workload, s.hardware) for s in samples}
    ranks = {}
    for group, times in groups.items():
        work, hw = hw_of[group]
        best = min(times, key=times.get)
        ranked = sorted(times, key=lambda layout: step_time(work, layout, hw, fit).total)
        ranks[group] = (ranked.index(best) + 1, len(times), times[ranked[0]] / times[best] - 1)
    return ranks
