"""Data path: sources and formats, bad input, packing, mixing, sharding and exact resume."""

import gzip
import json
import logging
import os
import random
import string
import subprocess
import sys
import sysconfig
from collections import Counter
from itertools import accumulate
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard

from hlat import HlatError
from hlat.data.cli import tokenize
from hlat.data.config import DataConfig
from hlat.data.packing import build_stream
from hlat.data.readers import START, iter_documents, read_split
from hlat.data.records import Bad, BadLog, skipped
from hlat.data.rounds import best_fit
from hlat.data.sources import Source, default_corpus, one_source, resolve_data_files, resolve_paths, resolve_sources
from hlat.data.splits import Split, make_splits
from hlat.data.tokenizer import PROBE, train_bpe
from hlat.fields import ConfigError, update

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


def lines(docs: list[str]) -> bytes:
    return "".join(json.dumps({"text": d}) + "\n" for d in docs).encode()


def jsonl(path: Path, docs: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(lines(docs))
    return path


def stream(files, seq_len=16, batch_size=2, tok=None, **cfg):
    """A stream over `files` in file order, without the row pool unless asked for."""
    cfg = DataConfig(**{"shuffle_files": False, "shuffle_rows": 0, "workers": 0, **cfg})
    return build_stream(cfg, tok or CharTokenizer(), one_source(files), seq_len, batch_size)


def take(s, n):
    return [next(s) for _ in range(n)]


def rows_of(batches) -> list[list[int]]:
    """The packed rows (seq_len + 1 tokens, padding as -1) the batches were made from."""
    out = []
    for b in batches:
        for x, y in zip(b["inputs"].tolist(), b["targets"].tolist()):
            out.append([x[0]] + [-1 if t == -100 else t for t in y])
    return out


def concat_tokens(batches) -> list[int]:
    """The token stream concat rows were cut from (each row repeats the previous row's last token)."""
    tokens: list[int] = []
    for row in rows_of(batches):
        tokens.extend(row[1:] if tokens else row)
    return tokens


def docs_in(tokens) -> list[str]:
    return CharTokenizer().decode(tokens).split("\0")


def same(a, b) -> bool:
    return len(a) == len(b) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a, b)
    )


# --- finding files ---------------------------------------------------------------------------------------


def test_default_corpus_is_the_stdlib():
    files = default_corpus()
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert len(files) > 100 and files == sorted(files)
    assert all(f.suffix == ".py" and f.resolve().is_relative_to(stdlib) for f in files)
    assert not any(part in ("site-packages", "dist-packages") for f in files for part in f.parts)
    assert stdlib / "json" / "decoder.py" in {f.resolve() for f in files}
    assert resolve_data_files(DataConfig()) == files


def test_resolve_paths(tmp_path):
    a = write(tmp_path / "d" / "a.txt", "a")
    b = write(tmp_path / "d" / "sub" / "b.py", "b")
    c = jsonl(tmp_path / "c.jsonl", ["c"])
    z = tmp_path / "d" / "z.jsonl.zst"
    z.write_bytes(zstandard.ZstdCompressor().compress(lines(["z"])))
    write(tmp_path / "d" / "ignored.bin", "x")
    files = resolve_paths([str(tmp_path / "d"), str(tmp_path / "*.jsonl"), str(a), str(tmp_path / "**" / "*.py")])
    assert files == sorted([a.resolve(), b.resolve(), c.resolve(), z.resolve()])
    # fsspec URLs pass through as strings
    assert resolve_paths([f"file://{tmp_path}/*.jsonl"]) == [f"file://{c}"]
    assert list(iter_documents(f"file://{c}")) == ["c"]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: [str(d / "nope.txt")], "data.paths: no files match '.*nope.txt'"),
        (lambda d: [str(d / "*.md")], r"data.paths: no files match '.*\*.md'"),
        (lambda d: [str(write(d / "x.bin", "x"))], "unsupported file type '.*x.bin'"),
        (lambda d: [str(write(d / "empty.txt", ""))], "the corpus is empty"),
        (lambda d: [], "the corpus is empty"),
        (lambda d: ["nosuchfs://bucket/x.jsonl"], "cannot open 'nosuchfs://bucket/x.jsonl'"),
    ],
)
def test_resolve_paths_errors(tmp_path, make, message):
    with pytest.raises(HlatError, match=message):
        resolve_paths(make(tmp_path))


def test_named_sources(tmp_path):
    prose = jsonl(tmp_path / "prose" / "a.jsonl", ["p"])
    web = jsonl(tmp_path / "web" / "b.jsonl", ["w"])
    code = write(tmp_path / "code" / "c.py", "x = 1")
    cfg = DataConfig(
        sources=[
            f"prose:0.7:{tmp_path}/prose",
            f"prose:0.7:{tmp_path}/web/*.jsonl",
            f"code:0.3:file://{tmp_path}/code/*.py",
        ]
    ).validate()
    sources = resolve_sources(cfg)
    assert [(s.name, s.weight, s.files) for s in sources] == [
        ("prose", 0.7, [prose.resolve(), web.resolve()]),
        ("code", 0.3, [f"file://{code}"]),
    ]
    assert resolve_data_files(cfg) == sorted([prose.resolve(), web.resolve(), f"file://{code}"], key=str)
    with pytest.raises(HlatError, match="data source 'code': data.paths: no files match"):
        resolve_sources(DataConfig(sources=[f"code:1:{tmp_path}/nothing/*.py"]))


