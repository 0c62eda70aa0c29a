"""Peak memory of tokenizing and packing one long single-line document, as a tokenizer worker does it:
in bounded pieces (hlat.data.rounds.encode_bounded) against the whole document at once.

Each measurement runs in a fresh process and reports its peak resident memory (ru_maxrss) minus the
memory before the document was made, so the growth with document size is what the table shows.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="8,32,90")
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
            for mode in ("bounded", "whole"):
                out = subprocess.run([sys.executable, __file__, "--measure", tokenizer_file, str(mb), mode],
                                     capture_output=True, text=True, check=True).stdout
                row[f"{mode}_peak_mib"] = round(float(out.strip().splitlines()[-1]), 1)
            rows.append(row)
            print(row, flush=True)
    caption = ("Peak memory added by tokenizing and packing one single-line document (seq_len 256, BPE of 512 "
               "tokens), in bounded pieces against whole (benchmarks/long_document_memory.py).")
    table = markdown_table(["document (MB)", "in pieces: peak (MiB)", "whole: peak (MiB)"],
                           [[r["doc_mb"], r["bounded_peak_mib"], r["whole_peak_mib"]] for r in rows])
    write_results("long_document_memory", {"sizes_mb": args.sizes_mb}, rows, caption, table)


if __name__ == "__main__":
    main()
