"""Training stall per checkpoint: synchronous save against asynchronous save (train.async_checkpoint).

For each mode the same model and AdamW state (after one step) are saved `--repeats` times through the
trainer's own DurableTier. The stall is the time `save` holds the training loop: the whole write and commit
when synchronous; the copy to host memory (pinned on CUDA) when asynchronous, whose write then overlaps
`--work-s` seconds of stand-in training work (sleeping, as a device would while the host writes) before it is
committed. Ratios are within one run: this machine is shared and absolute times are noisy.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from results_io import markdown_table, write_results  # noqa: E402

from hlat.checkpoint.background import BackgroundWriter  # noqa: E402
from hlat.checkpoint.durable import DurableTier  # noqa: E402
from hlat.checkpoint.state import TrainState  # noqa: E402
from hlat.models import build_model, count_params, materialize  # noqa: E402
from hlat.models.config import preset_config  # noqa: E402
from hlat.optim import build_optimizer  # noqa: E402
from hlat.optim.config import OptimConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--work-s", type=float, default=10.0, help="stand-in training time between saves")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = preset_config(args.model)
    model = materialize(build_model(cfg), device)
    optimizer = build_optimizer(model, OptimConfig())
    model(torch.zeros(1, 8, dtype=torch.long, device=device)).float().mean().backward()
    optimizer.step()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            writer = BackgroundWriter(device.type == "cuda", None, dcp_format=True) if mode == "async" else None
            ckpt = DurableTier(Path(tmp) / mode, keep=1, rank=0, config_toml="", writer=writer)
            stalls, totals = [], []
            for i in range(args.repeats):
                start = time.perf_counter()
                ckpt.save(i + 1, TrainState([model], [optimizer], None, step=i + 1).state_dict(), start)
                stalls.append(time.perf_counter() - start)
                if mode == "async":
                    time.sleep(args.work_s)
                    ckpt.finish()
                totals.append(time.perf_counter() - start - (args.work_s if mode == "async" else 0))
            ckpt.close()
            rows.append(
                {
                    "mode": mode,
                    "stall_s": statistics.median(stalls),
                    "stalls_s": stalls,
                    "save_s_outside_work": statistics.median(totals),
                }
            )
    sync_s = rows[0]["stall_s"]
    for r in rows:
        r["stall_vs_sync_save"] = r["stall_s"] / sync_s
    meta = {
        "model": args.model,
        "params": count_params(model),
        "device": str(device),
        "repeats": args.repeats,
        "work_s": args.work_s,
        "torch": torch.__version__,
    }
    caption = (
        f"Training stall per checkpoint, {args.model} ({meta['params']:,} parameters, fp32 weights + AdamW "
        f"state) on {device}; median of {args.repeats} saves each (benchmarks/checkpoint_stall.py). "
        "Asynchronous: the stall is the copy to host memory; the write overlaps training."
    )
    table = markdown_table(
        ["mode", "stall per checkpoint (s)", "stall / synchronous save"],
        [[r["mode"], f"{r['stall_s']:.3f}", f"{r['stall_vs_sync_save']:.1%}"] for r in rows],
    )
    write_results("checkpoint_stall" + ("_gpu" if device.type == "cuda" else ""), meta, rows, caption, table)


if __name__ == "__main__":
    main()
