"""Tokenizers behind one small interface: HF `tokenizers` (tokenizer.json, GPT-2 vocab.bpe), tiktoken BPE
files and SentencePiece models, plus a byte-level BPE trained on the run's own data when none is given.

Document text is always encoded as plain text: a document that happens to contain "<|endoftext|>" does not
produce the EOS id; only the data loader puts EOS between documents.
"""

from __future__ import annotations

import base64
import hashlib
import json
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Protocol

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

from hlat import HlatError, optional_import
from hlat.data.config import DataConfig
from hlat.data.readers import iter_documents

EOS = "<|endoftext|>"
# Encoded to tell tokenizers apart in the fingerprint: mixed scripts, digits, whitespace, code.
PROBE = "Hello, wörld! 123 4567\n\tdef f(x): return x**2  # 日本語 Ελληνικά 🙂 <|endoftext|>"

# End-of-text tokens of common tokenizer.json files, tried in order.
_HF_EOS_NAMES = (EOS, "<|end_of_text|>", "</s>", "<eos>")


class Tokenizer(Protocol):
    kind: str  # "hf", "tiktoken" or "sentencepiece"
    vocab_size: int  # every id is < vocab_size
    eos_id: int

    def encode_batch(self, texts: list[str]) -> list[list[int]]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def save(self, directory: str | Path) -> Path: ...


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    (ids,) = tokenizer.encode_batch([PROBE])
    key = json.dumps([tokenizer.kind, tokenizer.vocab_size, tokenizer.eos_id, ids])
    return hashlib.sha256(key.encode()).hexdigest()[:16]


class HFTokenizer:
    kind = "hf"
    file_name = "tokenizer.json"

    def __init__(self, tok: tokenizers.Tokenizer, source: str):
        self._tok = tok
        tok.encode_special_tokens = True  # see the module docstring
        eos = next((i for i in map(tok.token_to_id, _HF_EOS_NAMES) if i is not None), None)
        if eos is None:
            raise HlatError(f"tokenizer {source}: no end-of-text token (looked for {', '.join(_HF_EOS_NAMES)})")
        self.eos_id = eos
        self.vocab_size = max(tok.get_vocab(with_added_tokens=True).values()) + 1

    def __setstate__(self, state: dict) -> None:  # pickling (to a worker process) drops this flag
        self.__dict__.update(state)
        self._tok.encode_special_tokens = True

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / self.file_name
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(path))
        return path


# tiktoken BPE files do not record their pre-tokenization regex, so it is chosen by the vocabulary size of
# the OpenAI family the file most likely belongs to: GPT-2/r50k (~50k), cl100k (~100k, also Llama 3),
# o200k (~200k).
_CL100K_PATTERN = r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""  # noqa: E501
_O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)


class TiktokenTokenizer:
    kind = "tiktoken"
    file_name = "tokenizer.tiktoken"

    def __init__(self, ranks: dict[bytes, int], source: str):
        tiktoken = optional_import("tiktoken", f"tokenizer {source}")
        from tiktoken_ext.openai_public import r50k_pat_str

        self._ranks = ranks
        n = max(ranks.values()) + 1
        pattern = r50k_pat_str if n < 90_000 else _CL100K_PATTERN if n < 190_000 else _O200K_PATTERN
        special = {} if EOS.encode() in ranks else {EOS: n}
        self.eos_id = ranks.get(EOS.encode(), n)
        self._enc = tiktoken.Encoding(Path(source).stem, pat_str=pattern, mergeable_ranks=ranks, special_tokens=special)
        self.vocab_size = self._enc.n_vocab

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._enc.encode_ordinary_batch(texts)

    def decode(self, ids: Sequence[int]) -> str:
        return self._enc.decode(list(ids))

    def save(self, directory: str | Path) -> Path:
        # The tiktoken format, written here because tiktoken's own writer needs the extra package blobfile.
        by_rank = sorted(self._ranks.items(), key=lambda kv: kv[1])
        lines = (base64.b64encode(token) + b" %d\n" % rank for token, rank in by_rank)
        path = Path(directory) / self.file_name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"".join(lines))
        return path


class SentencePieceTokenizer:
    kind = "sentencepiece"
    file_name = "tokenizer.model"

    def __init__(self, path: Path):
        spm = optional_import("sentencepiece", f"tokenizer {path}")
        try:
            self._sp = spm.SentencePieceProcessor(model_file=str(path))
        except (RuntimeError, OSError) as e:
            raise HlatError(f"tokenizer {path}: not a SentencePiece model ({e})") from None
        self.eos_id = self._sp.eos_id()
        if self.eos_id < 0:
            raise HlatError(f"tokenizer {path}: the SentencePiece model has no end-of-sentence piece")
        self.vocab_size = self._sp.get_piece_size()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self._sp.encode(texts, out_type=int)

    def decode(self, ids: Sequence[int]) -> str:
        return self._sp.decode(list(ids))

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / self.file_name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self._sp.serialized_model_proto())
        return path


