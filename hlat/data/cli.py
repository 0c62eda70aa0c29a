"""`hlat data inspect PATH...` (documents, tokens and bad records of each file), `hlat data tokenize PATH...
--tokenizer T --out NAME` (the documents as a pre-tokenized token file) and `hlat data bench PATH...` (tokens/s
of the whole loader for 1, 2, ... workers against the tokenizer's own batch encoding of the same text).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace
from pathlib import Path

from hlat import HlatError

BENCH_ROUND_BYTES = 1 << 18


def register(commands) -> None:
    parser = commands.add_parser("data", help="inspect data files, write token files, or benchmark the loader")
    add_arguments(parser)
    parser.set_defaults(func=run, overrides=False)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="data_command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("paths", nargs="+", metavar="PATH", help="files, directories, globs or URLs")
    common.add_argument("--text-field", default="text", help="JSONL field / Parquet column (default: text)")
    common.add_argument(
        "--tokenizer",
        help="tokenizer file or directory (inspect: without one, tokens are not "
        "counted; bench: without one, a byte-level BPE is trained on the data)",
    )
    common.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p = sub.add_parser("inspect", parents=[common], help="documents, tokens and bad records by kind, per file")
    p.add_argument("--max-doc-bytes", type=int, default=100_000_000, help="longer documents are bad records")
    p = sub.add_parser("tokenize", parents=[common], help="write the documents as a pre-tokenized token file")
    p.add_argument("--out", required=True, help="writes OUT.tokens.bin, OUT.tokens.idx.npy and OUT.tokens.json")
    p.add_argument("--max-doc-bytes", type=int, default=100_000_000, help="longer documents are bad records")
    p = sub.add_parser("bench", parents=[common], help="loader tokens/s for several worker counts vs the tokenizer")
    p.add_argument(
        "--workers",
        default="1,2",
        help="worker counts to run, comma-separated; 0 = tokenize in the same process (default 1,2)",
    )
    p.add_argument("--mb", type=float, default=8.0, help="megabytes of text to run through (default 8)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--packing", choices=("concat", "best_fit"), default="concat")
    p.add_argument("--vocab-size", type=int, default=8192, help="of the BPE trained when no --tokenizer is given")


def run(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.data.sources import resolve_paths

    files = resolve_paths(args.paths)
    if args.data_command == "inspect":
        result = inspect(
            files, args.text_field, _tokenizer(args, files) if args.tokenizer else None, args.max_doc_bytes
        )
        print(json.dumps(result, indent=1) if args.json else _inspect_table(result))
    elif args.data_command == "tokenize":
        if not args.tokenizer:
            raise HlatError("hlat data tokenize: --tokenizer is required (the run that reads the file must use it)")
        result = tokenize(files, _tokenizer(args, files), args.out, args.text_field, args.max_doc_bytes)
        print(
            json.dumps(result, indent=1)
            if args.json
            else f"wrote {result['file']}: {result['documents']:,} "
            f"documents, {result['tokens']:,} tokens, {sum(result['bad'].values()):,} bad records skipped"
        )
    else:
        try:
            counts = [int(n) for n in args.workers.split(",")]
        except ValueError:
            raise HlatError(f"--workers: expected comma-separated numbers, got {args.workers!r}") from None
        if not counts or min(counts) < 0:
            raise HlatError(f"--workers: worker counts must be >= 0, got {args.workers!r}")
        result = bench(
            files,
            _tokenizer(args, files),
            counts,
            int(args.mb * 1e6),
            args.seq_len,
            args.batch_size,
            args.packing,
            args.text_field,
        )
        print(json.dumps(result, indent=1) if args.json else _bench_table(result))
    return 0


def _tokenizer(args: argparse.Namespace, files):
    from hlat.data.tokenizer import load_tokenizer, train_bpe, training_sample

    if args.tokenizer:
        return load_tokenizer(args.tokenizer)
    return train_bpe(training_sample(files, args.text_field, 3_000_000, 0), args.vocab_size)


def inspect(files, text_field: str = "text", tokenizer=None, max_doc_bytes: int = 100_000_000) -> dict:
    """Per file: documents, bytes of text, tokens (a token file's, counted; a text's with a tokenizer) and bad
    records by reason, with the place of the first of each."""
    from hlat.data.readers import START, decode, read_split
    from hlat.data.records import Bad
    from hlat.data.rounds import encode as encode_documents
    from hlat.data.splits import Split

    rows = []
    for f in files:
        split = Split(f, 0)
        docs, chars, tokens, bad, first = 0, 0, 0, Counter(), {}
        batch: list = []

        def encode() -> int:
            n = sum(map(len, encode_documents(tokenizer, batch))) if tokenizer and batch else 0
            batch.clear()
            return n

        for record, where, _ in read_split(split, (START, 0), text_field, max_doc_bytes):
            doc = decode(record, split.format, text_field)
            if isinstance(doc, Bad):
                bad[doc.reason] += 1
                first.setdefault(doc.reason, where)
                continue
            docs += 1
            if not isinstance(doc, str):  # a pre-tokenized document: its ids, no characters
                tokens += len(doc)
                continue
            chars += len(doc)
            batch.append(doc)
            if len(batch) == 256:
                tokens += encode()
        tokens += encode()
        counted = tokenizer is not None or split.format == "tokens"
        rows.append(
            {
                "file": str(f),
                "documents": docs,
                "characters": chars,
                "tokens": tokens if counted else None,
                "bad": dict(bad),
                "first_bad": first,
            }
        )
    total_bad: Counter[str] = Counter()
    for row in rows:
        total_bad.update(row["bad"])
    tokens = [r["tokens"] for r in rows]
    return {
        "files": rows,
        "documents": sum(r["documents"] for r in rows),
        "characters": sum(r["characters"] for r in rows),
        "tokens": None if None in tokens else sum(tokens),
        "bad": dict(total_bad),
    }


def _inspect_table(result: dict) -> str:
    lines = [f"{'documents':>10} {'characters':>13} {'tokens':>12} {'bad':>6}  file"]
    for r in result["files"] + [dict(result, file="total")]:
        tokens = "-" if r["tokens"] is None else f"{r['tokens']:,}"
        bad = sum(r["bad"].values())
        lines.append(f"{r['documents']:>10,} {r['characters']:>13,} {tokens:>12} {bad:>6,}  {r['file']}")
    for r in result["files"]:
        lines.extend(f"  {n:,} x {reason}, first at {r['first_bad'][reason]}" for reason, n in r["bad"].items())
    return "\n".join(lines)


def tokenize(files, tokenizer, out: str | Path, text_field: str = "text", max_doc_bytes: int = 100_000_000) -> dict:
    """Write the documents of `files` (in order; bad records skipped and counted, as the loader does) as the
    token file OUT.tokens.bin, with OUT.tokens.idx.npy and, last, OUT.tokens.json (formats.py describes them).
    Each file's progress goes to stderr. Returns the description."""
    import numpy as np

    from hlat.data.formats import token_sidecar
    from hlat.data.readers import iter_documents
    from hlat.data.records import BadLog
    from hlat.data.tokenizer import tokenizer_digest

    data = Path(f"{out}.tokens.bin")
    data.parent.mkdir(parents=True, exist_ok=True)
    final = [data, token_sidecar(data, ".idx.npy"), token_sidecar(data, ".json")]
    partial = [p.with_name(p.name + ".partial") for p in final]
    dtype = np.dtype(np.uint16 if tokenizer.vocab_size <= 1 << 16 else np.uint32)
    lengths: list[int] = []
    bad = BadLog()
    with open(partial[0], "wb") as f:
        for i, file in enumerate(files):
            docs: list = []
            for doc in iter_documents(file, text_field, max_doc_bytes, bad):
                docs.append(doc)
                if len(docs) == 256:
                    _write_documents(f, tokenizer, docs, dtype, lengths)
            _write_documents(f, tokenizer, docs, dtype, lengths)
            print(
                f"{i + 1}/{len(files)} files, {len(lengths):,} documents, {sum(lengths):,} tokens: {file}",
                file=sys.stderr,
            )
    with open(partial[1], "wb") as f:
        np.save(f, np.cumsum(np.asarray(lengths, dtype=np.int64)))
    meta = {
        "dtype": dtype.name,
        "documents": len(lengths),
        "tokens": sum(lengths),
        "tokenizer": tokenizer_digest(tokenizer),
        "tokenizer_kind": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "eos_id": tokenizer.eos_id,
        "bad": dict(bad.counts),
        "sources": [str(f) for f in files],
    }
    partial[2].write_text(json.dumps(meta, indent=1) + "\n")
    for p, q in zip(partial, final):  # the description last: without it the file is not taken as finished
        p.replace(q)
    return {"file": str(data), **meta}


