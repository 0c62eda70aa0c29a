"""Peak memory of tokenizing and packing one long single-line document, as a tokenizer worker does it:
in bounded pieces (hlat.data.rounds.encode_bounded) against the whole document at once; then a real run,
`hlat train` on a JSONL file of that one document, with the peak memory of its tokenizer worker.

Each measurement runs in a fresh process and reports its peak resident memory (ru_maxrss) minus the
memory before the document was made, so the growth with document size is what the table shows. The run's
worker is a separate process: its whole peak (VmHWM, from /proc while it runs) is reported.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from results_io import markdown_table, write_results  # noqa: E402

CORPUS = str(Path(json.__file__).parent / "*.py")


def measure(tokenizer_file: str, mb: int, bounded: bool) -> float:
    import numpy as np  # noqa: F401  (loaded before the baseline, as in a worker)

    from hlat.data.rounds import best_fit, encode_bounded
    from hlat.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer_file)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    words = "the quick brown fox jumps over the lazy dog 0123 "
    doc = (words * (mb * 2**20 // len(words) + 1))[: mb * 2**20]
    ids = encode_bounded(tok, [doc]) if bounded else tok.encode_batch([doc])
    best_fit(ids, tok.eos_id, 257)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024  # MiB (Linux: KiB)


def process_tree(pid: int) -> list[int]:
    kids = [int(k) for t in Path(f"/proc/{pid}/task").iterdir() for k in (t / "children").read_text().split()]
    return [pid, *(p for k in kids for p in process_tree(k))]


def peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def train_peaks(tokenizer_file: str, mb: int, tmp: Path) -> dict:
    """`hlat train` (tiny model, 2 steps, one tokenizer worker, best-fit packing) on one `mb` MB document: the
    peak memory of the trainer and of its worker, watched until the run ends."""
    words = "the quick brown fox jumps over the lazy dog 0123 "
    data = tmp / f"doc{mb}.jsonl"
    data.write_text(json.dumps({"text": (words * (mb * 2**20 // len(words) + 1))[: mb * 2**20]}) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "hlat",
        "train",
        "--config",
        "tiny",
        "--train.steps",
        "2",
        "--train.log_every",
        "1",
        "--train.run_dir",
        str(tmp / f"run{mb}"),
        "--data.paths",
        str(data),
        "--data.tokenizer",
        tokenizer_file,
        "--data.workers",
        "1",
        "--data.packing",
        "best_fit",
        "--train.ckpt_every",
        "0",
    ]
    job = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peaks: dict[int, float] = {}
    while job.poll() is None:
        try:
            for pid in process_tree(job.pid):
                peaks[pid] = max(peaks.get(pid, 0.0), peak_mib(pid))
        except (FileNotFoundError, ProcessLookupError, ValueError):
            pass  # a process ended between the listing and the read
        time.sleep(0.1)
    if job.returncode != 0:
        raise SystemExit(f"hlat train failed: {job.stderr.read()[-2000:]}")
    trainer = peaks.pop(job.pid, 0.0)
    return {"trainer_peak_mib": round(trainer, 1), "worker_peak_mib": round(max(peaks.values(), default=0.0), 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="8,32")
    ap.add_argument("--train-mb", default="8,32,90", help="document sizes for the `hlat train` runs")
    ap.add_argument("--measure", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(measure(args.measure[0], int(args.measure[1]), args.measure[2] == "bounded"))
        return
    from hlat.data.config import DataConfig
    from hlat.data.sources import resolve_data_files
    from hlat.data.tokenizer import get_tokenizer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        cfg = DataConfig(paths=[CORPUS])
        get_tokenizer(cfg, resolve_data_files(cfg), 512, tmp)
        tokenizer_file = str(next(Path(tmp).glob("tokenizer*")))
        for mb in map(int, args.sizes_mb.split(",")):
            row = {"doc_mb": mb}
            for mode in ("bounded", "whole"):  # whole: about 210 bytes per byte of document
                out = subprocess.run(
                    [sys.executable, __file__, "--measure", tokenizer_file, str(mb), mode],
                    capture_output=True,
                    text=True,
                    check=True,
                ).stdout
                row[f"{mode}_peak_mib"] = round(float(out.strip().splitlines()[-1]), 1)
            rows.append(row)
            print(row, flush=True)
        runs = []
        for mb in map(int, args.train_mb.split(",")):
            runs.append({"doc_mb": mb, **train_peaks(tokenizer_file, mb, Path(tmp))})
            print(runs[-1], flush=True)
    caption = (
        "Peak memory added by tokenizing and packing one single-line document (seq_len 256, BPE of 512 "
        "tokens), in bounded pieces against whole; then the peak memory of `hlat train` (tiny, 2 steps, "
        "one tokenizer worker, best-fit packing) on a JSONL file of that one document, trainer and worker "
        "apart (benchmarks/long_document_memory.py)."
    )
    table = markdown_table(
        ["document (MB)", "in pieces: peak added (MiB)", "whole: peak added (MiB)"],
        [[r["doc_mb"], r["bounded_peak_mib"], r["whole_peak_mib"]] for r in rows],
    )
    table += "\n\n" + markdown_table(
        ["document (MB)", "hlat train: worker peak (MiB)", "trainer peak (MiB)"],
        [[r["doc_mb"], r["worker_peak_mib"], r["trainer_peak_mib"]] for r in runs],
    )
    write_results(
        "long_document_memory",
        {"sizes_mb": args.sizes_mb, "train_mb": args.train_mb},
        rows + [{"train": r} for r in runs],
        caption,
        table,
    )


if __name__ == "__main__":
    main()
