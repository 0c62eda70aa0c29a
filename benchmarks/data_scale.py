"""The global data stream at 1, 2 and 4 data-parallel ranks (CPU processes over gloo, as the trainer runs them):
tokens each rank tokenized, loader tokens/s per rank, token-id bytes each rank received per step, and the size of
the loader state each rank saves, at sequence length 4096.

    .venv/bin/python benchmarks/data_scale.py [--steps 256] [--dp 1,2,4] [--workers 1]

Text: the Python standard library as JSON lines. Tokenizer: GPT-2 from shared/data/tokenizers when present,
else a byte-level BPE (vocab 8192) trained on the text. Each rank has its own tokenizer workers. The runs share
one machine: on one with fewer cores than ranks x workers, tokens/s per rank falls with dp for want of CPUs, not
for the loader; the totals and the exchanged bytes do not depend on the machine. Writes
benchmarks/results/data_scale.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from results_io import markdown_table, write_results

from hlat.data.config import DataConfig
from hlat.data.packing import Ranks, build_stream
from hlat.data.readers import iter_documents
from hlat.data.sources import default_corpus, one_source
from hlat.data.tokenizer import load_tokenizer, train_bpe, training_sample
from hlat.groups import side_group

GPT2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "gpt2"
SEQ_LEN, GLOBAL_BATCH = 4096, 8


def _rank(rank: int, dp: int, tmp: str, corpus: str, tokenizer, steps: int, workers: int) -> None:
    logging.getLogger("hlat.data.records").setLevel(logging.ERROR)  # the stdlib's few undecodable files
    dist.init_process_group(
        "gloo", store=dist.FileStore(f"{tmp}/store{dp}", dp), rank=rank, world_size=dp, timeout=timedelta(minutes=30)
    )
    ranks = Ranks(side_group(), dp_rank=rank, dp=dp, accum=GLOBAL_BATCH)
    began = time.perf_counter()
    stream = build_stream(DataConfig(workers=workers), tokenizer, one_source([corpus]), SEQ_LEN, 1, ranks=ranks)
    tokens = sum(next(stream)["inputs"].numel() for _ in range(steps * GLOBAL_BATCH // dp))
    wall = time.perf_counter() - began
    state = json.dumps(stream.state_dict())
    stream.close()
    result = {
        "dp": dp,
        "rank": rank,
        "tokenized": stream.tokenized,
        "tokens": tokens,
        "wall_s": wall,
        "received_per_step": stream.exchanged_bytes / steps,
        "state_bytes": len(state),
    }
    Path(f"{tmp}/dp{dp}_rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=256, help=f"steps of {GLOBAL_BATCH} rows (256: two windows)")
    parser.add_argument("--dp", default="1,2,4")
    parser.add_argument("--workers", type=int, default=1, help="tokenizer workers per rank")
    args = parser.parse_args()
    logging.getLogger("hlat.data.records").setLevel(logging.ERROR)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "stdlib.jsonl"
        docs = (doc for f in default_corpus() for doc in iter_documents(f))
        corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
        tokenizer = (
            load_tokenizer(GPT2) if GPT2.is_dir() else train_bpe(training_sample([corpus], "text", 3_000_000, 0), 8192)
        )
        load_before = os.getloadavg()[0]
        for dp in (int(n) for n in args.dp.split(",")):
            mp.spawn(_rank, args=(dp, tmp, str(corpus), tokenizer, args.steps, args.workers), nprocs=dp)
            runs = [json.loads(Path(f"{tmp}/dp{dp}_rank{r}.json").read_text()) for r in range(dp)]
            total = sum(r["tokenized"] for r in runs)
            rows.append(
                {
                    "dp": dp,
                    "tokenized_per_rank": [r["tokenized"] for r in runs],
                    "tokenized_total": total,
                    "share_max": max(r["tokenized"] for r in runs) / total,
                    "tokens_per_s_per_rank": sorted(r["tokens"] / r["wall_s"] for r in runs)[dp // 2],
                    "received_bytes_per_step": max(r["received_per_step"] for r in runs),
                    "state_bytes": max(r["state_bytes"] for r in runs),
                }
            )
        load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"
    machine = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    meta = {
        "seq_len": SEQ_LEN,
        "global_batch": GLOBAL_BATCH,
        "steps": args.steps,
        "workers": args.workers,
        "tokenizer": f"{tokenizer.kind} (vocab {tokenizer.vocab_size})",
        "machine": machine,
        "load": load,
    }
    caption = (
        f"# Global data stream at 1, 2 and 4 data-parallel ranks\n\nseq_len {SEQ_LEN}, global batch "
        f"{GLOBAL_BATCH} rows, {args.steps} steps (shuffle windows of 1024 rows: the run cuts two), "
        f"{args.workers} tokenizer worker(s) per rank, {meta['tokenizer']} on the stdlib as JSONL; "
        f"{machine}; {load}. *Tokenized* counts the tokens each rank's workers made (whole rounds of 4 MiB "
        "of text, so shares differ by up to a round); *tokens/s per rank* is what the loader handed that "
        "rank over the run's wall time (the median rank), start-up and both windows included; *received* "
        "is the token-id bytes a rank got from others per step (the largest); *state* is the JSON a rank "
        "saves in a checkpoint. All ranks share this machine's CPUs."
    )
    table = markdown_table(
        [
            "dp",
            "tokenized per rank",
            "largest share",
            "loader tokens/s per rank",
            "received per step",
            "state per rank",
        ],
        [
            [
                r["dp"],
                " / ".join(f"{n / 1e6:.2f}M" for n in r["tokenized_per_rank"]),
                f"{r['share_max']:.0%}",
                f"{r['tokens_per_s_per_rank']:,.0f}",
                f"{r['received_bytes_per_step'] / 1e3:,.1f} kB",
                f"{r['state_bytes']:,} B",
            ]
            for r in rows
        ],
    )
    write_results("data_scale", meta, rows, caption, table)


if __name__ == "__main__":  # ranks and workers are spawned: they import this file without running it
    main()
