"""Training-step throughput (forward, backward, AdamW) of hlat's models against transformers' models of the
same configuration, on this machine. Interleaves the two implementations so machine noise hits both alike.

    .venv/bin/python benchmarks/step_vs_transformers.py [--size small] [--batch 2] [--seq-len 256] [--steps 3]
"""

from __future__ import annotations

import argparse
import platform
import time

import torch
import torch.nn.functional as F
import transformers
from results_io import markdown_table, write_results

from hlat.models import build_model, materialize
from hlat.models.config import model_config
from hlat.models.hf import model_config_to_hf_config


def hf_model(cfg):
    hf_cfg = model_config_to_hf_config(cfg)
    config_cls = transformers.AutoConfig.for_model(hf_cfg.pop("model_type"), **hf_cfg)
    return transformers.AutoModelForCausalLM.from_config(config_cls, attn_implementation="sdpa")


def step_fn(model, is_hf):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, foreach=True)

    def step(tokens):
        logits = model(tokens).logits if is_hf else model(tokens)
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=["tiny", "small"])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3, help="measured steps per implementation (after 1 warm-up)")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for preset in (args.size, f"{args.size}-neox"):
        cfg = model_config(preset)
        tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len))
        steps = {
            "hlat": step_fn(materialize(build_model(cfg), "cpu"), False),
            "transformers": step_fn(hf_model(cfg), True),
        }
        for fn in steps.values():
            fn(tokens)  # warm-up
        times = {name: [] for name in steps}
        for _ in range(args.steps):
            for name, fn in steps.items():
                start = time.perf_counter()
                fn(tokens)
                times[name].append(time.perf_counter() - start)
        tps = {name: args.batch * args.seq_len / min(t) for name, t in times.items()}
        rows.append(
            {
                "model": preset,
                "params": cfg.num_params(),
                "hlat_tokens_per_s": round(tps["hlat"], 1),
                "transformers_tokens_per_s": round(tps["transformers"], 1),
                "ratio": round(tps["hlat"] / tps["transformers"], 3),
            }
        )
        print(
            f"{preset:>12}  hlat {tps['hlat']:8.1f} tok/s   transformers {tps['transformers']:8.1f} tok/s   "
            f"ratio {tps['hlat'] / tps['transformers']:.3f}",
            flush=True,
        )
    meta = {
        "machine": platform.processor() or platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "measured_steps": args.steps,
        "statistic": "best step",
    }
    table = markdown_table(
        ["model", "params", "hlat tok/s", "transformers tok/s", "hlat / transformers"],
        [
            [r["model"], f"{r['params']:,}", r["hlat_tokens_per_s"], r["transformers_tokens_per_s"], r["ratio"]]
            for r in rows
        ],
    )
    write_results(
        "step_vs_transformers",
        meta,
        rows,
        f"Training step (forward, backward, AdamW), batch {args.batch} x {args.seq_len}, CPU, "
        f"{meta['threads']} threads, torch {meta['torch']}, transformers {meta['transformers']}; best of "
        f"{args.steps} steps each, interleaved.",
        table,
    )


if __name__ == "__main__":
    main()
