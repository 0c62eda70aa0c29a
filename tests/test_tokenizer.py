"""Tokenizers: training is deterministic and lossless; reference tokenizers give the ids of their own libraries."""

import base64
import json
import pickle
import sys
from pathlib import Path

import pytest

from hlat import HlatError
from hlat.data.config import DataConfig
from hlat.data.tokenizer import get_tokenizer, load_tokenizer, train_bpe, training_sample

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "tokenizers"
needs_reference = pytest.mark.skipif(not REFERENCE.is_dir(), reason=f"no reference tokenizers at {REFERENCE}")

TEXTS = [
    "Hello world!  It's 2024.\n\tdef f(x):\n    return x**2  # ünïcödé 日本語 🙂",
    "   leading spaces and trailing ones   ",
    "Ça va? Ελληνικά, русский, عربى.\r\n\n\n",
]
TRAIN = [f"def function_{i}(value):\n    return value * {i} + {i * i}  # comment number {i}\n" for i in range(300)] + [
    "The quick brown fox jumps over the lazy dog. " * 20
]


def test_training_is_deterministic_and_lossless():
    a, b = train_bpe(iter(TRAIN), 400), train_bpe(iter(TRAIN), 400)
    assert a.vocab_size == 400 and a.kind == "hf"
    assert a.decode([a.eos_id]) == "<|endoftext|>"
    assert a._tok.to_str() == b._tok.to_str()
    ids = a.encode_batch(TEXTS + TRAIN[:3])
    assert ids == b.encode_batch(TEXTS + TRAIN[:3])
    assert all(0 <= i < a.vocab_size for seq in ids for i in seq)
    # byte-level: any text round-trips, including characters never seen in training
    assert [a.decode(seq) for seq in ids] == TEXTS + TRAIN[:3]
    # merges were learnt: the training text needs far fewer tokens than bytes
    assert len(ids[-1]) < len(TRAIN[2].encode()) / 3


def test_eos_text_in_a_document_is_not_eos():
    tok = train_bpe(iter(TRAIN), 300)
    (ids,) = tok.encode_batch(["a <|endoftext|> b"])
    assert tok.eos_id not in ids and tok.decode(ids) == "a <|endoftext|> b"


def test_vocab_too_small_for_bytes():
    with pytest.raises(HlatError, match="vocab_size 200 is too small"):
        train_bpe(iter(TRAIN), 200)


def _corpus(tmp_path, n_files=40):
    files = []
    for i in range(n_files):
        path = tmp_path / "corpus" / f"f{i:02d}.txt"
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"file {i}: " + "x" * 100)
        files.append(path)
    return files


def test_training_sample_is_spread_and_bounded(tmp_path):
    files = _corpus(tmp_path)
    sample = list(training_sample(files, "text", budget=1000, seed=0))
    assert sum(map(len, sample)) == 1000  # 40 files x 108 characters: the budget cuts the last document
    picked = {int(doc.split(":")[0].split()[1]) for doc in sample}
    assert len(picked) == 10 and max(picked) >= 20  # not just the first files
    assert sample == list(training_sample(files, "text", budget=1000, seed=0))
    assert sample != list(training_sample(files, "text", budget=1000, seed=1))
    # a single big file is sliced, not read whole
    big = tmp_path / "big.txt"
    big.write_text("y" * 100_000)
    assert sum(map(len, training_sample([big], "text", budget=500, seed=0))) == 500


def test_get_tokenizer_trains_saves_and_resumes(tmp_path, monkeypatch):
    files = _corpus(tmp_path)
    run = tmp_path / "run"
    tok = get_tokenizer(DataConfig(), files, 300, run)
    assert (run / "tokenizer.json").is_file() and tok.vocab_size <= 300
    # resuming loads the saved tokenizer, never retrains nor reads cfg.tokenizer
    monkeypatch.setattr("hlat.data.tokenizer.train_bpe", lambda *a: pytest.fail("retrained on resume"))
    again = get_tokenizer(DataConfig(tokenizer="/nonexistent.json"), files, 300, run)
    assert again.encode_batch(TEXTS) == tok.encode_batch(TEXTS)


def test_get_tokenizer_copies_a_given_tokenizer_and_checks_vocab(tmp_path):
    src = train_bpe(iter(TRAIN), 400).save(tmp_path / "src")
    tok = get_tokenizer(DataConfig(tokenizer=str(src)), [], 400, tmp_path / "run")
    assert load_tokenizer(tmp_path / "run").encode_batch(TEXTS) == tok.encode_batch(TEXTS)
    with pytest.raises(HlatError, match="has 400 tokens but model.vocab_size is 300"):
        get_tokenizer(DataConfig(tokenizer=str(src)), [], 300, tmp_path / "run2")
    assert not (tmp_path / "run2" / "tokenizer.json").exists()


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing.json", "file not found"),
        ("bad.json", "not a tokenizers tokenizer.json"),
        ("bad.model", "not a SentencePiece model"),
        ("vocab.txt", "unsupported format"),
    ],
)
def test_load_errors(tmp_path, name, message):
    if name != "missing.json":
        (tmp_path / name).write_text("{}" if name.endswith(".json") else "junk")
    with pytest.raises(HlatError, match=message):
        load_tokenizer(tmp_path / name)


