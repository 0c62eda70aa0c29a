"""hlat on one CUDA GPU: correctness against the CPU, then training-step throughput against torchtitan.

    python benchmarks/gpu_step.py check              # fp32 CUDA vs CPU trajectories; bf16 modes run
    python benchmarks/gpu_step.py bench [--settings 1b,7b] [--steps 10]
    python benchmarks/gpu_step.py attention          # SDPA backends at the 1b setting's shape

`bench` runs every (system, setting, compile) case in its own process (clean memory and compile caches) and
writes benchmarks/results/gpu_step.{json,md}; `check` writes gpu_check.{json,md}. Both systems run the same
Llama shapes, sequence length, micro-batch, precision and recomputation on random tokens (data loading is not
part of the step for either), with fused AdamW and gradient clipping, timed between CUDA synchronisations
after warm-up steps. torchtitan comes from its released wheel (its model, `apply_ac` and `apply_compile`).
MFU counts 6 x matmul parameters + 12 x layers x dim x seq FLOPs per token (both projects' formula) against
the H100/H200's 989 TFLOP/s dense bf16.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
from results_io import markdown_table, write_results  # noqa: E402

PEAK = 989e12
# The ~1B setting fills an 80 GB GPU in bf16 with fp32 master weights and no recomputation; llama2-7b fits one
# GPU only in pure bf16 (8 bytes per parameter) with full recomputation, so torchtitan runs there with its
# model cast to bf16 and plain AdamW (it has no pure-bf16 optimizer; its own path would be CPU offload).
SETTINGS = {
    "1b": dict(
        model=dict(family="llama", dim=2048, n_layers=16, n_heads=16, ffn_dim=5632, vocab_size=32000, max_seq_len=4096),
        seq=4096,
        batch=4,
        hlat_mode="bf16_mixed",
        titan_mode="bf16_mixed",
        ac="none",
    ),
    "7b": dict(
        model=dict(preset="llama2-7b"), seq=4096, batch=2, hlat_mode="bf16_sr", titan_mode="bf16_pure", ac="full"
    ),
}


def hlat_model_config(setting: dict):
    from hlat.models.config import model_config

    return model_config(**setting["model"])


def flops_per_token(setting: dict) -> float:
    return hlat_model_config(setting).flops_per_token(setting["seq"])


# --- the two systems' training steps --------------------------------------------------------------------------


def hlat_step(setting: dict, compile_: bool, device: torch.device, weights: dict | None = None):
    """hlat's single-process training step, built as `hlat train` builds it, from hlat's own initial weights or
    from `weights` (a state dict in hlat's names)."""
    from hlat.models import build_model
    from hlat.optim import OptimConfig
    from hlat.parallel import ParallelConfig, Topology
    from hlat.parallel.grads import global_grad_norm
    from hlat.train.assemble import Recipe, assemble
    from hlat.train.step import clipped_update

    cfg, mode = hlat_model_config(setting), setting["hlat_mode"]
    pcfg = ParallelConfig(activation_checkpoint=setting["ac"], compile=compile_).resolved(1)
    recipe = Recipe(mode, OptimConfig(), fp8=setting.get("fp8", "none"), fp8_emulated=device.type == "cpu")
    parts = assemble(build_model(cfg), Topology(pcfg, None), device, recipe)
    (model,), (optimizer,) = parts.parts, parts.optimizers
    if weights is not None:
        model.load_state_dict(weights)
    params = list(model.parameters())
    context = parts.autocast

    def step(inputs, targets):
        with context:
            loss = model(inputs, targets=targets)  # the trainer's loss: chunked per model.loss_chunk
        loss.backward()
        clipped_update([optimizer], global_grad_norm(params), 1.0)  # the trainer's clipping and update
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def titan_model(setting: dict, compile_: bool, device: torch.device):
    """torchtitan's Llama at the setting's shapes, with its own initial weights, recomputation and compile helpers.
    Its rotary table is left unscaled, as hlat's: torchtitan's Llama 3.1 default (the frequencies whose wavelength
    exceeds 8192 positions divided by 8) would make it another model, at the same cost."""
    from torchtitan.config.job_config import ActivationCheckpoint, Compile
    from torchtitan.distributed.activation_checkpoint import apply_ac
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs
    from torchtitan.models.llama3.infra.parallelize import apply_compile
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    m = hlat_model_config(setting)
    args = TransformerModelArgs(
        dim=m.dim,
        n_layers=m.n_layers,
        n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads or None,
        vocab_size=m.vocab_size,
        multiple_of=256,
        norm_eps=m.norm_eps,
        rope_theta=m.rope_theta,
        rope_scaling_args=RoPEScalingArgs(scaling_factor=1.0),
        max_seq_len=setting["seq"],
    )
    with torch.device("meta"):
        model = Transformer(args)
    if setting.get("fp8", "none") != "none":
        titan_fp8(model, setting["fp8"], emulate=device.type == "cpu")
    if setting["ac"] != "none":
        apply_ac(model, ActivationCheckpoint(mode=setting["ac"]), model_compile_enabled=compile_)
    if compile_:
        apply_compile(model, Compile(enable=True))
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


def titan_step(setting: dict, compile_: bool, device: torch.device, model: torch.nn.Module | None = None):
    """torchtitan's Llama (`model`, else a new `titan_model`) in the loop its trainer runs on one GPU: autocast bf16
    over fp32 weights (maybe_enable_amp), fused AdamW, clip_grad_norm_, fp32 cross-entropy; or all in bf16
    (`bf16_pure`) or fp32."""
    model = model if model is not None else titan_model(setting, compile_, device)
    mode = setting["titan_mode"]
    if mode == "bf16_pure":  # parameters only: the complex rotary table must stay complex
        freqs_cis = model.freqs_cis
        model.to(torch.bfloat16)
        model.freqs_cis = freqs_cis
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, fused=True
    )
    context = torch.autocast(device.type, dtype=torch.bfloat16, enabled=mode == "bf16_mixed")

    def step(inputs, targets):
        with context:
            logits = model(inputs)
        loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def titan_fp8(model, recipe: str, emulate: bool) -> None:
    """What torchtitan's Float8LinearConverter does on one GPU: every linear layer but the output projection (and
    any whose dimensions are not multiples of 16) becomes a torchao Float8Linear with the recipe's config, and
    under rowwise inductor emulates precision casts (pytorch/pytorch#150859)."""
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate)
    if recipe == "rowwise":
        torch._inductor.config.emulate_precision_casts = True
    convert_to_float8_training(
        model,
        config=config,
        module_filter_fn=lambda module, fqn: (
            fqn != "output" and (module.in_features % 16 == 0 and module.out_features % 16 == 0)
        ),
    )