def _write_documents(f, tokenizer, docs: list, dtype, lengths: list[int]) -> None:
    """Append the token ids of `docs` to `f` and their lengths to `lengths`; empties `docs`."""
    import numpy as np

    from hlat.data.rounds import encode

    for ids in encode(tokenizer, docs):
        f.write(np.asarray(ids, dtype=dtype).tobytes())
        lengths.append(len(ids))
    docs.clear()


def bench(
    files,
    tokenizer,
    workers: list[int],
    text_bytes: int,
    seq_len: int = 2048,
    batch_size: int = 8,
    packing: str = "concat",
    text_field: str = "text",
) -> dict:
    """For each number of workers: tokens/s of the tokenizer's own batch encoding, in one (fresh) process and
    one thread, on the first `text_bytes` of the data in file order, and right after it of the whole loader
    (reading, tokenizing, packing, batching) on the same text, so that both meet the same machine load. The
    loader is timed from its first batch on, after the workers started; its `cpu_efficiency` compares the
    tokens per CPU-second of all its processes over that time with the tokenizer's (on Linux; None elsewhere):
    what the loader costs beyond tokenizing, whatever else the machine is doing."""
    from hlat.data.packing import build_stream
    from hlat.data.sources import one_source

    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread, as in each worker
    cfg = _bench_config(text_field, packing)
    chunks, size = _first_rounds(files, text_field, cfg.round_bytes, text_bytes)
    runs = []
    for n in workers:
        # in a fresh process, as a worker runs it: a clean heap and no words cached from earlier runs
        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as pool:
            tokens, wall_s, cpu_s = pool.submit(_encode, tokenizer, chunks).result()
        own, own_cpu = tokens / wall_s, tokens / cpu_s
        emitted, rate, cpu_s = _time_loader(
            build_stream(replace(cfg, workers=n), tokenizer, one_source(files), seq_len, batch_size), tokens
        )
        efficiency = round(emitted / cpu_s / own_cpu, 3) if cpu_s > 0 else None
        runs.append(
            {
                "workers": n,
                "tokens_per_s": round(rate),
                "tokenizer_tokens_per_s": round(own),
                "vs_tokenizer": round(rate / own, 3),
                "cpu_efficiency": efficiency,
            }
        )
    return {
        "text_bytes": size,
        "documents": sum(map(len, chunks)),
        "tokens": tokens,
        "tokenizer": tokenizer.kind,
        "vocab_size": tokenizer.vocab_size,
        "packing": packing,
        "seq_len": seq_len,
        "batch_size": batch_size,
        "cpus": os.cpu_count(),
        "loader": runs,
    }


