"""Data loader throughput: the whole loader (read JSONL, tokenize in worker processes, pack, batch) with 1, 2, ...
workers against the tokenizer's own single-process, single-thread batch encoding of the same text. Repeats the
measurements, alternating them so machine noise hits all alike, and keeps the best of each.

    .venv/bin/python benchmarks/data_loader.py [--mb 8] [--repeats 3] [--workers 1,2]

Text: the Python standard library as JSON lines. Tokenizer: GPT-2 from shared/data/tokenizers when present,
else a byte-level BPE (vocab 8192) trained on the text. Writes benchmarks/results/data_loader.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

from hlat.data.cli import bench
from hlat.data.sources import default_corpus, iter_documents
from hlat.data.tokenizer import load_tokenizer, train_bpe, training_sample

RESULTS = Path(__file__).parent / "results"
GPT2 = Path(__file__).resolve().parents[2] / "shared" / "data" / "tokenizers" / "gpt2"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=8.0, help="megabytes of text per measurement")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", default=",".join(str(2**i) for i in range(5) if 2**i <= os.cpu_count()))
    parser.add_argument("--packing", default="concat", choices=("concat", "best_fit"))
    args = parser.parse_args()
    workers = [int(n) for n in args.workers.split(",")]
    logging.getLogger("hlat.data.sources").setLevel(logging.ERROR)  # the stdlib's few undecodable files
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "stdlib.jsonl"
        docs = (doc for f in default_corpus() for doc in iter_documents(f))
        corpus.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
        if GPT2.is_dir():
            tokenizer = load_tokenizer(GPT2)
        else:
            tokenizer = train_bpe(training_sample([corpus], "text", 3_000_000, 0), 8192)
        runs = [bench([corpus], tokenizer, workers, int(args.mb * 1e6), packing=args.packing)
                for _ in range(args.repeats)]

    best = dict(runs[0], tokenizer_tokens_per_s=max(r["tokenizer_tokens_per_s"] for r in runs))
    best["loader"] = [{"workers": n, **{k: max(r["loader"][i][k] for r in runs)
                                        for k in ("tokens_per_s", "vs_tokenizer", "cpu_efficiency")}}
                      for i, n in enumerate(workers)]
    best.update(repeats=args.repeats, machine=f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.platform()}",
                all_runs=runs)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "data_loader.json").write_text(json.dumps(best, indent=1) + "\n")
    lines = [
        "# Data loader throughput",
        "",
        f"{best['text_bytes'] / 1e6:.1f} MB of JSONL text ({best['documents']:,} documents, {best['tokens']:,} "
        f"tokens), {best['tokenizer']} tokenizer (vocab {best['vocab_size']:,}), {best['packing']} packing, "
        f"seq_len {best['seq_len']}, batch {best['batch_size']}; best of {args.repeats}; {best['machine']}.",
        "",
        "| what | tokens/s | vs tokenizer (same run) | tokens per CPU-second vs tokenizer |",
        "| --- | ---: | ---: | ---: |",
        f"| tokenizer batch encode (1 process, 1 thread) | {best['tokenizer_tokens_per_s']:,} | 100% | 100% |",
        *(f"| loader, {r['workers']} worker(s) | {r['tokens_per_s']:,} | {r['vs_tokenizer']:.0%} | "
          f"{r['cpu_efficiency']:.0%} |" for r in best["loader"]),
    ]
    (RESULTS / "data_loader.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":  # worker processes are spawned: they import this file without running it
    main()
