"""The `[data]` config section (torch-free, like every config class)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hlat.config import ConfigError


@dataclass
class DataConfig:
    # files, directories or globs of .txt/.py/.md and .jsonl; empty = the default corpus (the Python stdlib)
    paths: list[str] = field(default_factory=list)
    text_field: str = "text"  # JSONL field holding the document
    # tokenizer.json, a tiktoken BPE file (*.tiktoken), a SentencePiece *.model, a GPT-2 vocab.bpe or a
    # directory holding one; "" = train a byte-level BPE on a sample of the data
    tokenizer: str = ""
    tokenizer_sample_bytes: int = 3_000_000  # how much text that BPE is trained on
    shuffle_files: bool = True
    shuffle_rows: int = 1024  # rows mixed in a pool so one long file does not fill whole batches; 0 = off
    seed: int = 0

    def validate(self) -> "DataConfig":
        def bad(name: str, why: str) -> ConfigError:
            return ConfigError(f"data.{name}: {why}")

        for i, path in enumerate(self.paths):
            if not path.strip():
                raise bad(f"paths[{i}]", "empty path")
        if not self.text_field:
            raise bad("text_field", "must name a JSONL field, got an empty string")
        if self.tokenizer_sample_bytes <= 0:
            raise bad("tokenizer_sample_bytes", f"must be positive, got {self.tokenizer_sample_bytes}")
        if self.shuffle_rows < 0:
            raise bad("shuffle_rows", f"must be >= 0, got {self.shuffle_rows}")
        if self.seed < 0:
            raise bad("seed", f"must be >= 0, got {self.seed}")
        return self