def _bench_config(text_field: str, packing: str):
    """The loader's settings for `bench`: small rounds, so that the timing covers many of them and hardly depends on
    the first ones, in file order."""
    from hlat.data.config import DataConfig

    return DataConfig(
        text_field=text_field,
        packing=packing,
        shuffle_files=False,
        shuffle_rows=0,
        round_bytes=BENCH_ROUND_BYTES,
        max_bad_fraction=1.0,
    )


def _first_rounds(files, text_field: str, round_bytes: int, text_bytes: int) -> tuple[list[list[str]], int]:
    """The documents of the first rounds of `files` (about `text_bytes` of text), as the loader encodes them, and
    their bytes."""
    from hlat.data.readers import iter_documents

    chunks, chunk, size, chunk_size = [], [], 0, 0
    for doc in (doc for f in files for doc in iter_documents(f, text_field)):
        chunk.append(doc)
        chunk_size += len(doc.encode())
        if chunk_size >= round_bytes:  # the documents of one round
            chunks.append(chunk)
            size += chunk_size
            chunk, chunk_size = [], 0
            if size >= text_bytes:
                break
    chunks.append(chunk)
    return chunks, size + chunk_size


def _time_loader(stream, tokens: int) -> tuple[int, float, float]:
    """The tokens taken from `stream` (at least `tokens`), their rate and the CPU seconds its processes took, from
    its first batch on (its workers started); the stream is closed."""
    next(stream)
    pids = stream.worker_pids
    began, cpu, emitted = time.perf_counter(), _cpu_s(pids), 0
    while emitted < tokens:
        emitted += next(stream)["inputs"].numel()
    rate, cpu_s = emitted / (time.perf_counter() - began), _cpu_s(pids) - cpu
    stream.close()
    return emitted, rate, cpu_s


def _encode(tokenizer, chunks: list[list[str]]) -> tuple[int, float, float]:
    """Tokens (+ EOS per document), wall and CPU seconds of the tokenizer's batch encoding, on one thread."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    began, cpu = time.perf_counter(), time.process_time()
    tokens = sum(len(ids) + 1 for c in chunks for ids in tokenizer.encode_batch(c))
    return tokens, time.perf_counter() - began, time.process_time() - cpu


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds of this process and of the processes `pids`, from /proc (Linux); nan elsewhere."""
    try:
        stats = [Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split() for pid in pids]
    except OSError:
        return float("nan")
    return time.process_time() + sum(int(f[11]) + int(f[12]) for f in stats) / os.sysconf("SC_CLK_TCK")  # utime, stime


def _bench_table(result: dict) -> str:
    lines = [
        f"{result['text_bytes'] / 1e6:.1f} MB, {result['documents']:,} documents, {result['tokens']:,} tokens "
        f"({result['tokenizer']} tokenizer, vocab {result['vocab_size']:,}); {result['cpus']} CPUs",
        f"{'workers':>7} {'loader tokens/s':>16} {'tokenizer tokens/s':>19} {'loader/tokenizer':>17} "
        f"{'per CPU-second':>15}",
    ]
    for r in result["loader"]:
        lines.append(
            f"{r['workers']:>7} {r['tokens_per_s']:>16,} {r['tokenizer_tokens_per_s']:>19,} "
            f"{r['vs_tokenizer']:>17.0%} {r['cpu_efficiency'] or float('nan'):>15.0%}"
        )
    return "\n".join(lines)