def run_one(system: str, name: str, compile_: bool, steps: int, warmup: int, batch: int) -> dict:
    setting = {**SETTINGS[name], "batch": batch}
    device = torch.device("cuda")
    torch.manual_seed(0)
    row = {
        "system": system,
        "setting": name,
        "compile": compile_,
        "batch": batch,
        "seq": setting["seq"],
        "mode": setting[f"{'hlat' if system == 'hlat' else 'titan'}_mode"],
        "ac": setting["ac"],
    }
    try:
        step = (hlat_step if system == "hlat" else titan_step)(setting, compile_, device)
        vocab = hlat_model_config(setting).vocab_size
        tokens = torch.randint(0, vocab, (batch, setting["seq"] + 1), device=device)
        inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
        start = time.perf_counter()
        for _ in range(warmup):
            loss = step(inputs, targets)
        torch.cuda.synchronize()
        row["warmup_s"] = round(time.perf_counter() - start, 1)
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            loss = step(inputs, targets)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        times.sort()
        step_s = times[len(times) // 2]
        tps = batch * setting["seq"] / step_s
        row.update(
            step_s=round(step_s, 4),
            tokens_per_s=round(tps),
            mfu=round(tps * flops_per_token(setting) / PEAK, 4),
            peak_memory_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2),
            loss=round(loss.item(), 4),
        )
    except torch.OutOfMemoryError:
        row["error"] = "out of memory"
    except Exception as e:  # a benchmark row, not a crash: report what failed and carry on with the others
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return row


