"""The prepared GPU suite: one unattended command that measures on a lent GPU what the CPU cannot, and writes every
result into one folder to bring back.

    bash benchmarks/gpu_suite.sh OUT [PART ...]          # on the GPU machine: speed, 7b and figure by default
    python benchmarks/gpu_suite.py PART --out DIR        # one part, here
    python benchmarks/gpu_suite.py PART --out DIR --cpu  # the CPU mode: tiny shapes, FP8 emulated, one case of
                                                         # each kind (make test runs it)

`speed` (about 5 minutes): hlat against torchtitan (its released wheel, on the device's torch) at the same model,
shapes, batch, precision and recomputation, compiled, each case in its own process: the 1B setting in bf16 and in
FP8 tensorwise and rowwise, and llama2-7b in pure bf16 (benchmarks/gpu_step.py builds both systems' steps); a
kernel profile of hlat's 1B bf16 step; `hlat preflight` at the 1B setting's shapes with FP8 and its compiled block.

`7b` (about 5 minutes): llama2-7b in bf16_sr on one GPU at the layout the planner picks for it (with a kernel
profile of its step), `hlat preflight` at llama2-7b's shapes with FP8 and the compiled block of the planner's layout
(whose key the planner then prices that layout by), FP8 tensorwise at the planner's layout, then
the other micro-batches and recomputation its memory allows, each beside the planner's prediction from the shipped
p5.48xlarge profile.

`figure` (about 8 minutes: each run took 108-124 s on an H100): a Pythia-style model of about
1B parameters (GPT-NeoX: parallel residual, a quarter of
each head rotated) trained by `hlat train` on the same real text (the machine's Python standard library, as
`make train`; the GPT-NeoX-20B tokenizer carried in .gpu/) from the same seed and data order: bf16_mixed, bf16_sr,
bf16_mixed with FP8 tensorwise, and bf16_mixed from another seed (the run-to-run spread); `hlat compare` draws
them and gives each one's deviation from bf16_mixed. The runs keep no snapshots (what the figure compares is
the arithmetic) and write their run directories to memory (--work-dir: each final checkpoint is ~12 GB).

Each part runs its cases in order of importance within its budget (`--budget-s`) and writes as it goes, so a short
lease still brings back the first ones. Files (DIR): PART.jsonl (a row per case), PART.md (the table), and
profile_{1b,7b}.txt, preflight_{1b,7b}.{toml,json}, figure.png, figure_metrics.jsonl.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import gpu_step  # noqa: E402
from results_io import markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# The CPU mode's setting: the suite's code paths at a size a CPU runs in seconds (FP8 emulated, not compiled).
TINY = dict(
    model=dict(family="llama", dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=512, max_seq_len=64),
    seq=64,
    batch=2,
    hlat_mode="bf16_mixed",
    titan_mode="bf16_mixed",
    ac="none",
)
SPEED_CASES = [  # most important first; "preflight" runs hlat preflight at that point
    dict(system="hlat", setting="1b", fp8="none", profile=True),
    dict(system="hlat", setting="1b", fp8="tensorwise"),
    dict(system="torchtitan", setting="1b", fp8="none"),
    dict(system="torchtitan", setting="1b", fp8="tensorwise"),
    dict(system="hlat", setting="1b", fp8="rowwise"),
    "preflight",
    dict(system="torchtitan", setting="1b", fp8="rowwise"),
    dict(system="hlat", setting="7b", fp8="none"),
    dict(system="torchtitan", setting="7b", fp8="none"),
]
# llama2-7b in pure bf16 on one 80 GB GPU: 8 bytes a parameter of states (54 GB) leave ~20 GB for activations,
# enough for micro-batch 4 under full recomputation (the block inputs, 4.3 GB) or 1 under selective (~10 GB). The
# part measures the planner's layout first (profiled), then preflight, then FP8 at that layout, then these.
SEVEN_B_CASES = [dict(batch=2, ac="full"), dict(batch=4, ac="full"), dict(batch=1, ac="selective")]
FIGURE_RUNS = [
    ("bf16_mixed", "bf16_mixed", "none", 0),
    ("bf16_sr", "bf16_sr", "none", 0),
    ("fp8_tensorwise", "bf16_mixed", "tensorwise", 0),
    ("bf16_mixed_seed1", "bf16_mixed", "none", 1),
]
PYTHIA_1B = dict(
    family="neox",
    dim=2048,
    n_layers=16,
    n_heads=8,
    ffn_dim=8192,
    vocab_size=50304,
    rotary_pct=0.25,
    max_seq_len=2048,
    parallel_residual=True,
)
TOKENIZER = ROOT / ".gpu" / "gpt-neox-20b-tokenizer.json"  # ../shared/data/tokenizers/gpt-neox-20b, carried
BUDGET_S = {"speed": 290, "7b": 290, "figure": 480}  # each part's default time


def settings(cpu: bool) -> dict:
    return {name: TINY for name in gpu_step.SETTINGS} if cpu else gpu_step.SETTINGS


# --- one case, in its own process -------------------------------------------------------------------------------


def install_titan_stubs() -> None:
    """torchtitan's model package imports its Hugging Face data loader, which imports `datasets`, and its MoE
    kernels, which import Triton (absent from CPU builds of torch). The suite loads no data through torchtitan and
    runs no MoE, so where either is missing an empty module stands in for what imports it."""
    import importlib.util
    import types

    if importlib.util.find_spec("datasets") is None:
        stub, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stub.Dataset, stub.load_dataset, distributed.split_dataset_by_node = object, None, None
        sys.modules.update({"datasets": stub, "datasets.distributed": distributed})
    if importlib.util.find_spec("triton") is None:
        kernels = types.ModuleType("torchtitan.models.moe.kernels")
        kernels.generate_permute_indices = None
        sys.modules[kernels.__name__] = kernels


def case_setting(spec: dict) -> dict:
    """The case's setting: gpu_step's (or the CPU mode's), with the case's FP8 recipe, micro-batch and
    recomputation."""
    setting = dict(settings(spec["cpu"])[spec["setting"]], fp8=spec.get("fp8", "none"))
    return {**setting, **{k: spec[k] for k in ("batch", "ac") if k in spec}}


def run_case(spec: dict) -> dict:
    """One case in this process: warm-up steps, then the median step time of `steps` timed steps."""
    device = torch.device("cpu" if spec["cpu"] else "cuda")
    setting = case_setting(spec)
    torch.manual_seed(0)
    row = {
        "system": spec["system"],
        "setting": spec["setting"],
        "fp8": setting["fp8"],
        "batch": setting["batch"],
        "seq": setting["seq"],
        "ac": setting["ac"],
        "compile": not spec["cpu"],
        "mode": setting["hlat_mode" if spec["system"] == "hlat" else "titan_mode"],
        **({"chosen_by": spec["chosen_by"]} if "chosen_by" in spec else {}),
    }
    try:
        if spec["system"] == "torchtitan":
            install_titan_stubs()
        build = gpu_step.hlat_step if spec["system"] == "hlat" else gpu_step.titan_step
        step = build(setting, not spec["cpu"], device)
        vocab = gpu_step.hlat_model_config(setting).vocab_size
        tokens = torch.randint(0, vocab, (setting["batch"], setting["seq"] + 1), device=device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        row.update(time_steps(step, inputs, targets, spec, device))
        row["mfu"] = round(row["tokens_per_s"] * gpu_step.flops_per_token(setting) / gpu_step.PEAK, 4)
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as e:  # a row, not a crash: the other cases still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return row


def time_steps(step, inputs, targets, spec: dict, device: torch.device) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(spec["warmup"]):
        loss = step(inputs, targets)
    sync()
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(spec["steps"]):
        t0 = time.perf_counter()
        loss = step(inputs, targets)
        sync()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    if spec.get("profile"):
        write_profile(step, inputs, targets, device, Path(spec["out"]) / f"profile_{spec['setting']}.txt")
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0
    return {
        "warmup_s": round(warmup_s, 1),
        "step_s": round(step_s, 4),
        "tokens_per_s": round(inputs.numel() / step_s),
        "peak_memory_gb": round(peak, 2),
        "loss": round(loss.item(), 4),
        "steps_run": spec["warmup"] + spec["steps"],
    }


def write_profile(step, inputs, targets, device: torch.device, path: Path) -> None:
    """Three steps under torch.profiler: the kernels by total device time (where the step's time goes)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(3):
            step(inputs, targets)
        if device.type == "cuda":
            torch.cuda.synchronize()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.write_text(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=90))


def run_in_process(spec: dict, timeout: float) -> dict:
    """A case in a fresh process (its own memory and compile caches); a crash or a timeout is the row's error."""
    named = {"system": spec["system"], "setting": spec["setting"], "fp8": spec.get("fp8", "none")}
    try:
        done = subprocess.run(
            [sys.executable, __file__, "case", json.dumps(spec)], capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {**named, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    return {
        **named,
        "error": f"exit {done.returncode}: {(done.stderr.strip().splitlines() or ['no output'])[-1][:300]}",
    }


# --- the parts --------------------------------------------------------------------------------------------------


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def one_of_each_kind(cases: list) -> list:
    """The CPU mode's cases: one of each kind (system, with or without FP8, the planner's pick; each named step),
    which is every code path of the part at a CPU's cost."""
    seen, kept = set(), []
    for case in cases:
        kind = (
            case if isinstance(case, str) else (case["system"], case.get("fp8", "none") != "none", "chosen_by" in case)
        )
        if kind not in seen:
            seen.add(kind)
            kept.append(case)
    return kept


def run_cases(name: str, cases: list, args, extra) -> list[dict]:
    """Each case (a spec dict, or a name that `extra` runs) within the part's budget; rows written as they come."""
    out, budget, rows = Path(args.out), Budget(args.budget_s), []
    steps, warmup = (2, 1) if args.cpu else (args.steps, args.warmup)
    for case in one_of_each_kind(cases) if args.cpu else cases:
        if isinstance(case, str):
            rows += extra(case, budget)
            continue
        spec = {"cpu": args.cpu, "steps": steps, "warmup": warmup, "out": str(out), **case}
        if budget.left() < 30:
            row = {
                "system": spec["system"],
                "setting": spec["setting"],
                "fp8": spec.get("fp8", "none"),
                "error": "skipped: the part's budget",
            }
        elif spec["system"] == "torchtitan" and not installed("torchtitan"):
            row = {
                "system": "torchtitan",
                "setting": spec["setting"],
                "fp8": spec.get("fp8", "none"),
                "error": "skipped: torchtitan is not installed",
            }
        else:
            row = run_in_process(spec, min(args.case_timeout_s, budget.left()))
        rows.append(row)
        with open(out / f"{name}.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    return rows


def speed(args) -> None:
    def extra(case: str, budget: Budget) -> list[dict]:
        if budget.left() > 60:
            preflight(args, "1b", min(budget.left() - 30, args.preflight_timeout_s))
        return []

    rows = run_cases("speed", SPEED_CASES, args, extra)
    write_table("speed", rows, args, against_titan=True)


def seven_b(args) -> None:
    def extra(case: str, budget: Budget) -> list[dict]:
        if budget.left() > 60:
            preflight(args, "7b", min(budget.left() - 30, args.preflight_timeout_s), planners)
        return []

    chosen = planner_choice(args.cpu)  # the layout the planner picks for llama2-7b on one GPU, measured first
    planners = dict(batch=chosen.micro_batch, ac=chosen.activation_checkpoint, chosen_by="planner")
    cases = [dict(planners, profile=True), "preflight", dict(planners, fp8="tensorwise"), *SEVEN_B_CASES]
    rows = run_cases(
        "7b", [c if isinstance(c, str) else dict(system="hlat", setting="7b", **c) for c in cases], args, extra
    )
    for row in rows:
        row["planned_tokens_per_s"] = planned_tokens_per_s(row, args.cpu)
    write_table("7b", rows, args, against_titan=False)


def workload_of(setting: dict, fp8: str = "none"):
    from hlat.planner.layout import Workload

    model, mode = gpu_step.hlat_model_config(setting), setting["hlat_mode"]
    return Workload(model, setting["seq"], setting["batch"], mode, compile=True, fp8=fp8)


def one_gpu_profile(cpu: bool):
    """The shipped profile the planner prices one GPU of the device with (the CPU mode: the `cpu` profile)."""
    from dataclasses import replace

    from hlat.profiles import load_profile

    return replace(load_profile("cpu" if cpu else "p5.48xlarge"), devices_per_node=1)


def planner_choice(cpu: bool):
    """The planner's first layout for llama2-7b in bf16_sr on one GPU (its search, as `hlat plan --search`)."""
    from hlat.planner.search import search

    return search(workload_of(settings(cpu)["7b"]), one_gpu_profile(cpu), nodes=1).plans[0].layout


def planned_tokens_per_s(row: dict, cpu: bool) -> float | None:
    """The planner's prediction for a measured row's layout (one GPU, the shipped profile)."""
    from hlat import HlatError
    from hlat.planner.layout import Layout
    from hlat.planner.timing import step_time

    if "batch" not in row or row.get("system") != "hlat":
        return None
    setting = {**settings(cpu)[row["setting"]], "batch": row["batch"]}
    work = workload_of(setting, row["fp8"])
    layout = Layout.of(micro_batch=row["batch"], activation_checkpoint=row["ac"], compile=True)
    try:
        return round(work.tokens_per_step / step_time(work, layout, one_gpu_profile(cpu)).total)
    except HlatError:  # a profile without the recipe's FP8 rates (the CPU's)
        return None


def preflight(args, setting: str, timeout: float, layout: dict | None = None) -> None:
    """`hlat preflight` at a setting's shapes: bf16 matmuls, (where the device has them) compiled FP8 ones, and
    whole blocks compiled as the cases run them, at the setting's micro-batch and recomputation or `layout`'s
    (`batch`, `ac`): the block the planner then prices that layout from."""
    s = {
        **(TINY if args.cpu else gpu_step.SETTINGS[setting]),
        **{k: v for k, v in (layout or {}).items() if k in ("batch", "ac")},
    }
    model = (
        ["--model", "llama2-7b"]
        if "preset" in s["model"]
        else [a for k, v in s["model"].items() for a in (f"--model.{k}", str(v))]
    )
    out = Path(args.out) / f"preflight_{setting}"
    cmd = [
        sys.executable,
        "-m",
        "hlat",
        "preflight",
        *model,
        "--train.seq_len",
        str(s["seq"]),
        "--train.micro_batch",
        str(s["batch"]),
        "--precision.mode",
        s["hlat_mode"],
        "--parallel.activation_checkpoint",
        s["ac"],
        "--parallel.compile",
        str(not args.cpu).lower(),
        "--dtypes",
        "bf16",
        "--fp8",
        "tensorwise,rowwise",
        "--json",
        "--out",
        f"{out}.toml",
    ]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        Path(f"{out}.json").write_text(done.stdout or done.stderr[-3000:])
        print(f"preflight {setting}:", "ok" if done.returncode == 0 else done.stderr[-500:], flush=True)
    except subprocess.TimeoutExpired:
        print(f"preflight {setting}: timed out after {timeout:.0f} s", flush=True)


def figure(args) -> None:
    """The seeds' trajectory figure: `hlat train` runs from one seed and data order, drawn by `hlat compare`."""
    out, budget, runs = Path(args.out), Budget(args.budget_s), []
    work = Path(args.work_dir)
    for name, mode, fp8, seed in FIGURE_RUNS:
        if budget.left() < 60:
            print(f"figure {name}: skipped: the part's budget", flush=True)
            continue
        run_dir = work / name
        shutil.rmtree(run_dir, ignore_errors=True)
        steps = 6 if args.cpu else args.figure_steps
        cmd = [
            sys.executable,
            "-m",
            "hlat",
            "train",
            *figure_overrides(args.cpu, mode, fp8, seed, steps),
            "--train.run_dir",
            str(run_dir),
        ]
        started = time.monotonic()
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=budget.left() - 30)
            print(
                f"figure {name} ({time.monotonic() - started:.0f} s):",
                "ok" if done.returncode == 0 else done.stderr[-800:],
                flush=True,
            )
        except subprocess.TimeoutExpired:
            print(f"figure {name}: timed out after {time.monotonic() - started:.0f} s", flush=True)
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # gigabytes each, and not what is brought back
        if (run_dir / "metrics.jsonl").is_file():
            runs.append(run_dir)
    if len(runs) > 1:
        draw_figure(runs, out)


def figure_overrides(cpu: bool, mode: str, fp8: str, seed: int, steps: int) -> list[str]:
    model = (
        dict(PYTHIA_1B, dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=512, max_seq_len=64)
        if cpu
        else PYTHIA_1B
    )
    seq, batch, tokenizer = (64, 4, "") if cpu else (2048, 8, str(TOKENIZER))
    fields = {
        **{f"model.{k}": v for k, v in model.items()},
        "precision.mode": mode,
        "precision.fp8": fp8,
        "train.seed": seed,
        "train.steps": steps,
        "train.global_batch": batch,
        "train.micro_batch": batch,
        "train.seq_len": seq,
        "train.log_every": 1 if cpu else 5,
        "parallel.compile": not cpu,
        "data.tokenizer": tokenizer,
        "data.workers": 0 if cpu else 4,
        "optim.lr": 3e-4,
        "optim.min_lr": 3e-5,
        "optim.warmup_steps": 2 if cpu else 20,
        "train.snapshot_every": 0,
    }
    if cpu:  # rounds of 64 KiB of the embedded corpus, not 4 MiB (2 s of tokenizing at each start): 6 steps need less
        fields["data.round_bytes"] = 1 << 16
    return [a for k, v in fields.items() for a in (f"--{k}", str(v).lower() if isinstance(v, bool) else str(v))]


def draw_figure(runs: list[Path], out: Path) -> None:
    cmd = [sys.executable, "-m", "hlat", "compare", *map(str, runs), "--out", str(out / "figure.png"), "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    (out / "figure.json").write_text(done.stdout or done.stderr)
    with open(out / "figure_metrics.jsonl", "w") as f:
        for run in runs:
            for line in (run / "metrics.jsonl").read_text().splitlines():
                f.write(json.dumps({"run": run.name, **json.loads(line)}) + "\n")
    print((out / "figure.json").read_text()[:2000], flush=True)


# --- tables -----------------------------------------------------------------------------------------------------


def write_table(name: str, rows: list[dict], args, against_titan: bool) -> None:
    def find(system, setting, fp8, batch, ac):
        return next(
            (
                r
                for r in rows
                if (r["system"], r["setting"], r["fp8"]) == (system, setting, fp8)
                and (r.get("batch"), r.get("ac")) == (batch, ac)
                and "tokens_per_s" in r
            ),
            None,
        )

    table = []
    for r in rows:
        titan = find("torchtitan", r["setting"], r["fp8"], r.get("batch"), r.get("ac"))
        bf16 = find(r["system"], r["setting"], "none", r.get("batch"), r.get("ac"))
        measured = "tokens_per_s" in r
        table.append(
            [
                r["setting"],
                r["system"] + (" (planner's layout)" if r.get("chosen_by") else ""),
                r.get("mode", ""),
                r["fp8"],
                r.get("ac", ""),
                f"{r.get('batch', '')} x {r.get('seq', '')}",
                r.get("tokens_per_s", r.get("error", "")),
                f"{r['mfu']:.1%}" if measured else "",
                r.get("peak_memory_gb", ""),
                f"{r['tokens_per_s'] / titan['tokens_per_s']:.3f}"
                if titan and measured and r["system"] == "hlat"
                else "",
                f"{r['tokens_per_s'] / bf16['tokens_per_s']:.3f}" if bf16 and measured and r["fp8"] != "none" else "",
                f"{r['loss'] / bf16['loss'] - 1:+.2%}" if bf16 and measured and r["fp8"] != "none" else "",
                r.get("planned_tokens_per_s") or "",
            ]
        )
    header = [
        "setting",
        "system",
        "precision",
        "fp8",
        "recompute",
        "batch x seq",
        "tokens/s",
        "MFU",
        "peak GB",
        "hlat / torchtitan",
        "FP8 / bf16",
        "loss vs bf16",
        "planner's tokens/s",
    ]
    keep = [i for i, h in enumerate(header) if any(row[i] != "" for row in table) or i < 9]
    if not against_titan:
        keep = [i for i in keep if header[i] != "hlat / torchtitan"]
    device = "CPU (the CPU mode)" if args.cpu else torch.cuda.get_device_name()
    meta = (
        f"{device}, torch {torch.__version__}, torchao {package_version('torchao')}, torchtitan "
        f"{package_version('torchtitan')}; median of {args.steps} steps after {args.warmup} warm-up steps on "
        "one random batch (the loss column: the loss after the same steps), each case in its own process, "
        "compiled blocks"
    )
    text = markdown_table([header[i] for i in keep], [[row[i] for i in keep] for row in table])
    (Path(args.out) / f"{name}.md").write_text(f"{meta}\n\n{text}\n")
    print(text, flush=True)


def installed(package: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(package) is not None


def package_version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "case":
        print(json.dumps(run_case(json.loads(sys.argv[2]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["speed", "7b", "figure"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="the CPU mode: tiny shapes, FP8 emulated, not compiled")
    ap.add_argument(
        "--budget-s",
        type=float,
        help="the part's time, cases beyond it skipped (default: "
        f"{', '.join(f'{part} {s} s' for part, s in BUDGET_S.items())})",
    )
    ap.add_argument("--case-timeout-s", type=float, default=120)
    ap.add_argument("--preflight-timeout-s", type=float, default=120)
    ap.add_argument("--steps", type=int, default=6, help="timed steps per case (after --warmup)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--figure-steps", type=int, default=200)
    ap.add_argument("--work-dir", default="/dev/shm/hlat-gpu-suite", help="the figure's run directories")
    args = ap.parse_args()
    args.budget_s = args.budget_s or BUDGET_S[args.part]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    {"speed": speed, "7b": seven_b, "figure": figure}[args.part](args)


if __name__ == "__main__":
    main()
