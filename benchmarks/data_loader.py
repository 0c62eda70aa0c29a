"""Data loader throughput: the whole loader (read JSONL, tokenize in worker processes, pack, batch) with 1, 2, ...
workers against the tokenizer's own single-process, single-thread batch encoding of the same text. Each loader
run is paired with a tokenizer run just before it, so both meet the same machine load; the runs are repeated
and the medians reported.

    .venv/bin/python benchmarks/data_loader.py [--mb 4] [--repeats 5] [--workers 1,2]

Text: the Python standard library as JSON lines. Tokenizer: GPT-2 from shared/data/tokenizers when present,
else a byte-level BPE (vocab 8192) trained on the text. Writes benchmarks/results/data_loader.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import tempfile
from pathlib import Path

from hlat.data.cli import bench
from hlat.data.readers import iter_documents
from hlat.data.sources import default_corpus
from hlat.data.tokenizer import load_tokenizer, train_bpe, training_sample

RESULTS = Path(__file__).parent / "results"
GPT2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "gpt2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=4.0, help="megabytes of text per measurement")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--workers",
        default=",".join(["0"] + [str(2**i) for i in range(5) if 2**i <= os.cpu_count()]),
        help="worker counts; 0 = in the measuring process (default: 0, then 1, 2, 4... CPUs)",
    )
    parser.add_argument("--packing", default="concat", choices=("concat", "best_fit"))
    args = parser.parse_args()
    workers = [int(n) for n in args.workers.split(",")]
    logging.getLogger("hlat.data.records").setLevel(logging.ERROR)  # the stdlib's few undecodable files
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "stdlib.jsonl"
        docs = (doc for f in default_corpus() for doc in iter_documents(f))
        corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
        if GPT2.is_dir():
            tokenizer = load_tokenizer(GPT2)
        else:
            tokenizer = train_bpe(training_sample([corpus], "text", 3_000_000, 0), 8192)
        load_before = os.getloadavg()[0]
        runs = [
            bench([corpus], tokenizer, workers, int(args.mb * 1e6), packing=args.packing) for _ in range(args.repeats)
        ]
        load = f"load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after"

    result = {k: v for k, v in runs[0].items() if k != "loader"}
    result["loader"] = [
        {
            "workers": n,
            **{
                k: statistics.median(r["loader"][i][k] for r in runs)
                for k in ("tokens_per_s", "tokenizer_tokens_per_s", "vs_tokenizer", "cpu_efficiency")
            },
        }
        for i, n in enumerate(workers)
    ]
    result.update(
        repeats=args.repeats,
        machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
        load=load,
        all_runs=[r["loader"] for r in runs],
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "data_loader.json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Data loader throughput",
        "",
        f"{result['text_bytes'] / 1e6:.1f} MB of JSONL text ({result['documents']:,} documents, {result['tokens']:,} "
        f"tokens), {result['tokenizer']} tokenizer (vocab {result['vocab_size']:,}), {result['packing']} packing, "
        f"seq_len {result['seq_len']}, batch {result['batch_size']}; medians of {args.repeats} runs; "
        f"{result['machine']}; {load}.",
        "",
        "Each loader run is paired with a run of the tokenizer's own batch encoding (1 process, 1 thread) on the same",
        "text just before it; *per CPU-second* compares the tokens per CPU-second of all the loader's processes",
        "(from its first batch on) with the tokenizer's. Workers add throughput only where CPUs are free: compare",
        "the load average with the number of CPUs.",
        "",
        "| workers | loader tokens/s | tokenizer tokens/s | loader / tokenizer | per CPU-second |",
        "| ---: | ---: | ---: | ---: | ---: |",
        *(
            f"| {r['workers'] or '0 (in process)'} | {r['tokens_per_s']:,.0f} | {r['tokenizer_tokens_per_s']:,.0f} | "
            f"{r['vs_tokenizer']:.0%} | {r['cpu_efficiency']:.0%} |"
            for r in result["loader"]
        ),
    ]
    (RESULTS / "data_loader.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":  # worker processes are spawned: they import this file without running it
    main()