def bench(args) -> None:
    rows = []
    for name in args.settings.split(","):
        for compile_ in (False, True):
            for system in ("hlat", "torchtitan"):  # hlat first, then titan, per case: same GPU state for both
                cmd = [
                    sys.executable,
                    __file__,
                    "one",
                    system,
                    name,
                    str(int(compile_)),
                    str(args.steps),
                    str(args.warmup),
                    str(args.batch or SETTINGS[name]["batch"]),
                ]
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
                lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
                row = (
                    json.loads(lines[-1])
                    if lines
                    else {
                        "system": system,
                        "setting": name,
                        "compile": compile_,
                        "error": (done.stderr.strip().splitlines() or ["no output"])[-1][:200],
                    }
                )
                rows.append(row)
                print(json.dumps(row), flush=True)
    device = torch.cuda.get_device_name()
    table_rows = []
    for r in rows:
        other = next(
            (
                o
                for o in rows
                if o["setting"] == r["setting"] and o["compile"] == r["compile"] and o["system"] != r["system"]
            ),
            None,
        )
        ratio = (
            r["tokens_per_s"] / other["tokens_per_s"]
            if r["system"] == "hlat" and other and "tokens_per_s" in r and "tokens_per_s" in other
            else None
        )
        table_rows.append(
            [
                r["setting"],
                r["system"],
                r.get("mode", ""),
                r.get("ac", ""),
                "yes" if r["compile"] else "no",
                f"{r.get('batch', '')} x {r.get('seq', '')}",
                r.get("tokens_per_s", r.get("error", "")),
                f"{r['mfu']:.1%}" if "mfu" in r else "",
                r.get("peak_memory_gb", ""),
                f"{ratio:.3f}" if ratio else "",
            ]
        )
    table = markdown_table(
        [
            "setting",
            "system",
            "precision",
            "recompute",
            "compile",
            "batch x seq",
            "tokens/s",
            "MFU",
            "peak GB",
            "hlat / torchtitan",
        ],
        table_rows,
    )
    meta = {
        "device": device,
        "torch": torch.__version__,
        "torchtitan": _titan_version(),
        "steps": args.steps,
        "warmup": args.warmup,
        "statistic": "median step after warm-up",
        "peak_flops": PEAK,
    }
    write_results(
        "gpu_step",
        meta,
        rows,
        f"Training step on one {device} (torch {torch.__version__}, torchtitan {meta['torchtitan']}): "
        f"median of {args.steps} steps after {args.warmup} warm-up steps, each case in its own process. "
        "1b: dim 2048, 16 layers, 16 heads, ffn 5632, vocab 32000 (1.0B parameters). 7b: llama2-7b; "
        "hlat in pure bf16 with stochastic rounding (BF16AdamW), torchtitan's model cast to bf16 with "
        "plain AdamW (torchtitan has no pure-bf16 optimizer).",
        table,
    )


def _titan_version() -> str:
    try:
        from importlib.metadata import version

        return version("torchtitan")
    except Exception:
        return "unknown"


# --- correctness --------------------------------------------------------------------------------------------