@pytest.mark.parametrize(
    "data, message",
    [
        ({"tokenizer_sample_bytes": 0}, "data.tokenizer_sample_bytes: must be positive"),
        ({"seed": -1}, "data.seed: must be >= 0"),
        ({"workers": -1}, "data.workers: must be >= 0"),
        ({"text_field": ""}, "data.text_field: must name a JSONL field"),
        ({"paths": ["a", " "]}, r"data.paths\[1\]: empty path"),
        ({"packing": "greedy"}, "data.packing: 'greedy' is not one of 'concat', 'best_fit'"),
        ({"max_bad_fraction": 1.5}, r"data.max_bad_fraction: must be in \[0, 1\]"),
        ({"sources": ["a:1:x"], "paths": ["y"]}, "set data.paths .* or data.sources .*, not both"),
        ({"sources": ["a:x"]}, r"data.sources\[0\]: 'a:x' is not 'name:weight:path'"),
        ({"sources": ["a:0:x"]}, "needs a name, a positive weight and a path"),
        ({"sources": ["a:1:x", "a:2:y"]}, "source 'a' has two weights, 1.0 and 2.0"),
    ],
)
def test_config_validation(data, message):
    with pytest.raises(ConfigError, match=message):
        update(DataConfig(), data, "data.").validate()
    assert update(DataConfig(), {"paths": ["x/*.jsonl"], "seed": 3}, "data.").validate().seed == 3


def test_a_missing_reader_names_the_package_it_needs(monkeypatch):
    """pyarrow and zstandard are dependencies of hlat (not of its `formats` extra): a broken install says which
    package to install."""
    from hlat.data.formats import format_reader

    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if it were not installed
    with pytest.raises(HlatError, match=r"reading \.parquet files needs .*'pyarrow': pip install pyarrow$"):
        format_reader("parquet", "reading .parquet files")


# --- formats and bad input -------------------------------------------------------------------------------


DOCS = [f"document {i}: " + "word " * (i % 7) for i in range(40)]


