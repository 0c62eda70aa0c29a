"""Data path: corpus resolution, document reading, packing and exact resume."""

import json
import logging
from collections import Counter
import sysconfig
from pathlib import Path

import pytest
import torch

from hlat import HlatError
from hlat.config import ConfigError, update
from hlat.data.config import DataConfig
from hlat.data.packing import PackedStream, build_stream
from hlat.data.sources import default_corpus, iter_documents, resolve_paths, skipped
from hlat.data.tokenizer import train_bpe

EOS = 0


class CharTokenizer:
    """One token per character (id = code point + 1, EOS = 0): the expected stream is computable by hand.
    Records every text it encodes."""

    kind, vocab_size, eos_id = "chars", 0x110000 + 1, EOS

    def __init__(self):
        self.encoded: list[str] = []

    def encode_batch(self, texts):
        self.encoded.extend(texts)
        return [[ord(c) + 1 for c in t] for t in texts]

    def decode(self, ids):  # EOS shows as NUL, which the test documents never contain
        return "".join("\0" if i == EOS else chr(i - 1) for i in ids)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def jsonl(path: Path, docs: list[str]) -> Path:
    return write(path, "".join(json.dumps({"text": d}) + "\n" for d in docs))


def expected_tokens(docs: list[str]) -> list[int]:
    return [t for d in docs for t in [ord(c) + 1 for c in d] + [EOS]]


def take(stream, n):
    """n batches as (inputs, targets) pairs."""
    return [(b["inputs"], b["targets"]) for b in (next(stream) for _ in range(n))]


def flatten(batches) -> list[int]:
    """The token stream the batches were cut from (each row repeats the previous row's last token)."""
    tokens: list[int] = []
    for inputs, targets in batches:
        for x, y in zip(inputs.tolist(), targets.tolist()):
            tokens.extend((x[1:] if tokens else x) + y[-1:])
    return tokens


def test_default_corpus_is_the_stdlib():
    files = default_corpus()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" and f.resolve().is_relative_to(stdlib) for f in files)
    assert not any(part in ("site-packages", "dist-packages") for f in files for part in f.parts)
    assert stdlib / "json" / "decoder.py" in {f.resolve() for f in files}


def test_resolve_paths(tmp_path):
    a = write(tmp_path / "d" / "a.txt", "a")
    b = write(tmp_path / "d" / "sub" / "b.py", "b")
    c = jsonl(tmp_path / "c.jsonl", ["c"])
    write(tmp_path / "d" / "ignored.bin", "x")
    files = resolve_paths([str(tmp_path / "d"), str(tmp_path / "*.jsonl"), str(a), str(tmp_path / "**" / "*.py")])
    assert files == sorted([a.resolve(), b.resolve(), c.resolve()])


@pytest.mark.parametrize("make, message", [
    (lambda d: [str(d / "nope.txt")], "data.paths: no files match '.*nope.txt'"),
    (lambda d: [str(d / "*.md")], r"data.paths: no files match '.*\*.md'"),
    (lambda d: [str(write(d / "x.bin", "x"))], "unsupported file type '.*x.bin'"),
    (lambda d: [str(write(d / "empty.txt", ""))], "the corpus is empty"),
    (lambda d: [], "the corpus is empty"),
])
def test_resolve_paths_errors(tmp_path, make, message):
    with pytest.raises(HlatError, match=message):
        resolve_paths(make(tmp_path))


def test_jsonl_bad_lines_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"text": "first"}\n'
        b'{"text": "broken\n'
        b'\n'
        b'{"text": "\xff\xfe"}\n'
        b'{"body": "wrong field"}\n'
        b'{"text": "  "}\n'
        b'["not an object"]\n'
        b'{"text": "second", "id": 7}\n'
    )
    before = skipped.copy()
    with caplog.at_level(logging.WARNING, logger="hlat.data.sources"):
        assert list(iter_documents(path, "text")) == ["first", "second"]
    delta = skipped - before
    assert delta == {"malformed JSON": 1, "invalid UTF-8": 1, "no string field 'text'": 2, "empty document": 1}
    assert f"{path}:2" in caplog.text
    assert list(iter_documents(path, "body")) == ["wrong field"]