def test_missing_optional_package_is_a_clear_error(tmp_path, monkeypatch):
    (tmp_path / "t.tiktoken").write_text("YQ== 0\n")
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    monkeypatch.setitem(sys.modules, "tiktoken.load", None)
    with pytest.raises(HlatError, match=r"needs the optional package 'tiktoken.*hlat\[formats\]"):
        load_tokenizer(tmp_path / "t.tiktoken")


# --- reference tokenizers -------------------------------------------------------------------------------


def _gpt2_tiktoken_file(directory: Path) -> Path:
    """GPT-2's ranks in the tiktoken file format, built by tiktoken from the original release files."""
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks

    gpt2 = REFERENCE / "gpt2"
    ranks = data_gym_to_mergeable_bpe_ranks(str(gpt2 / "vocab.bpe"), str(gpt2 / "encoder.json"))
    path = directory / "gpt2.tiktoken"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for t, r in ranks.items()))
    return path


@needs_reference
def test_gpt2_matches_transformers_in_both_formats(tmp_path):
    from transformers import GPT2Tokenizer

    vocab = json.loads((REFERENCE / "gpt2" / "encoder.json").read_text())
    lines = (REFERENCE / "gpt2" / "vocab.bpe").read_text().splitlines()[1:]  # after the "#version" header
    merges = [tuple(line.split()) for line in lines if line]
    expected = [GPT2Tokenizer(vocab=vocab, merges=merges).encode(t, add_special_tokens=False) for t in TEXTS]
    hf = load_tokenizer(REFERENCE / "gpt2")  # the directory: vocab.bpe + encoder.json
    tt = load_tokenizer(_gpt2_tiktoken_file(tmp_path))
    for tok, kind in ((hf, "hf"), (tt, "tiktoken")):
        assert (tok.kind, tok.vocab_size, tok.eos_id) == (kind, 50257, 50256)
        assert tok.encode_batch(TEXTS) == expected
        assert [tok.decode(ids) for ids in expected] == TEXTS
        saved = tok.save(tmp_path / kind)
        assert load_tokenizer(saved).encode_batch(TEXTS) == expected


@needs_reference
def test_a_tiktoken_file_named_model_is_not_sentencepiece(tmp_path):
    path = _gpt2_tiktoken_file(tmp_path).rename(tmp_path / "tokenizer.model")  # how Llama 3 ships its BPE
    assert load_tokenizer(path).kind == "tiktoken"


@needs_reference
def test_gpt_neox_matches_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    path = REFERENCE / "gpt-neox-20b" / "tokenizer.json"
    ref = PreTrainedTokenizerFast(tokenizer_file=str(path))
    tok = load_tokenizer(path)
    assert (tok.eos_id, tok.vocab_size) == (0, len(ref))
    assert ref.convert_ids_to_tokens(tok.eos_id) == "<|endoftext|>"
    expected = [ref.encode(t, add_special_tokens=False) for t in TEXTS]
    assert tok.encode_batch(TEXTS) == expected
    assert load_tokenizer(tok.save(tmp_path)).encode_batch(TEXTS) == expected


@needs_reference
def test_llama_sentencepiece_matches_sentencepiece(tmp_path):
    import sentencepiece as spm

    path = REFERENCE / "llama-sp-32k" / "tokenizer.model"
    ref = spm.SentencePieceProcessor(model_file=str(path))
    tok = load_tokenizer(path)
    assert (tok.kind, tok.vocab_size, tok.eos_id) == ("sentencepiece", 32000, 2)
    expected = [ref.encode(t) for t in TEXTS]
    assert tok.encode_batch(TEXTS) == expected
    assert [tok.decode(ids) for ids in expected] == [ref.decode(ids) for ids in expected]
    assert load_tokenizer(tok.save(tmp_path)).encode_batch(TEXTS) == expected


def test_a_pickled_tokenizer_encodes_alike():
    """Worker processes get the tokenizer pickled: a copy must not start encoding "<|endoftext|>" as EOS."""
    tok = train_bpe(iter(TRAIN), 300)
    copy = pickle.loads(pickle.dumps(tok))
    texts = TEXTS + ["a <|endoftext|> b"]
    assert copy.encode_batch(texts) == tok.encode_batch(texts) and tok.eos_id not in copy.encode_batch(texts)[-1]


@needs_reference
def test_pickled_reference_tokenizers_encode_alike(tmp_path):
    texts = TEXTS + ["a <|endoftext|> b </s>"]
    for tok in (
        load_tokenizer(REFERENCE / "gpt2"),
        load_tokenizer(_gpt2_tiktoken_file(tmp_path)),
        load_tokenizer(REFERENCE / "gpt-neox-20b"),
        load_tokenizer(REFERENCE / "llama-sp-32k"),
    ):
        copy = pickle.loads(pickle.dumps(tok))
        assert (copy.kind, copy.eos_id, copy.vocab_size) == (tok.kind, tok.eos_id, tok.vocab_size)
        assert copy.encode_batch(texts) == tok.encode_batch(texts), tok.kind