def each_format(tmp_path, docs=DOCS) -> list[Path]:
    """`docs` as JSONL, gzip and zstd JSONL, Parquet (4 row groups), Arrow IPC files in the file and the stream
    format (4 record batches); and docs[0] as a text file."""
    plain = jsonl(tmp_path / "d.jsonl", docs)
    gz, zst, parquet = tmp_path / "d.jsonl.gz", tmp_path / "d.jsonl.zst", tmp_path / "d.parquet"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    zst.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    table = pa.table({"id": list(range(len(docs))), "text": docs})
    pq.write_table(table, parquet, row_group_size=len(docs) // 4)
    arrows = [tmp_path / "d.arrow", tmp_path / "stream" / "d.arrow"]
    arrows[1].parent.mkdir()
    for path, new in zip(arrows, (pa.ipc.new_file, pa.ipc.new_stream)):
        with new(str(path), table.schema) as writer:
            for batch in table.to_batches(max_chunksize=len(docs) // 4):
                writer.write_batch(batch)
    return [plain, gz, zst, parquet, *arrows, write(tmp_path / "d.txt", docs[0])]


def test_every_format_reads_and_resumes_from_any_record(tmp_path):
    *record_files, text = each_format(tmp_path)
    assert list(iter_documents(text)) == [DOCS[0]]
    for f in record_files:
        assert list(iter_documents(f)) == DOCS, f
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(gzip.compress(lines(DOCS))[:-30])
    no_column = tmp_path / "body.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_column)
    cut_arrow = tmp_path / "cut.arrow"
    cut_arrow.write_bytes((tmp_path / "stream" / "d.arrow").read_bytes()[:-100])
    tokens = tokenize([record_files[0]], CharTokenizer(), tmp_path / "d")["file"]
    bad = (cut, cut_arrow, no_column, tmp_path / "missing.jsonl")
    for f in [*record_files, text, *bad, Path(tokens)]:
        records = list(read_split(Split(f, 0), (START, 0), "text", 1000))
        assert isinstance(records[-1][0], Bad) == (f in bad), f
        for k in range(1, len(records) + 1):  # reading on from the cursor after record k meets the records after it
            again = list(read_split(Split(f, 0), records[k - 1][2], "text", 1000))
            assert [(str(r), w, c) for r, w, c in again] == [(str(r), w, c) for r, w, c in records[k:]], (f, k)


def test_token_files_and_arrow_give_the_jsonl_token_stream(tmp_path):
    docs = [f"doc {i}: " + "pretokenized " * (i % 5) for i in range(60)]
    plain, *_, arrow_file, arrow_stream, _ = each_format(tmp_path, docs)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(plain.read_bytes() + b"{oops\n")  # skipped by the loader and by `hlat data tokenize` alike
    tok = train_bpe(iter(docs), 300)
    tokens = tokenize([bad], tok, tmp_path / "out" / "docs")
    assert tokens["documents"] == 60 and tokens["bad"] == {"malformed JSON": 1}
    cfg = dict(round_bytes=300, shuffle_rows=8, shuffle_files=True)
    reference = take(stream([plain], 16, 2, tok=tok, **cfg), 40)  # a few epochs
    for f in (arrow_file, arrow_stream, tokens["file"]):
        assert same(take(stream([f], 16, 2, tok=tok, **cfg), 40), reference), f
    with pytest.raises(HlatError, match="docs.tokens.bin: written by another tokenizer .* set data.tokenizer"):
        stream([tokens["file"]], 16, 2)  # the character tokenizer


def test_a_token_file_of_several_megabytes_gives_the_jsonl_token_stream(tmp_path):
    rng = random.Random(0)
    docs = [
        " ".join(rng.choice(string.ascii_lowercase) * rng.randint(1, 9) for _ in range(rng.randint(5, 300)))
        for _ in range(1500)
    ]
    plain = jsonl(tmp_path / "c.jsonl", docs)
    tokens = Path(tokenize([plain], CharTokenizer(), tmp_path / "c")["file"])  # what `hlat data tokenize` writes
    assert tokens.stat().st_size > 4 << 20 and len(make_splits([tokens], 1)) > 1  # big enough to be cut
    a, b = stream([plain], 1024, 8), stream([tokens], 1024, 8)  # an epoch and more
    assert all(same([next(a)], [next(b)]) for _ in range(tokens.stat().st_size // (4 * 1024 * 8) + 10))


@pytest.fixture
def small_splits(monkeypatch):
    monkeypatch.setattr("hlat.data.splits.MIN_SPLIT_BYTES", 64)  # split even these small test files


def test_jsonl_and_token_file_splits_cover_every_document_once(tmp_path, small_splits):
    f = jsonl(tmp_path / "big.jsonl", DOCS)
    splits = make_splits([f], world_size=4)  # a single file cut into line-aligned byte ranges
    assert len(splits) >= 8 and sum(s.size for s in splits) == f.stat().st_size
    got = [r for s in splits for r in read_split(s, (START, 0), "text", 1000)]
    assert [json.loads(r[0])["text"] for r in got] == DOCS
    assert any(s.start and " byte " in where for s in splits for _, where, _ in read_split(s, (START, 0), "text", 1000))
    tokens = Path(tokenize([f], CharTokenizer(), tmp_path / "big")["file"])
    splits = make_splits([tokens], world_size=4)  # at document boundaries
    assert len(splits) >= 4 and sum(s.size for s in splits) == tokens.stat().st_size
    got = [r for s in splits for r in read_split(s, (START, 0), "text", 1000)]
    assert CharTokenizer().decode([t for r in got for t in [*r[0].tolist(), EOS]]).split("\0")[:-1] == DOCS


def test_jsonl_bad_lines_are_skipped_and_counted(tmp_path, caplog):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"text": "first"}\n'
        b'{"text": "broken\n'
        b"\n"
        b'{"text": "\xff\xfe"}\n'
        b'{"body": "wrong field"}\n'
        b'{"text": "  "}\n'
        b'["not an object"]\n'
        b'{"text": "' + b"x" * 200 + b'"}\n'
        b'{"text": "second", "id": 7}\n'
    )
    bad = BadLog()
    with caplog.at_level(logging.WARNING, logger="hlat.data.records"):
        assert list(iter_documents(path, "text", max_bytes=100, bad=bad)) == ["first", "second"]
    assert bad.counts == {
        "malformed JSON": 1,
        "invalid UTF-8": 1,
        "no string field 'text'": 2,
        "empty document": 1,
        "document over 100 bytes": 1,
    }
    assert f"{path}:2" in caplog.text and f"{path}:8" in caplog.text  # file and line of each first skip
    assert list(iter_documents(path, "body")) == ["wrong field"]


def test_a_document_over_100_mb_is_skipped_without_holding_it(tmp_path):
    path = tmp_path / "huge.jsonl"
    with path.open("wb") as f:
        f.write(lines(["before"]) + b'{"text": "')
        for _ in range(101):
            f.write(b"y" * (1 << 20))
        f.write(b'"}\n' + lines(["after"]))
    before = skipped.counts["document over 100000000 bytes"]
    assert list(iter_documents(path)) == ["before", "after"]  # the default limit: 100 MB
    assert skipped.counts["document over 100000000 bytes"] == before + 1
    text = tmp_path / "huge.txt"
    text.write_bytes(b"z" * 1001)
    assert list(iter_documents(text, max_bytes=1000)) == []


@pytest.mark.parametrize(
    "suffix, compress", [(".jsonl.gz", gzip.compress), (".jsonl.zst", zstandard.ZstdCompressor().compress)]
)
def test_truncated_compressed_files_keep_what_came_before(tmp_path, suffix, compress):
    rng = random.Random(0)  # incompressible enough that half the file holds whole blocks
    docs = [f"doc {i} " + "".join(rng.choices(string.ascii_letters, k=50)) for i in range(10_000)]
    data = compress(lines(docs))
    path = tmp_path / f"cut{suffix}"
    path.write_bytes(data[: len(data) // 2])
    before = skipped.counts["truncated or corrupt file"]
    got = list(iter_documents(path))
    assert 100 < len(got) < len(docs) and got == docs[: len(got)]
    assert skipped.counts["truncated or corrupt file"] == before + 1


def test_bad_files_are_skipped_and_counted_in_the_stream(tmp_path, caplog):
    good = jsonl(tmp_path / "good.jsonl", DOCS)
    gone = jsonl(tmp_path / "gone.jsonl", ["never read"])
    no_column = tmp_path / "body.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_column)
    bad_text = tmp_path / "latin1.txt"
    bad_text.write_bytes(b"caf\xe9")
    files = resolve_paths([str(tmp_path)])
    gone.unlink()  # unreadable after the files were listed
    with caplog.at_level(logging.WARNING, logger="hlat.data.records"):
        s = stream(files, max_bad_fraction=0.5)
        tokens = concat_tokens(take(s, 60))
    assert docs_in(tokens)[: len(DOCS)] == DOCS
    reasons = ("unreadable file", "Parquet file with no column 'text'", "invalid UTF-8")
    assert s.epoch == 1 and s.sources[0].state.bad == {reason: 2 for reason in reasons}  # met in each of two epochs
    assert s.stats()["data_bad"] == 6 and str(gone) in caplog.text and str(no_column) in caplog.text
    assert caplog.text.count("skipped a bad record") == 3  # rate-limited; checking the data first does not warn
    assert good in files


def test_nothing_usable_is_an_error_before_training(tmp_path):
    no_column = tmp_path / "a.parquet"
    pq.write_table(pa.table({"body": ["x"]}), no_column)
    files = [no_column, jsonl(tmp_path / "b.jsonl", []), write(tmp_path / "c.txt", "   ")]
    with pytest.raises(
        HlatError,
        match=r"data source 'default': no documents in its 3 files \(1 Parquet file with "
        r"no column 'text', 1 empty document\)",
    ):
        stream(files)


def test_too_much_bad_data_is_an_error(tmp_path):
    path = tmp_path / "half.jsonl"
    path.write_bytes(b"".join(lines([f"doc {i}"]) if i % 2 else b"{oops\n" for i in range(200)))
    with pytest.raises(
        HlatError,
        match=r"100 of 200 records are bad \(100 malformed JSON\), more than "
        r"data.max_bad_fraction = 0.1",
    ):
        next(stream([path], max_bad_fraction=0.1))
    assert next(stream([path], max_bad_fraction=0.5))["inputs"].shape == (2, 16)


# --- packing ---------------------------------------------------------------------------------------------


def test_concat_rows_are_the_packed_token_stream(tmp_path):
    docs = [f"document number {i} " + "z" * i for i in range(30)]
    files = [jsonl(tmp_path / "a.jsonl", docs[:20]), jsonl(tmp_path / "b.jsonl", docs[20:])]
    s = stream(files, seq_len=16, batch_size=3, round_bytes=100)
    expected = [t for d in docs for t in [ord(c) + 1 for c in d] + [EOS]] * 3  # a few epochs, in file order
    batches = take(s, 30)
    for k, b in enumerate(batches):
        assert b["inputs"].shape == b["targets"].shape == (3, 16) and b["inputs"].dtype == torch.long
        assert set(b) == {"inputs", "targets"}
        for r in range(3):
            row = expected[(k * 3 + r) * 16 : (k * 3 + r + 1) * 16 + 1]  # rows share one token with the next
            assert b["inputs"][r].tolist() == row[:-1] and b["targets"][r].tolist() == row[1:]
    assert s.epoch >= 1
    # every document that a row start (rows 1 to 90, the one after the last emitted row included) falls
    # inside of is counted once as split
    ends = list(accumulate(len(d) + 1 for d in docs * 3))
    cut = sum(any(a < b < e for b in range(16, 90 * 16 + 1, 16)) for a, e in zip([0] + ends, ends))
    assert s.sources[0].state.split_docs == cut > 20


def test_best_fit_is_best_fit_decreasing():
    ids = [[1] * 6, [2] * 5, [3] * 4, [4] * 3, [5] * 2, [6] * 2, [7] * 9]  # with EOS: 7, 6, 5, 4, 3, 3, 10 tokens
    rows, cut = best_fit(ids, EOS, capacity=8)
    # longest first, each into the fullest row that still holds it; only the 10-token document is cut (8 + 2)
    assert cut == 1 and rows.tolist() == [
        [7] * 8,
        [1] * 6 + [0, -1],
        [2] * 5 + [0] + [7, 0],
        [3] * 4 + [0] + [5, 5, 0],
        [4] * 3 + [0] + [6, 6, 0, -1],
    ]


def test_best_fit_pads_and_splits_fewer_documents_than_concat(tmp_path):
    docs = [f"doc {i} " + "abcdefgh"[: i % 8] * (i % 13) for i in range(300)]
    files = [jsonl(tmp_path / "a.jsonl", docs)]
    fit, cat = (stream(files, seq_len=64, packing=p, round_bytes=1000) for p in ("best_fit", "concat"))
    fit_batches = take(fit, 70)  # about an epoch
    take(cat, 70)
    f, c = fit.stats(), cat.stats()
    assert f["data_split_fraction"] < 0.1 < 0.3 < c["data_split_fraction"]
    assert c["data_padding_fraction"] == 0 < f["data_padding_fraction"] < 0.1
    long_docs = [d for d in docs if len(d) + 1 > 65]
    for b in fit_batches:  # rows of whole documents, or pieces of longer ones, then padding
        for row in rows_of([b]):
            tokens = [t for t in row if t >= 0]
            assert row == tokens + [-1] * (len(row) - len(tokens))
            *whole, rest = docs_in(tokens)
            assert all(d in docs or any(x.endswith(d) for x in long_docs) for d in whole)
            assert not rest or (len(tokens) == 65 and any(rest in x for x in long_docs))
        padded = torch.tensor(rows_of([b])) < 0
        assert torch.equal(b["targets"] == -100, padded[:, 1:]) and (b["inputs"][padded[:, :-1]] == EOS).all()


def test_doc_ids_and_positions(tmp_path):
    files = [jsonl(tmp_path / "a.jsonl", ["abc", "de", "fghijklmn"])]
    b = next(
        build_stream(
            DataConfig(shuffle_files=False, shuffle_rows=0, workers=0),
            CharTokenizer(),
            one_source(files),
            seq_len=8,
            batch_size=2,
            doc_mask=True,
        )
    )
    # row 0: a b c EOS d e EOS f | row 1: (f) g h i j k l m n — its start continues a document
    assert b["doc_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0, 0, 0]]
    assert b["positions"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5, 6, 7]]


# --- mixing ----------------------------------------------------------------------------------------------


def test_mixing_proportions_over_a_million_tokens(tmp_path):
    for name, n in (("prose", 50), ("code", 80), ("math", 20)):
        for i in range(3):
            jsonl(tmp_path / name / f"{i}.jsonl", [f"{name} {i} {j} " + name[0] * (j * 7 % 300) for j in range(n)])
    cfg = DataConfig(
        sources=[f"prose:5:{tmp_path}/prose", f"code:3:{tmp_path}/code", f"math:2:{tmp_path}/math"],
        workers=0,
        shuffle_rows=64,
        round_bytes=4096,
    )
    s = build_stream(cfg, CharTokenizer(), resolve_sources(cfg), seq_len=512, batch_size=8)
    counts = Counter()
    for b in take(s, 250):  # 1,024,000 tokens
        for row in b["inputs"].tolist():
            counts[_source_of(row)] += len(row)
    total = sum(counts.values())
    assert total >= 1_000_000
    for name, weight in (("prose", 0.5), ("code", 0.3), ("math", 0.2)):
        assert abs(counts[name] / total - weight) < 0.02, counts
    again = build_stream(cfg, CharTokenizer(), resolve_sources(cfg), seq_len=512, batch_size=8)
    assert same(
        take(again, 3), take(build_stream(cfg, CharTokenizer(), resolve_sources(cfg), seq_len=512, batch_size=8), 3)
    )


def test_the_mix_counts_each_sources_rows_as_taken_and_holds_the_weights(tmp_path):
    """`DataStream.mix()` counts each source's token positions as its rows are taken: the count made here from the
    rows' own letters, kept through a resume. How close to the weights: the mixer gives each row to the source
    furthest behind its weight's share of the rows cut. A source's deficit w n - count (after n rows) grows by w
    each row and drops by 1 when it is chosen, which happens only while deficit + w is the largest of the k
    sources, hence at least 1/k (the deficits sum to 0): it never falls to -1, so none rises to k - 1 either.
    Whole shuffle windows are taken exactly as they were cut, so after n rows in whole windows each share is within
    (k - 1) / n of its weight: far inside the standard error sqrt(w (1 - w) / n) that drawing each row's source at
    random by weight would give (0.011 for w = 0.5 at these 1,984 rows, against 2 / 1,984)."""
    for name, n in (("prose", 50), ("code", 80), ("math", 20)):
        jsonl(tmp_path / name / "0.jsonl", [f"{name} {j} " + name[0] * (j * 7 % 300) for j in range(n)])
    cfg = DataConfig(
        sources=[f"prose:5:{tmp_path}/prose", f"code:3:{tmp_path}/code", f"math:2:{tmp_path}/math"],
        workers=0,
        shuffle_rows=64,
        round_bytes=4096,
    )
    s = build_stream(cfg, CharTokenizer(), resolve_sources(cfg), seq_len=64, batch_size=8)
    counts = Counter()
    for b in take(s, 31 * 64 // 8):  # 31 whole windows of 64 rows
        for row in b["inputs"].tolist():
            counts[_source_of(row)] += len(row)
    weights = {"prose": 0.5, "code": 0.3, "math": 0.2}
    assert s.mix() == {name: (pytest.approx(w), counts[name]) for name, w in weights.items()}
    rows = sum(counts.values()) // 64
    for name, w in weights.items():
        assert abs(counts[name] / 64 / rows - w) < (len(weights) - 1) / rows
    resumed = build_stream(cfg, CharTokenizer(), resolve_sources(cfg), seq_len=64, batch_size=8)
    resumed.load_state_dict(s.state_dict())
    assert resumed.mix() == s.mix()


def _source_of(row) -> str:
    """Rows never mix sources; each source's documents are made of its own letters."""
    letters = set(CharTokenizer().decode(row)) & set("pcm")
    return {"p": "prose", "c": "code", "m": "math"}[letters.pop()] if len(letters) == 1 else "?"


# --- sharding --------------------------------------------------------------------------------------------


def _epoch_docs(s) -> list[str]:
    """The documents a rank's stream reads in its first epoch."""
    tokens = []
    while s.epoch == 0:
        tokens += concat_tokens(take(s, 1))[1 if tokens else 0 :]
    return [d for d in docs_in(tokens) if d]


def test_ranks_read_disjoint_shares_that_cover_the_data(tmp_path, small_splits):
    docs = [f"doc-{i:03d}" for i in range(120)]
    files = [jsonl(tmp_path / f"{i}.jsonl", docs[i * 10 : i * 10 + 10]) for i in range(9)]  # 90 in JSONL...
    big = jsonl(tmp_path / "big.jsonl", docs[90:])  # ...and 30 in one file that is split among ranks
    seen = []
    for rank in range(3):
        cfg = DataConfig(shuffle_rows=0, workers=0, round_bytes=64)
        s = build_stream(cfg, CharTokenizer(), one_source([*files, big]), seq_len=8, batch_size=1, shard=(rank, 3))
        mine = set(_epoch_docs(s)) & set(docs)  # whole documents
        assert len(mine) >= 30  # balanced by bytes
        seen.append(mine)
    assert not (seen[0] & seen[1] or seen[0] & seen[2] or seen[1] & seen[2])
    assert set.union(*seen) == set(docs)


def test_a_rank_never_runs_out_and_resume_needs_the_same_ranks(tmp_path):
    files = [write(tmp_path / "a.txt", "a" * 500), write(tmp_path / "b.txt", "b")]
    small = build_stream(DataConfig(shuffle_rows=0, workers=0), CharTokenizer(), one_source(files), 8, 2, shard=(1, 2))
    take(small, 50)  # 50 epochs of its one short file: it keeps step with the rank holding the long one
    assert small.epoch > 20
    state = small.state_dict()
    with pytest.raises(
        HlatError,
        match="a position in the files of data-parallel rank 1 of 2, and this run reads "
        "the files of data-parallel rank 1 of 3",
    ):
        more = [*files, write(tmp_path / "c.txt", "c")]
        build_stream(DataConfig(workers=0), CharTokenizer(), one_source(more), 8, 2, shard=(1, 3)).load_state_dict(
            state
        )
    with pytest.raises(
        HlatError, match="a position in the files of data-parallel rank 1 of 2, and this run reads the global stream"
    ):
        build_stream(DataConfig(workers=0), CharTokenizer(), one_source(files), 8, 2).load_state_dict(state)
    with pytest.raises(HlatError, match="2 files cannot be shared among 3 data-parallel ranks"):
        build_stream(DataConfig(workers=0), CharTokenizer(), one_source(files), 8, 2, shard=(0, 3))


# --- exact resume ----------------------------------------------------------------------------------------


def _corpus(tmp_path) -> list[Path]:
    files = [
        jsonl(tmp_path / f"{i}.jsonl", [f"doc {i}.{j} " + "w" * (j * 5 % 37) for j in range(15)]) for i in range(3)
    ]
    return files + [write(tmp_path / "t.txt", "a whole text file, not <|endoftext|> " * 5)]


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_exact_resume_mid_document_and_mid_round(tmp_path, packing):
    files = _corpus(tmp_path)
    cfg = dict(packing=packing, round_bytes=300, shuffle_rows=6, seed=3, shuffle_files=True)
    full_tok = CharTokenizer()
    full = stream(files, 24, 2, tok=full_tok, **cfg)
    reference, states, encoded = [], [], []
    for _ in range(40):
        reference.append(next(full))
        states.append(json.loads(json.dumps(full.state_dict())))  # the state survives JSON
        encoded.append(len(full_tok.encoded))
    stride = 24 if packing == "concat" else 25
    positions = [st["sources"][0] for st in states]
    # states whose window starts inside a round and (concat) a document, states inside a window, and epochs
    assert any(p["rows"] * stride > p["at"] and (p["mid"] or packing == "best_fit") for p in positions)
    assert any(st["rows"] % 6 for st in states) and positions[-1]["start"][0] >= 1
    for k in (1, 7, 13, 29):
        tok = CharTokenizer()
        resumed = stream(files, 24, 2, tok=tok, **cfg)
        resumed.load_state_dict(states[k - 1])
        assert same(take(resumed, 40 - k), reference[k:])
        # resuming encodes again only the documents of the rounds the current window needs (a window of 6 rows
        # of ~25 tokens: 1 or 2 rounds of ~300 bytes, ~10 documents each), never what was consumed before: it
        # encodes what the uninterrupted run encoded from those rounds on
        assert tok.encoded[0] == PROBE  # what the fingerprint encodes to tell tokenizers apart
        again = len(tok.encoded) - 1 - (len(full_tok.encoded) - encoded[k - 1])
        assert 0 <= again <= 25 and tok.encoded[1:] == full_tok.encoded[len(full_tok.encoded) - len(tok.encoded) + 1 :]


def _two_sources(packing: str):
    """A stream of two sources, one with a bad record, over files named relative to the working directory (so
    that its fingerprint does not depend on where they are)."""
    prose, code = Path("prose.jsonl"), Path("code.jsonl")
    prose.write_bytes(b"{oops\n" + lines([f"prose {j} " + "p" * (j * 7 % 31) for j in range(20)]))
    code.write_bytes(lines([f"def f{j}(): return {j}\n" * (1 + j % 3) for j in range(20)]))
    cfg = DataConfig(packing=packing, round_bytes=80, shuffle_rows=5, seed=1, workers=0, max_bad_fraction=0.5)
    sources = [Source("prose", 0.7, [prose]), Source("code", 0.3, [code])]
    return build_stream(cfg, CharTokenizer(), sources, 12, 2)


# What _two_sources(packing) saved after 7 micro-batches, as hlat wrote it before the stream's state was grouped
# by source (commit e594610, STATE_VERSION 3), with the values that differ between packings filled in:
# checkpoints of that version must keep resuming.
SAVED_STATE = """{"version": 3, "fingerprint": {"sources": {"prose": {"weight": 0.7, "files": "9c23840e3d07178f"},
    "code": {"weight": 0.3, "files": "a9e96441d0d4742f"}}, "tokenizer": "7331116fd4a63b6f", "seq_len": 12,
    "packing": "%(packing)s", "round_bytes": 80, "text_field": "text", "max_doc_bytes": 100000000, "seed": 1,
    "shuffle_files": true, "shuffle_rows": 5}, "rows": 14, "sources": [{"round": 1, "start": [0, 0, 90, 5],
    "at": %(at)d, "rows": 7, "counted": 2, "mid": %(mid)s, "docs": 5, "bad": {"malformed JSON": 1}, "docs_epoch": 0,
    "pad": %(pad)d, "split_docs": 4}, {"round": 0, "start": [0, 0, -1, 0], "at": 0, "rows": 3, "counted": 1,
    "mid": %(mid)s, "docs": 2, "bad": {}, "docs_epoch": 0, "pad": 0, "split_docs": 2}]}"""
SAVED_VALUES = {"concat": {"at": 48, "mid": "true", "pad": 0}, "best_fit": {"at": 52, "mid": "false", "pad": 4}}


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_a_state_saved_by_an_earlier_hlat_resumes(tmp_path, monkeypatch, packing):
    monkeypatch.chdir(tmp_path)
    saved = json.loads(SAVED_STATE % {"packing": packing, **SAVED_VALUES[packing]})
    s = _two_sources(packing)
    take(s, 7)
    now = s.state_dict()  # the same format and position; the files and their sizes (data/changes.py) are added beside
    assert now["fingerprint"].pop("listing") == {"prose": {"prose.jsonl": 712}, "code": {"code.jsonl": 1080}}
    assert sum(now.pop("taken")) == now["rows"]  # and each source's rows taken (the data mix), also added
    assert now == saved
    resumed = _two_sources(packing)
    resumed.load_state_dict(saved)
    assert same(take(resumed, 12), take(s, 12))


@pytest.mark.parametrize("packing", ["concat", "best_fit"])
def test_workers_give_the_same_stream_and_resume_exactly(tmp_path, packing):
    files = _corpus(tmp_path)
    tok = train_bpe((d for f in files for d in iter_documents(f)), 300)
    cfg = dict(packing=packing, round_bytes=200, shuffle_rows=4, shuffle_files=True, seed=1)
    inline = take(stream(files, 16, 2, tok=tok, **cfg), 30)
    s = stream(files, 16, 2, tok=tok, workers=2, **cfg)
    for k in range(1, 25):  # stop where the state is inside a round, and for concat inside a document
        assert same([next(s)], inline[k - 1 : k])
        state = s.state_dict()
        position = state["sources"][0]
        inside = position["rows"] * (16 if packing == "concat" else 17) > position["at"]  # a round
        if k > 5 and position["round"] >= 2 and inside and (position["mid"] or packing == "best_fit"):
            break
    else:
        pytest.fail("never stopped inside a round and a document")
    procs = s._fetcher.procs
    s.close()
    assert len(procs) == 2 and not any(p.is_alive() for p in procs)
    resumed = stream(files, 16, 2, tok=tok, workers=2, **cfg)
    resumed.load_state_dict(state)
    assert same(take(resumed, 30 - k), inline[k:])
    resumed.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_a_stream_that_adopts_a_peers_rounds_makes_none_of_them_again(tmp_path, workers):
    """A replica group that heals takes the live group's position and the rounds its stream holds: its batches are
    those that loading the position gives, it makes only the rounds after the ones handed over (from where they
    end), and a peer whose rounds no longer reach back to the position hands over none."""
    files = _corpus(tmp_path)
    cfg = dict(round_bytes=200, shuffle_rows=4, shuffle_files=True, seed=1, workers=workers)
    peer = stream(files, 16, 2, **cfg)
    take(peer, 13)
    state, rounds = peer.state_dict(), peer.rounds_in_hand()
    reference = stream(files, 16, 2, **cfg)
    reference.load_state_dict(state)
    expected = take(reference, 30)
    first = state["sources"][0]["round"]
    handed = sum(info.size for (_, index), info in rounds["infos"].items() if index >= first)
    assert handed > 0 and all(index >= first for _, index in rounds["tokens"])
    s = stream(files, 16, 2, **cfg)
    s.adopt(state, rounds)
    assert same(take(s, 30), expected)
    assert s.tokenized == reference.tokenized - handed
    if workers:  # a worker makes its rounds in order: one started at a handed round would leave it unclaimed here
        last = max(index for _, index in rounds["infos"])
        assert all(index > last for _, index in s._fetcher.ready)
    take(peer, 20)
    stale = stream(files, 16, 2, **cfg)
    stale.adopt(state, peer.rounds_in_hand())  # the peer forgot the position's first round
    assert same(take(stale, 30), expected) and stale.tokenized == reference.tokenized
    for each in (peer, reference, s, stale):
        each.close()


def test_changed_settings_are_refused_unless_forced(tmp_path):
    files = _corpus(tmp_path)
    s = stream(files, packing="concat")
    take(s, 5)
    state = s.state_dict()
    with pytest.raises(
        HlatError,
        match=r"data settings changed since the checkpoint: packing 'concat' -> "
        r"'best_fit'.*data.force_resume",
    ):
        stream(files, packing="best_fit").load_state_dict(state)
    with pytest.raises(HlatError, match=r"the files of source 'default': removed \S*t.txt \(185 bytes\);"):
        stream(files[:3]).load_state_dict(state)
    other_tok = CharTokenizer()
    other_tok.vocab_size += 1
    with pytest.raises(HlatError, match="tokenizer"):
        stream(files, tok=other_tok).load_state_dict(state)
    forced = stream(files[:3], force_resume=True)
    forced.load_state_dict(state)
    assert same(take(forced, 3), take(stream(files[:3]), 3))  # afresh


def test_a_changed_data_set_is_reported_as_files(tmp_path):
    """A resume over changed files names the files added, removed and resized (not two hashes); a checkpoint
    from before file listings were kept says which source changed and that it cannot say which files."""
    files = _corpus(tmp_path)
    s = stream(files[:3])
    take(s, 2)
    state = s.state_dict()
    old = {**state, "fingerprint": {k: v for k, v in state["fingerprint"].items() if k != "listing"}}
    stream(files[:3]).load_state_dict(old)  # the same files: a checkpoint without listings resumes
    sizes = [f.stat().st_size for f in files]
    files[0].write_text(files[0].read_text() + '{"text": "one more"}\n')
    with pytest.raises(HlatError) as e:
        stream([files[0], files[2], files[3]]).load_state_dict(state)  # 0 grown, 1 removed, 2 kept, t.txt added
    assert (
        f"the files of source 'default': added {files[3]} ({sizes[3]:,} bytes); removed {files[1]} ({sizes[1]:,} bytes)"
    ) in str(e.value)
    assert f"; resized {files[0]} {sizes[0]:,} -> {sizes[0] + 21:,} bytes; resume with" in str(e.value)
    with pytest.raises(
        HlatError,
        match=r"the files of source 'default' \(listing hash '\w{16}' -> '\w{16}'; the "
        r"checkpoint predates file listings",
    ):
        stream(files[:2]).load_state_dict(old)


def test_build_stream_with_a_trained_tokenizer(tmp_path):
    docs = [f"def f{i}(x):\n    return x + {i}\n" for i in range(50)]
    files = [jsonl(tmp_path / "code.jsonl", docs), write(tmp_path / "notes.md", "# Notes\n\nSome prose. " * 20)]
    tok = train_bpe(iter(docs), 300)
    (b,) = take(stream(files, 32, 4, tok=tok), 1)
    inputs, targets = b["inputs"], b["targets"]
    assert inputs.shape == (4, 32) and int(inputs.max()) < tok.vocab_size
    assert torch.equal(inputs[:, 1:], targets[:, :-1]) and torch.equal(inputs[1:, 0], targets[:-1, -1])
    first_eos = inputs.flatten().tolist().index(tok.eos_id)
    assert tok.decode(inputs.flatten()[:first_eos].tolist()) == docs[0]


def test_workers_neither_hang_the_exit_nor_outlive_it(tmp_path):
    files = _corpus(tmp_path)
    code = f"""
import os
from hlat.data.cli import tokenize
from hlat.data.config import DataConfig
from hlat.data.packing import build_stream
from hlat.data.sources import one_source
from hlat.data.tokenizer import train_bpe
files = {[str(f) for f in files]!r}
s = build_stream(DataConfig(workers=2, round_bytes=100), train_bpe(["abc def"] * 10, 300), one_source(files), 8,
                 2)
next(s)
print(*(p.pid for p in s._fetcher.procs))
"""  # exits with the workers busy and the stream never closed
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for pid in map(int, done.stdout.split()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_a_dead_worker_or_vanished_data_is_an_error_not_a_hang(tmp_path):
    files = _corpus(tmp_path)
    tok = train_bpe(["abc def"] * 10, 300)
    s = stream(files, tok=tok, workers=1, round_bytes=100)
    next(s)
    s._fetcher.procs[0].kill()
    with pytest.raises(HlatError, match=r"data worker 0 died \(exit code -9\)"):
        take(s, 1000)
    s = stream(files, tok=tok, round_bytes=100)
    for f in files:
        f.unlink()
    with pytest.raises(HlatError, match="a whole epoch went by without a readable document"):
        take(s, 1000)
