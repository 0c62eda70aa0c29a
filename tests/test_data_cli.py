"""`hlat data inspect` and `hlat data bench`, run through their argument parser."""

import argparse
import json

import numpy as np
import pytest

from hlat import HlatError
from hlat.data.cli import add_arguments, run
from hlat.data.tokenizer import train_bpe

DOCS = [f"def f{i}(x):\n    return x + {i}\n" for i in range(30)]


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "data"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in DOCS[:20]) + "{oops\n" + '{"x": 1}\n')
    (d / "b.py").write_text(DOCS[20])
    (d / "c.txt").write_bytes(b"\xff")
    tok = train_bpe(iter(DOCS), 300)
    return d, tok, tok.save(tmp_path / "tok")


def test_inspect_counts_documents_tokens_and_bad_records(data, capsys):
    d, tok, tok_path = data
    assert run(parse(["inspect", str(d), "--tokenizer", str(tok_path), "--json"]), []) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["documents"] == 21 and result["characters"] == sum(map(len, DOCS[:21]))
    assert result["tokens"] == sum(map(len, tok.encode_batch(DOCS[:21])))
    assert result["bad"] == {"malformed JSON": 1, "no string field 'text'": 1, "invalid UTF-8": 1}
    (a, b, c) = result["files"]
    assert a["first_bad"] == {"malformed JSON": f"{d / 'a.jsonl'}:21", "no string field 'text'": f"{d / 'a.jsonl'}:22"}
    assert (b["documents"], c["documents"], c["bad"]) == (1, 0, {"invalid UTF-8": 1})
    assert run(parse(["inspect", str(d)]), []) == 0  # no tokenizer: no token counts
    table = capsys.readouterr().out
    assert "total" in table and f"1 x malformed JSON, first at {d / 'a.jsonl'}:21" in table and " - " in table


def test_bench_reports_the_tokenizer_and_the_loader(data, capsys):
    d, tok, tok_path = data
    argv = [
        "bench",
        str(d),
        "--tokenizer",
        str(tok_path),
        "--workers",
        "1",
        "--mb",
        "0.001",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--json",
    ]
    assert run(parse(argv), []) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["tokens"] == sum(len(ids) + 1 for ids in tok.encode_batch(DOCS[:21]))  # the same text
    (loader,) = result["loader"]
    assert loader["workers"] == 1 and loader["tokens_per_s"] > 0 and loader["tokenizer_tokens_per_s"] > 0
    with pytest.raises(HlatError, match="--workers: worker counts must be >= 0"):
        run(parse(["bench", str(d), "--workers", "-1"]), [])


def test_tokenize_writes_a_token_file_the_loader_reads(data, tmp_path, capsys):
    d, tok, tok_path = data
    out = tmp_path / "out" / "corpus"
    assert run(parse(["tokenize", str(d), "--tokenizer", str(tok_path), "--out", str(out), "--json"]), []) == 0
    result = json.loads(capsys.readouterr().out)
    ids = np.memmap(f"{out}.tokens.bin", dtype=np.uint16, mode="r")  # a vocabulary of 300 fits in 16 bits
    ends = np.load(f"{out}.tokens.idx.npy")
    expected = tok.encode_batch(DOCS[:21])  # the good documents, in file order
    assert result["documents"] == len(ends) == 21 and ends[-1] == len(ids) == sum(map(len, expected))
    assert [ids[a:b].tolist() for a, b in zip([0, *ends[:-1]], ends)] == expected
    assert sum(result["bad"].values()) == 3 and not list(out.parent.glob("*.partial"))
    assert run(parse(["inspect", f"{out}.tokens.bin", "--tokenizer", str(tok_path), "--json"]), []) == 0
    inspected = json.loads(capsys.readouterr().out)  # the token file read back: its documents and tokens
    assert (inspected["documents"], inspected["tokens"], inspected["characters"]) == (21, result["tokens"], 0)
    assert run(parse(["inspect", f"{out}.tokens.bin"]), []) == 0  # no tokenizer needed to count a token file's
    assert f"{21:>10,} {0:>13,} {result['tokens']:>12,} {0:>6,}  total" in capsys.readouterr().out
    with pytest.raises(HlatError, match="--tokenizer is required"):
        run(parse(["tokenize", str(d), "--out", str(out)]), [])