def test_text_files_are_whole_documents(tmp_path):
    text = write(tmp_path / "a.md", "# title\n\nbody\n")
    bad = tmp_path / "b.txt"
    bad.write_bytes(b"caf\xe9")
    before = skipped["invalid UTF-8"]
    assert list(iter_documents(text)) == ["# title\n\nbody\n"]
    assert list(iter_documents(bad)) == [] and skipped["invalid UTF-8"] == before + 1


def test_batches_are_the_packed_token_stream(tmp_path):
    docs = [f"document number {i} " + "z" * i for i in range(30)]
    files = [jsonl(tmp_path / "a.jsonl", docs[:20]), jsonl(tmp_path / "b.jsonl", docs[20:])]
    B, S = 3, 16
    stream = PackedStream(files, CharTokenizer(), seq_len=S, batch_size=B, shuffle_files=False)
    tokens = expected_tokens(docs) * 3  # a few epochs, in file order
    for k, (inputs, targets) in enumerate(take(stream, 20)):
        assert inputs.shape == targets.shape == (B, S) and inputs.dtype == targets.dtype == torch.long
        for r in range(B):
            row = tokens[(k * B + r) * S : (k * B + r + 1) * S + 1]  # rows share one token with the next
            assert inputs[r].tolist() == row[:-1] and targets[r].tolist() == row[1:]
    assert stream.epoch >= 1


def test_shuffled_epochs_cover_every_file_once(tmp_path):
    letters = "abcdefgh"
    files = [write(tmp_path / f"{c}.txt", c * 3) for c in letters]
    make = lambda seed: PackedStream(files, CharTokenizer(), seq_len=4, batch_size=2, seed=seed)  # noqa: E731
    tokens = flatten(take(make(5), 12))  # 97 tokens: 3 epochs of 8 documents of 4 tokens, and one more
    docs = CharTokenizer().decode(tokens).split("\0")
    epochs = [[d[0] for d in docs[i * 8 : (i + 1) * 8]] for i in range(3)]
    assert all(sorted(e) == list(letters) for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != list(letters)
    assert flatten(take(make(5), 12)) == tokens and flatten(take(make(6), 12)) != tokens


@pytest.mark.parametrize("corpus", ["mid_file", "epochs"])
def test_exact_resume(tmp_path, corpus):
    if corpus == "mid_file":  # many documents per file: the state lands inside a file and inside the buffer
        docs = [[f"doc {i}.{j} " + "w" * (j % 7) for j in range(40)] for i in range(3)]
        files = [jsonl(tmp_path / f"{i}.jsonl", d) for i, d in enumerate(docs)]
        files.append(write(tmp_path / "t.txt", "a whole text file " * 5))
        seq_len, batch_size = 24, 2
    else:  # a tiny corpus: ten batches go through several epochs
        files = [write(tmp_path / "a.txt", "alpha beta"), write(tmp_path / "b.txt", "gamma")]
        seq_len, batch_size = 5, 2
    make = lambda tok: PackedStream(files, tok, seq_len, batch_size, seed=3)  # noqa: E731
    full_tok = CharTokenizer()
    full = make(full_tok)
    reference, states, encoded_before = [], [], []
    for _ in range(10):
        reference.append(next(full))
        states.append(json.loads(json.dumps(full.state_dict())))  # the state survives JSON
        encoded_before.append(len(full_tok.encoded))
    if corpus == "mid_file":
        assert states[3]["doc_index"] > 0 and states[3]["buffer"]
    else:
        assert states[-1]["epoch"] >= 3
    for k in range(1, 10):
        tok = CharTokenizer()
        resumed = make(tok)
        resumed.load_state_dict(states[k - 1])
        for expected in reference[k:]:
            got = next(resumed)
            assert all(torch.equal(got[key], expected[key]) for key in ("inputs", "targets"))
        # nothing consumed before the state is tokenized again: the restored stream encodes exactly
        # what the uninterrupted one encoded after that point
        assert tok.encoded == full_tok.encoded[encoded_before[k - 1] :]


def test_state_from_another_corpus_is_refused(tmp_path):
    files = [write(tmp_path / f"{i}.txt", "text") for i in range(3)]
    state = PackedStream(files, CharTokenizer(), 4, 1).state_dict()
    with pytest.raises(HlatError, match="saved data position is for 3 files per rank on 1 ranks"):
        PackedStream(files[:2], CharTokenizer(), 4, 1).load_state_dict(state)


def test_ranks_split_files_round_robin(tmp_path):
    files = [write(tmp_path / f"{i}.txt", chr(ord("a") + i)) for i in range(5)]
    streams = [PackedStream(files, CharTokenizer(), 4, 1, shuffle_files=False, rank=r, world_size=2) for r in (0, 1)]
    assert flatten(take(streams[0], 1)) == expected_tokens(["a", "c", "e"])[:5]
    assert flatten(take(streams[1], 1)) == expected_tokens(["b", "d", "b"])[:5]  # b again: the next epoch
    with pytest.raises(HlatError, match="5 files cannot be shared among 8 ranks"):
        PackedStream(files, CharTokenizer(), 2, 1, world_size=8)


def test_a_corpus_without_documents_is_an_error(tmp_path):
    files = [jsonl(tmp_path / "a.jsonl", []), write(tmp_path / "b.txt", "   ")]
    with pytest.raises(HlatError, match="no documents in the 2 files"):
        next(PackedStream(files, CharTokenizer(), 4, 1))


def test_build_stream_with_a_trained_tokenizer(tmp_path):
    docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(50)]
    files = [jsonl(tmp_path / "code.jsonl", docs), write(tmp_path / "notes.md", "# Notes\n\nSome prose. " * 20)]
    tok = train_bpe(iter(docs), 300)
    cfg = DataConfig(seed=1, shuffle_files=False, shuffle_rows=0)
    (inputs, targets), = take(build_stream(cfg, tok, files, seq_len=32, batch_size=4), 1)
    assert inputs.shape == (4, 32) and int(inputs.max()) < tok.vocab_size
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and torch.equal(inputs[1:, 0], targets[:-1, -1])
    first_eos = inputs.flatten().tolist().index(tok.eos_id)
    assert tok.decode(inputs.flatten()[:first_eos].tolist()) == docs[0]


