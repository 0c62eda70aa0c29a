"""The prepared GPU suite: one unattended command that measures on a lent GPU what the CPU cannot, and writes every
result into one folder to bring back.

    bash benchmarks/gpu_suite.sh OUT [PART ...]          # on the GPU machine (installs the wheels carried in .whl/)
    python benchmarks/gpu_suite.py speed --out DIR       # one part, here
    python benchmarks/gpu_suite.py speed --out DIR --cpu # the CPU mode: tiny shapes, FP8 emulated (make test runs it)

Part `speed`: hlat against torchtitan (its released wheel, on the device's torch) at the same model, shapes,
batch, precision and recomputation, compiled, each case in its own process: the 1B setting in bf16 and in FP8
tensorwise and rowwise, and llama2-7b in pure bf16 (benchmarks/gpu_step.py builds both systems' steps); then a
profile of hlat's 1B bf16 step (where the time goes, by kernel) and `hlat preflight` at the 1B setting's shapes
with FP8, whose profile `hlat plan` reads. Cases run in order of importance and each is cut off where the part's
budget would be exceeded, so a short lease still brings back the first ones.

Results (DIR): speed.jsonl (a row per case, as it finishes), speed.md (the table, hlat over torchtitan and FP8 over
bf16), profile_1b.txt, preflight_1b.toml and preflight_1b.json, suite.log (the shell entry point's).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import gpu_step  # noqa: E402
from results_io import markdown_table  # noqa: E402

# The CPU mode's setting: the suite's code paths at a size a CPU runs in seconds (FP8 emulated, not compiled).
TINY = dict(model=dict(family="llama", dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=512, max_seq_len=64),
            seq=64, batch=2, hlat_mode="bf16_mixed", titan_mode="bf16_mixed", ac="none")
SPEED_CASES = [  # (system, setting, fp8 recipe), most important first; "preflight" runs hlat preflight there
    ("hlat", "1b", "none"), ("hlat", "1b", "tensorwise"), ("torchtitan", "1b", "none"),
    ("torchtitan", "1b", "tensorwise"), ("hlat", "1b", "rowwise"), "preflight", ("torchtitan", "1b", "rowwise"),
    ("hlat", "7b", "none"), ("torchtitan", "7b", "none"),
]


def settings(cpu: bool) -> dict:
    return {name: TINY for name in gpu_step.SETTINGS} if cpu else gpu_step.SETTINGS


def install_titan_stubs() -> None:
    """torchtitan's model package imports its Hugging Face data loader, which imports `datasets`; the suite never
    loads data through torchtitan, so where `datasets` is not installed two empty modules stand in for it."""
    try:
        import datasets  # noqa: F401
    except ImportError:
        import types

        stub, distributed = types.ModuleType("datasets"), types.ModuleType("datasets.distributed")
        stub.Dataset, stub.load_dataset, distributed.split_dataset_by_node = object, None, None
        sys.modules.update({"datasets": stub, "datasets.distributed": distributed})


def run_case(spec: dict) -> dict:
    """One case in this process: warm-up steps, then the median step time of `steps` timed steps."""
    device = torch.device("cpu" if spec["cpu"] else "cuda")
    setting = {**settings(spec["cpu"])[spec["setting"]], "fp8": spec["fp8"]}
    torch.manual_seed(0)
    row = {k: spec[k] for k in ("system", "setting", "fp8")} | {"batch": setting["batch"], "seq": setting["seq"],
                                                              "ac": setting["ac"], "compile": not spec["cpu"]}
    row["mode"] = setting["hlat_mode" if spec["system"] == "hlat" else "titan_mode"]
    if spec["system"] == "torchtitan":
        install_titan_stubs()
    try:
        build = gpu_step.hlat_step if spec["system"] == "hlat" else gpu_step.titan_step
        step = build(setting, not spec["cpu"], device)
        vocab = gpu_step.hlat_model_config(setting).vocab_size
        tokens = torch.randint(0, vocab, (setting["batch"], setting["seq"] + 1), device=device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        row.update(time_steps(step, inputs, targets, spec["warmup"], spec["steps"], device, spec.get("profile")))
        row["mfu"] = round(row["tokens_per_s"] * gpu_step.flops_per_token(setting) / gpu_step.PEAK, 4)
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as e:  # a row, not a crash: the other cases still run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return row


def time_steps(step, inputs, targets, warmup: int, steps: int, device: torch.device, profile: str | None) -> dict:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    start = time.perf_counter()
    for _ in range(warmup):
        loss = step(inputs, targets)
    sync()
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step(inputs, targets)
        sync()
        times.append(time.perf_counter() - t0)
    step_s = sorted(times)[len(times) // 2]
    if profile:
        write_profile(step, inputs, targets, device, Path(profile))
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0
    return {"warmup_s": round(warmup_s, 1), "step_s": round(step_s, 4),
            "tokens_per_s": round(inputs.numel() / step_s), "peak_memory_gb": round(peak, 2),
            "loss": round(loss.item(), 4), "steps_run": warmup + steps}


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


def speed(args) -> None:
    out, started = Path(args.out), time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    steps, warmup = (2, 1) if args.cpu else (args.steps, args.warmup)
    rows = []
    for case in SPEED_CASES:
        left = args.budget_s - (time.monotonic() - started)
        if case == "preflight":
            if left > 60:
                preflight(out, args.cpu, min(left - 30, args.preflight_timeout_s))
            continue
        system, setting, fp8 = case
        if left < 30:
            rows.append({"system": system, "setting": setting, "fp8": fp8, "error": "skipped: the part's budget"})
            continue
        spec = {"system": system, "setting": setting, "fp8": fp8, "cpu": args.cpu, "steps": steps, "warmup": warmup}
        if (system, setting, fp8) == ("hlat", "1b", "none"):
            spec["profile"] = str(out / "profile_1b.txt")
        rows.append(run_in_process(spec, min(args.case_timeout_s, left)))
        with open(out / "speed.jsonl", "a") as f:
            f.write(json.dumps(rows[-1]) + "\n")
        print(json.dumps(rows[-1]), flush=True)
    write_speed_table(rows, out, args)


def run_in_process(spec: dict, timeout: float) -> dict:
    """A case in a fresh process (its own memory and compile caches); a crash or a timeout is the row's error."""
    cmd = [sys.executable, __file__, "case", json.dumps(spec)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {**{k: spec[k] for k in ("system", "setting", "fp8")}, "error": f"timed out after {timeout:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if lines:
        return json.loads(lines[-1])
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:300]
    return {**{k: spec[k] for k in ("system", "setting", "fp8")}, "error": f"exit {done.returncode}: {tail}"}


def write_speed_table(rows: list[dict], out: Path, args) -> None:
    def find(system, setting, fp8):
        return next((r for r in rows if (r["system"], r["setting"], r["fp8"]) == (system, setting, fp8)
                     and "tokens_per_s" in r), None)

    table = []
    for r in rows:
        titan, bf16 = find("torchtitan", r["setting"], r["fp8"]), find(r["system"], r["setting"], "none")
        vs_titan = (f"{r['tokens_per_s'] / titan['tokens_per_s']:.3f}"
                    if r["system"] == "hlat" and titan and "tokens_per_s" in r else "")
        vs_bf16 = f"{r['tokens_per_s'] / bf16['tokens_per_s']:.3f}" if r["fp8"] != "none" and bf16 and "tokens_per_s" in r else ""
        loss_vs_bf16 = (f"{r['loss'] / bf16['loss'] - 1:+.2%}" if r["fp8"] != "none" and bf16 and "loss" in r else "")
        table.append([r["setting"], r["system"], r.get("mode", ""), r["fp8"], r.get("ac", ""),
                      f"{r.get('batch', '')} x {r.get('seq', '')}", r.get("tokens_per_s", r.get("error", "")),
                      f"{r['mfu']:.1%}" if "mfu" in r else "", r.get("peak_memory_gb", ""), vs_titan, vs_bf16,
                      loss_vs_bf16])
    header = ["setting", "system", "precision", "fp8", "recompute", "batch x seq", "tokens/s", "MFU", "peak GB",
              "hlat / torchtitan", "FP8 / bf16", "loss vs bf16"]
    device = "CPU (CPU mode)" if args.cpu else torch.cuda.get_device_name()
    meta = (f"{device}, torch {torch.__version__}, torchao {version('torchao')}, torchtitan {version('torchtitan')}; "
            f"median of {args.steps} steps after {args.warmup} warm-up steps on one random batch (the loss column "
            "compares the loss after the same steps), each case in its own process, compiled blocks")
    (out / "speed.md").write_text(f"{meta}\n\n{markdown_table(header, table)}\n")
    print((out / "speed.md").read_text(), flush=True)


def preflight(out: Path, cpu: bool, timeout: float) -> None:
    """`hlat preflight` at the 1B setting's shapes, bf16 and FP8 matmuls (FP8 only where the device has it)."""
    model = gpu_step.SETTINGS["1b"]["model"] if not cpu else TINY["model"]
    seq, batch = (64, 2) if cpu else (4096, 4)
    overrides = [a for k, v in model.items() for a in (f"--model.{k}", str(v))]
    cmd = [sys.executable, "-m", "hlat", "preflight", *overrides, "--train.seq_len", str(seq), "--train.micro_batch",
           str(batch), "--precision.mode", "bf16_mixed", "--dtypes", "bf16", "--fp8", "tensorwise,rowwise",
           "--json", "--out", str(out / "preflight_1b.toml")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        (out / "preflight_1b.json").write_text(done.stdout or done.stderr[-3000:])
        print("preflight:", "ok" if done.returncode == 0 else done.stderr[-500:], flush=True)
    except subprocess.TimeoutExpired:
        print(f"preflight: timed out after {timeout:.0f} s", flush=True)


def version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(package)
    except PackageNotFoundError:
        return "not installed"


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "case":
        print(json.dumps(run_case(json.loads(sys.argv[2]))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", choices=["speed"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--cpu", action="store_true", help="the CPU mode: tiny shapes, FP8 emulated, not compiled")
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--case-timeout-s", type=float, default=120)
    ap.add_argument("--preflight-timeout-s", type=float, default=120)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=3)
    args = ap.parse_args()
    {"speed": speed}[args.part](args)


if __name__ == "__main__":
    main()
