"""hlat against torchtitan's Llama on the CPU: from the same weights, is "the same settings" the same arithmetic?
And from each system's own initial weights, what do the two initialisations do to the loss?

    PYTHONPATH=<torchtitan's wheel and what it needs> python benchmarks/titan_parity.py [--steps 9]

Both systems take the GPU suite's steps (gpu_step.hlat_step and titan_step: AdamW at lr 3e-4, weight decay 0.1,
clipping at 1) on one random batch, as its speed part does, and log each step's loss.

`same weights`: torchtitan's initial weights loaded into hlat's model, at a mid-sized Llama (dim 1024, 4 layers,
the 1B setting's vocabulary), in fp32 and in bf16_mixed. torchtitan rotates the adjacent dimensions (2j, 2j+1) of a
head, hlat dimension j with j + head_dim/2, so the rows of wq and wk are reordered inside each head.
`own init`: the 1B setting's shapes (at a shorter sequence, for the CPU) in bf16_mixed, each from its own init:
hlat's is HLAT's (normal 0.02 everywhere, residual output projections 0.02 / sqrt(2 x layers)); torchtitan's
draws the embedding from normal(0, 1), the output layer from a truncated normal(0, dim^-0.5) and scales w2, w3
and wo by depth.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))
import gpu_step  # noqa: E402
from gpu_suite import install_titan_stubs  # noqa: E402
from results_io import markdown_table, write_results  # noqa: E402

CPU = torch.device("cpu")
MID = dict(
    model=dict(family="llama", dim=1024, n_layers=4, n_heads=8, ffn_dim=2816, vocab_size=32000, max_seq_len=512),
    seq=512,
    batch=2,
    ac="none",
)
ONE_B = {**gpu_step.SETTINGS["1b"], "seq": 512, "batch": 2}


def titan_to_hlat(state: dict, head_dim: int) -> dict:
    """hlat's state dict from torchtitan's (the same names): q and k rows reordered from torchtitan's adjacent
    rotary pairs to hlat's halves; the rotary table, which hlat derives from its config, left out."""
    order = torch.cat([torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)])
    out = {}
    for key, value in state.items():
        if key == "freqs_cis":
            continue
        if key.endswith(("attention.wq.weight", "attention.wk.weight")):
            value = value.unflatten(0, (-1, head_dim))[:, order].flatten(0, 1)
        out[key] = value.detach().clone()
    return out


def losses(step, setting: dict, steps: int) -> list[float]:
    """Each step's loss on one random batch (the same batch for every run: generator seeded alike)."""
    vocab = gpu_step.hlat_model_config(setting).vocab_size
    tokens = torch.randint(0, vocab, (setting["batch"], setting["seq"] + 1), generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    out = []
    for i in range(steps):
        out.append(step(inputs, targets).item())
        print(f"  step {i + 1}/{steps}: loss {out[-1]:.4f}", flush=True)
    return out


def same_weights(mode: str, steps: int) -> dict:
    setting = {**MID, "hlat_mode": mode, "titan_mode": mode}
    torch.manual_seed(0)
    titan = gpu_step.titan_model(setting, False, CPU)
    weights = titan_to_hlat(titan.state_dict(), gpu_step.hlat_model_config(setting).head_dim)
    print(f"same weights, {mode}: torchtitan", flush=True)
    theirs = losses(gpu_step.titan_step(setting, False, CPU, model=titan), setting, steps)
    del titan
    print(f"same weights, {mode}: hlat", flush=True)
    ours = losses(gpu_step.hlat_step(setting, False, CPU, weights=weights), setting, steps)
    deviation = max(abs(a - b) / abs(b) for a, b in zip(ours, theirs))
    return {
        "case": "same weights",
        "shape": "mid",
        "mode": mode,
        "hlat": ours,
        "torchtitan": theirs,
        "max_rel_dev": deviation,
    }


def own_init(steps: int) -> dict:
    setting = {**ONE_B, "hlat_mode": "bf16_mixed", "titan_mode": "bf16_mixed"}
    runs = {}
    for system, build in (("hlat", gpu_step.hlat_step), ("torchtitan", gpu_step.titan_step)):
        print(f"own init, bf16_mixed: {system}", flush=True)
        torch.manual_seed(0)
        runs[system] = losses(build(setting, False, CPU), setting, steps)
    return {"case": "own init", "shape": "1b", "mode": "bf16_mixed", **runs}


def write(rows: list[dict], meta: dict) -> None:
    shapes = {"mid": MID, "1b": ONE_B}
    table = markdown_table(
        ["case", "model", "precision", "step", "hlat loss", "torchtitan loss", "hlat / torchtitan - 1"],
        [
            [
                r["case"],
                "dim {dim}, {n_layers} layers, vocab {vocab_size}".format(**shapes[r["shape"]]["model"])
                + f", {shapes[r['shape']]['batch']} x {shapes[r['shape']]['seq']} tokens",
                r["mode"],
                i + 1,
                f"{a:.5f}",
                f"{b:.5f}",
                f"{a / b - 1:+.2e}" if r["case"] == "same weights" else "",
            ]
            for r in rows
            for i, (a, b) in enumerate(zip(r["hlat"], r["torchtitan"]))
            if i in (0, 1, 2, len(r["hlat"]) - 1)
        ],
    )
    largest = ", ".join(f"{r['mode']} {r['max_rel_dev']:.1e}" for r in rows if r["case"] == "same weights")
    write_results(
        "titan_parity",
        meta,
        rows,
        f"hlat against torchtitan {meta['torchtitan']} on the CPU (torch {meta['torch']}, {meta['threads']} "
        f"threads), `python benchmarks/titan_parity.py`: the loss of steps 1-3 and {meta['steps']} on one "
        "random batch. Same weights: torchtitan's initial weights in both models; the largest relative "
        f"difference over the {meta['steps']} steps: {largest}. Own init: each system's.",
        table,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9, help="steps per run (the speed part's warm-up + timed: 9)")
    args = parser.parse_args()
    install_titan_stubs()
    rows = [same_weights("fp32", args.steps), same_weights("bf16_mixed", args.steps), own_init(args.steps)]
    from importlib.metadata import version

    write(
        rows,
        {
            "device": "cpu",
            "torch": torch.__version__,
            "torchtitan": version("torchtitan"),
            "steps": args.steps,
            "threads": torch.get_num_threads(),
        },
    )


if __name__ == "__main__":
    main()