@pytest.mark.parametrize("data, message", [
    ({"tokenizer_sample_bytes": 0}, "data.tokenizer_sample_bytes: must be positive"),
    ({"seed": -1}, "data.seed: must be >= 0"),
    ({"text_field": ""}, "data.text_field: must name a JSONL field"),
    ({"paths": ["a", " "]}, r"data.paths\[1\]: empty path"),
])
def test_config_validation(data, message):
    with pytest.raises(ConfigError, match=message):
        update(DataConfig(), data, "data.").validate()
    assert update(DataConfig(), {"paths": ["x/*.jsonl"], "seed": 3}, "data.").validate().seed == 3


def test_row_shuffle_mixes_and_resumes_exactly(tmp_path):
    from hlat.data.packing import RowShuffle

    files = [jsonl(tmp_path / f"{i}.jsonl", [f"file {i} doc {j} " * 3 for j in range(20)]) for i in range(4)]

    def stream():
        return RowShuffle(PackedStream(files, CharTokenizer(), seq_len=8, batch_size=1, shuffle_files=False),
                          pool_rows=16, batch_size=4, seed=3)

    plain = PackedStream(files, CharTokenizer(), seq_len=8, batch_size=1, shuffle_files=False)
    plain_rows = [torch.cat([x[0], y[0, -1:]]).tolist() for x, y in take(plain, 16 + 40)]
    batches = take(stream(), 10)
    shuffled_rows = [torch.cat([x, y[:, -1:]], 1).tolist() for x, y in batches]
    emitted = [row for rows in shuffled_rows for row in rows]
    assert emitted != plain_rows[:40]  # mixed...
    emitted_count, plain_count = Counter(map(tuple, emitted)), Counter(map(tuple, plain_rows))
    assert not emitted_count - plain_count  # ...and never repeated: each row of the stream at most once
    for k in (1, 4, 7):
        s = stream()
        take(s, k)
        state = json.loads(json.dumps(s.state_dict()))
        restored = stream()
        restored.load_state_dict(state)
        for (x, y), (x2, y2) in zip(batches[k:], take(restored, 10 - k)):
            assert torch.equal(x, x2) and torch.equal(y, y2)