def train_bpe(texts: Iterable[str], vocab_size: int) -> HFTokenizer:
    """Train a byte-level BPE (GPT-2 style, every byte in the base alphabet) with EOS = "<|endoftext|>" = id 0.

    Deterministic for the same texts in the same order.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + 1:
        minimum = len(alphabet) + 1
        raise HlatError(f"vocab_size {vocab_size} is too small for a byte-level BPE (at least {minimum})")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    return HFTokenizer(tok, "trained byte-level BPE")


def _gpt2_files(merges: Path) -> HFTokenizer:
    """The original GPT-2 release: vocab.bpe (merges) with encoder.json (vocab) beside it."""
    vocab = merges.with_name("encoder.json")
    if not vocab.is_file():
        raise HlatError(f"tokenizer {merges}: GPT-2 merges need encoder.json beside them, not found: {vocab}")
    tok = tokenizers.Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS])  # already in encoder.json (50256): this keeps its id and marks it special
    return HFTokenizer(tok, str(merges))


def _looks_like_tiktoken(path: Path) -> bool:
    """tiktoken files are lines of 'base64 rank'; Llama 3 ships one named tokenizer.model."""
    with path.open("rb") as f:
        first = f.readline(256)
    return re.fullmatch(rb"[A-Za-z0-9+/=]+ \d+\r?\n?", first) is not None


def tokenizer_file_in(directory: Path) -> Path | None:
    for name in ("tokenizer.json", "tokenizer.model", "tokenizer.tiktoken", "vocab.bpe"):
        if (directory / name).is_file():
            return directory / name
    return next(iter(sorted(directory.glob("*.tiktoken"))), None)


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load a tokenizer.json, *.tiktoken, SentencePiece *.model or GPT-2 vocab.bpe, or a directory holding one."""
    path = Path(path).expanduser()
    if path.is_dir():
        found = tokenizer_file_in(path)
        if found is None:
            raise HlatError(f"tokenizer {path}: no tokenizer.json, tokenizer.model, *.tiktoken or vocab.bpe in it")
        path = found
    if not path.is_file():
        raise HlatError(f"tokenizer {path}: file not found")
    if path.name == "vocab.bpe":
        return _gpt2_files(path)
    if path.suffix == ".json":
        try:
            return HFTokenizer(tokenizers.Tokenizer.from_file(str(path)), str(path))
        except Exception as e:  # the Rust side raises plain Exception for any parse error
            raise HlatError(f"tokenizer {path}: not a tokenizers tokenizer.json ({e})") from None
    if path.suffix == ".tiktoken" or (path.suffix == ".model" and _looks_like_tiktoken(path)):
        tiktoken_load = optional_import("tiktoken.load", f"tokenizer {path}")
        # tiktoken caches local files by path; the content hash makes it notice when the file has changed.
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        try:
            ranks = tiktoken_load.load_tiktoken_bpe(str(path), expected_hash=digest)
        except ValueError as e:
            raise HlatError(f"tokenizer {path}: not a tiktoken BPE file ({e})") from None
        return TiktokenTokenizer(ranks, str(path))
    if path.suffix == ".model":
        return SentencePieceTokenizer(path)
    raise HlatError(f"tokenizer {path}: unsupported format (use tokenizer.json, *.tiktoken, *.model or vocab.bpe)")


def training_sample(files: Sequence[Path], text_field: str, budget: int, seed: int) -> Iterator[str]:
    """About `budget` characters of documents, spread over the corpus: files in a seeded random order, each
    contributing at most max(budget / n_files, 64 KiB), so many files give a random subset of whole files
    and a few big ones give a slice of each."""
    order = random.Random(seed).sample(list(files), len(files))
    per_file = max(budget // max(len(order), 1), 1 << 16)
    total = 0
    for path in order:
        taken = 0
        for doc in iter_documents(path, text_field):
            if not isinstance(doc, str):  # a pre-tokenized document: no text to learn from
                continue
            doc = doc[: min(per_file - taken, budget - total)]
            yield doc
            taken += len(doc)
            total += len(doc)
            if taken >= per_file or total >= budget:
                break
        if total >= budget:
            return


def get_tokenizer(cfg: DataConfig, files: Sequence[Path], vocab_size: int, run_dir: str | Path) -> Tokenizer:
    """The run's tokenizer: the one saved in `run_dir` when resuming (whatever the config says now), else
    `cfg.tokenizer`, else a byte-level BPE trained on a sample of `files`; saved into `run_dir` when new."""
    run_dir = Path(run_dir)
    saved = tokenizer_file_in(run_dir) if run_dir.is_dir() else None
    if saved is not None:
        tok = load_tokenizer(saved)
    elif cfg.tokenizer:
        tok = load_tokenizer(cfg.tokenizer)
    else:
        tok = train_bpe(training_sample(files, cfg.text_field, cfg.tokenizer_sample_bytes, cfg.seed), vocab_size)
    if tok.vocab_size > vocab_size:
        raise HlatError(
            f"the tokenizer has {tok.vocab_size} tokens but model.vocab_size is {vocab_size}: "
            f"set model.vocab_size to at least {tok.vocab_size}"
        )
    if saved is None:
        tok.save(run_dir)
    return tok
