"""The `[data]` config section (torch-free, like every config class)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from hlat.fields import ConfigError


@dataclass
class DataConfig:
    # files, directories, globs or fsspec URLs of .txt/.py/.md, .jsonl(.gz/.zst) and .parquet: one source;
    # empty (and no `sources`) = the default corpus (the Python stdlib)
    paths: list[str] = field(default_factory=list)
    # named sources mixed by weight, "name:weight:path" each, e.g. ["prose:0.7:books/*.jsonl.zst",
    # "code:0.3:code/*.parquet"]; several entries with one name (and weight) add paths to that source
    sources: list[str] = field(default_factory=list)
    text_field: str = "text"  # JSONL field / Parquet column holding the document
    # tokenizer.json, a tiktoken BPE file (*.tiktoken), a SentencePiece *.model, a GPT-2 vocab.bpe or a
    # directory holding one; "" = train a byte-level BPE on a sample of the data
    tokenizer: str = ""
    tokenizer_sample_bytes: int = 3_000_000  # how much text that BPE is trained on
    # concat: documents back to back, cut into rows (HLAT); best_fit: whole documents placed into rows by
    # best-fit decreasing, padding the rest, splitting only documents longer than a row
    packing: Literal["concat", "best_fit"] = "concat"
    # documents are read, tokenized and packed in rounds of about this many bytes of text: the best-fit
    # buffer, a worker's unit of work, and what resuming reads again
    round_bytes: int = 1 << 22
    workers: int = 1  # background tokenizer processes; 0 = tokenize in the training process
    shuffle_files: bool = True
    shuffle_rows: int = 1024  # rows mixed in a pool so one long file does not fill whole batches; 0 = off
    seed: int = 0
    max_doc_bytes: int = 100_000_000  # longer documents are skipped as bad records
    max_bad_fraction: float = 0.05  # more bad records than this (of a source's records) stops the run
    # resume even though the data settings or files changed; the data stream then starts afresh
    force_resume: bool = False

    def validate(self) -> DataConfig:
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"data.{name}: {why}")

        for i, path in enumerate(self.paths):
            if not path.strip():
                raise bad(f"paths[{i}]", "empty path")
        if self.paths and self.sources:
            raise bad("sources", "set data.paths (one source) or data.sources (several), not both")
        self.source_patterns()
        if not self.text_field:
            raise bad("text_field", "must name a JSONL field, got an empty string")
        for name in ("tokenizer_sample_bytes", "round_bytes", "max_doc_bytes"):
            if getattr(self, name) <= 0:
                raise bad(name, f"must be positive, got {getattr(self, name)}")
        for name in ("workers", "shuffle_rows", "seed"):
            if getattr(self, name) < 0:
                raise bad(name, f"must be >= 0, got {getattr(self, name)}")
        if not 0 <= self.max_bad_fraction <= 1:
            raise bad("max_bad_fraction", f"must be in [0, 1], got {self.max_bad_fraction}")
        return self

    def source_patterns(self) -> dict[str, tuple[float, list[str]]]:
        """{name: (weight, path patterns)} from `sources`, in order of first appearance."""
        out: dict[str, tuple[float, list[str]]] = {}
        for i, entry in enumerate(self.sources):
            parts = entry.split(":", 2)
            try:
                name, weight, pattern = parts[0].strip(), float(parts[1]), parts[2].strip()
            except (IndexError, ValueError):
                raise ConfigError(f"data.sources[{i}]: {entry!r} is not 'name:weight:path'") from None
            if not name or not pattern or not weight > 0:
                raise ConfigError(f"data.sources[{i}]: {entry!r} needs a name, a positive weight and a path")
            if out.get(name, (weight,))[0] != weight:
                raise ConfigError(f"data.sources[{i}]: source {name!r} has two weights, {out[name][0]} and {weight}")
            out.setdefault(name, (weight, []))[1].append(pattern)
        return out