def trajectory(preset: str, mode: str, device: torch.device, steps: int, batch: int = 4, seq: int = 256) -> dict:
    """Loss and grad norm per step over a fixed cycle of 4 random batches (so the loss falls as the model
    memorises them), from the same initial weights on any device. Mode "fp64" is the reference: the fp32 model
    and its loss in float64."""
    from hlat.models import build_model
    from hlat.models.config import model_config
    from hlat.optim import OptimConfig
    from hlat.optim.precision import autocast
    from hlat.parallel import ParallelConfig, Topology
    from hlat.parallel.grads import global_grad_norm
    from hlat.train.assemble import Recipe, assemble
    from hlat.train.step import clipped_update

    cfg, fp64 = model_config(preset), mode == "fp64"
    mode = "fp32" if fp64 else mode
    generator = torch.Generator().manual_seed(0)
    data = [torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=generator) for _ in range(4)]
    recipe = Recipe(mode, OptimConfig(lr=1e-3, warmup_steps=0))
    parts = assemble(build_model(cfg), Topology(ParallelConfig().resolved(1), None), device, recipe)
    (model,), (optimizer,) = parts.parts, parts.optimizers
    if fp64:
        model.double()  # in place: the optimizer keeps the same parameters
    params = list(model.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    losses, norms = [], []
    for i in range(steps):
        tokens = data[i % 4].to(device)
        with autocast(mode, device):  # the reference's loss: F.cross_entropy of the float64 logits
            loss = (
                F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
                if fp64
                else model(tokens[:, :-1], targets=tokens[:, 1:])
            )
        loss.backward()
        if fp64:
            norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
        else:  # the trainer's clipping and update
            norm = global_grad_norm(params)
            clipped_update([optimizer], norm, 1.0)
        norms.append(norm.item())
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else 0.0
    return {"losses": losses, "grad_norms": norms, "peak_memory_gb": peak}


def rel_dev(run: dict, ref: dict) -> float:
    """Largest relative deviation of loss or grad norm over the steps."""
    return max(abs(x - y) / abs(y) for key in ("losses", "grad_norms") for x, y in zip(run[key], ref[key]))


def compiled_update_mismatch(rounding: str) -> float:
    """How far BF16AdamW's compiled CUDA update is from its eager one after 3 steps (each with a clip coefficient,
    as the trainer passes it): the fraction of stored elements that differ. Both draw the same counter-based bits;
    Triton's fp32 division and square root may differ from ATen's by an ulp, which changes a rounding decision only
    for a value at a rounding boundary. For kahan the weights are compared by the value they represent (weight +
    compensation), relative to it."""
    import hlat.optim.bf16 as bf16

    results = []
    for compiled_devices in (("cuda",), ()):
        bf16.COMPILED_UPDATE_DEVICES = compiled_devices
        torch.manual_seed(0)
        params = [
            torch.nn.Parameter(torch.randn(shape, device="cuda").to(torch.bfloat16))
            for shape in ((2048, 1536), (1000,), (777, 13))
        ]
        optimizer = bf16.BF16AdamW(params, lr=1e-3, weight_decay=0.1, rounding=rounding, seed=1)
        for _ in range(3):
            for p in params:
                p.grad = (torch.randn(p.shape, device="cuda") * 1e-2).to(torch.bfloat16)
            optimizer.step(grad_scale=torch.tensor(0.7, device="cuda"))
        state = [optimizer.state[p] for p in params]
        results.append(
            {
                "weights": [
                    p.detach().float() + (s["compensation"].float() if rounding == "kahan" else 0)
                    for p, s in zip(params, state)
                ],
                "moments": [s[k] for s in state for k in ("exp_avg", "exp_avg_sq")],
            }
        )
    bf16.COMPILED_UPDATE_DEVICES = ("cuda",)
    compiled, eager = results
    numel = sum(t.numel() for t in compiled["weights"] + compiled["moments"])
    if rounding == "kahan":  # represented values within 2^-16 of each other count as equal
        differing = sum(
            int(((a - b).abs() > 2**-16 * b.abs()).sum()) for a, b in zip(compiled["weights"], eager["weights"])
        )
    else:
        differing = sum(int((a != b).sum()) for a, b in zip(compiled["weights"], eager["weights"]))
    differing += sum(int((a != b).sum()) for a, b in zip(compiled["moments"], eager["moments"]))
    return differing / numel


def check(args) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 means fp32 on both devices
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    rows, ok = [], True
    for preset in ("tiny", "small"):
        exact = trajectory(preset, "fp64", cpu, args.steps)
        on_cpu = trajectory(preset, "fp32", cpu, args.steps)
        on_cuda = trajectory(preset, "fp32", cuda, args.steps)
        cpu_dev, cuda_dev = rel_dev(on_cpu, exact), rel_dev(on_cuda, exact)
        # fp32 on CUDA is as far from float64 as fp32 on the CPU is (other reduction orders, same precision);
        # Adam's sign-like first steps amplify rounding, so the bound is what the CPU itself shows, not a constant
        passed = cuda_dev <= 4 * cpu_dev + 1e-6
        ok &= passed
        rows.append(
            {
                "model": preset,
                "mode": "fp32",
                "reference": "CPU float64",
                "max_rel_dev": cuda_dev,
                "cpu_fp32_rel_dev": cpu_dev,
                "first_loss": on_cuda["losses"][0],
                "last_loss": on_cuda["losses"][-1],
                "peak_memory_gb": on_cuda["peak_memory_gb"],
                "pass": passed,
            }
        )
        for mode in ("bf16_mixed", "bf16_sr", "bf16_kahan"):
            run = trajectory(preset, mode, cuda, args.steps)
            finite = all(map(lambda x: x == x and abs(x) < float("inf"), run["losses"]))
            learned = run["losses"][0] - run["losses"][-1]
            # bf16 keeps 8 mantissa bits: not the fp32 trajectory, but most of its decrease
            passed = finite and learned > 0.5 * (on_cuda["losses"][0] - on_cuda["losses"][-1])
            ok &= passed
            rows.append(
                {
                    "model": preset,
                    "mode": mode,
                    "reference": "CUDA fp32",
                    "max_rel_dev": rel_dev(run, on_cuda) if finite else float("nan"),
                    "cpu_fp32_rel_dev": None,
                    "first_loss": run["losses"][0],
                    "last_loss": run["losses"][-1],
                    "peak_memory_gb": run["peak_memory_gb"],
                    "pass": passed,
                }
            )
        print(json.dumps(rows[-4:]), flush=True)
    for rounding in ("stochastic", "kahan", "nearest"):
        differing = compiled_update_mismatch(rounding)
        passed = differing < 1e-4  # seen: 6e-6 (stochastic), 2e-5 (nearest) of elements on an H100
        ok &= passed
        rows.append(
            {
                "model": "BF16AdamW, 3 steps of 4M elements",
                "mode": rounding,
                "reference": "eager on CUDA",
                "max_rel_dev": differing,
                "cpu_fp32_rel_dev": None,
                "first_loss": float("nan"),
                "last_loss": float("nan"),
                "peak_memory_gb": 0.0,
                "pass": passed,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    device = torch.cuda.get_device_name()
    table = markdown_table(
        [
            "model",
            "mode",
            "reference",
            "max rel. deviation (loss, grad norm)",
            "CPU fp32's deviation",
            "first loss",
            "last loss",
            "peak GB",
            "pass",
        ],
        [
            [
                r["model"],
                r["mode"],
                r["reference"],
                f"{r['max_rel_dev']:.2e}",
                f"{r['cpu_fp32_rel_dev']:.2e}" if r["cpu_fp32_rel_dev"] is not None else "",
                f"{r['first_loss']:.4f}",
                f"{r['last_loss']:.4f}",
                f"{r['peak_memory_gb']:.3f}",
                r["pass"],
            ]
            for r in rows
        ],
    )
    write_results(
        "gpu_check",
        {"device": device, "torch": torch.__version__, "steps": args.steps},
        rows,
        f"hlat on {device} (torch {torch.__version__}): {args.steps} training steps, batch 4 x 256, over a "
        "cycle of 4 random batches, from the same initial weights. fp32 on CUDA (TF32 off) against a "
        "float64 run on the CPU: pass when its deviation is at most 4x that of fp32 on the CPU. bf16 modes "
        "on CUDA against fp32 on CUDA: pass when finite and the loss falls by at least half as much.",
        table,
    )
    print("CUDA check", "PASSED" if ok else "FAILED")
    sys.exit(0 if ok else 1)


def attention(args) -> None:
    """Causal bf16 SDPA per backend at the 1b setting's shape: forward + backward time, and the error of its
    output and input gradients against float64 math attention (each backend should be near bf16's 2^-8)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    s = SETTINGS["1b"]
    b, h, seq, d = s["batch"], s["model"]["n_heads"], s["seq"], s["model"]["dim"] // s["model"]["n_heads"]
    q, k, v = (torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad_out = torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v)]
    with sdpa_kernel(SDPBackend.MATH):
        ref_out = F.scaled_dot_product_attention(*exact, is_causal=True)
    ref_out.backward(grad_out.double())
    refs = [ref_out.detach()] + [t.grad for t in exact]
    flops = 4 * b * h * seq * seq * d * 3.5 / 2  # forward 2 matmuls, backward 5 (2.5x), causal half
    for backend in (None, SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:  # None: the backend torch picks by itself, as hlat's model runs it
            with sdpa_kernel(backend) if backend else contextlib.nullcontext():
                q.grad = k.grad = v.grad = None
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                out.backward(grad_out)
                errors = [
                    ((got.double() - ref).norm() / ref.norm()).item()
                    for got, ref in zip([out.detach(), q.grad, k.grad, v.grad], refs)
                ]
                for _ in range(3):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad_out)
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(20):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad_out)
                torch.cuda.synchronize()
            ms = (time.perf_counter() - t0) / 20 * 1e3
            print(
                f"{backend.name if backend else 'default':>20}: {ms:7.3f} ms fwd+bwd  "
                f"{flops / ms / 1e9:6.1f} TFLOP/s   rel. error vs float64 "
                f"out {errors[0]:.2e} dq {errors[1]:.2e} dk {errors[2]:.2e} dv {errors[3]:.2e}",
                flush=True,
            )
        except RuntimeError as e:
            print(
                f"{backend.name if backend else 'default':>20}: unavailable ({str(e).splitlines()[0][:100]})",
                flush=True,
            )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "one":
        system, name, compile_, steps, warmup, batch = sys.argv[2:8]
        print(json.dumps(run_one(system, name, compile_ == "1", int(steps), int(warmup), int(batch))), flush=True)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("check")
    c.add_argument("--steps", type=int, default=8)
    b = sub.add_parser("bench")
    b.add_argument("--settings", default="1b,7b")
    b.add_argument("--steps", type=int, default=10)
    b.add_argument("--warmup", type=int, default=4)
    b.add_argument("--batch", type=int, default=0, help="micro-batch (default: the setting's)")
    b.add_argument("--timeout", type=int, default=400)
    sub.add_parser("attention")
    args = ap.parse_args()
    {"check": check, "bench": bench, "attention": attention}[args.cmd](args)


if __name__ == "__main__":
    main()
