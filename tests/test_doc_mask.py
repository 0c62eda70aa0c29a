"""model.doc_mask: a packed row gives every document the logits it gets when run alone."""

import json

import pytest
import torch

from hlat.data.config import DataConfig
from hlat.data.packing import build_stream
from hlat.data.sources import one_source
from hlat.data.tokenizer import train_bpe
from hlat.models import build_model
from hlat.models.config import model_config

DOCS = [f"def f{i}(x):\n    return x * {i} + {'y' * (i % 9)}\n" for i in range(60)]


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    path = tmp_path_factory.mktemp("docs") / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    tok = train_bpe(iter(DOCS), 300)
    out = {}
    for packing in ("best_fit", "concat"):
        cfg = DataConfig(packing=packing, workers=0, shuffle_rows=0, shuffle_files=False)
        out[packing] = next(build_stream(cfg, tok, one_source([path]), seq_len=48, batch_size=3, doc_mask=True))
    return out


@pytest.mark.parametrize("family", ["llama", "neox"])
@pytest.mark.parametrize("packing", ["best_fit", "concat"])
def test_packed_documents_match_running_alone(batches, family, packing):
    extra = dict(n_kv_heads=2) if family == "llama" else dict(rotary_pct=0.25)
    cfg = model_config(family=family, dim=64, n_layers=2, n_heads=4, ffn_dim=96, vocab_size=320, max_seq_len=64,
                       doc_mask=True, **extra)
    torch.manual_seed(0)
    model = build_model(cfg, "cpu").double()
    batch = batches[packing]
    inputs, doc_ids = batch["inputs"], batch["doc_ids"]
    with torch.no_grad():
        packed = model(inputs, positions=batch["positions"], doc_ids=doc_ids)
        plain = model(inputs)  # one causal sequence per row: later documents see earlier ones
        n_docs = differs = 0
        for row in range(inputs.shape[0]):
            for d in doc_ids[row].unique():
                where = doc_ids[row] == d
                alone = model(inputs[row, where][None])[0]
                torch.testing.assert_close(packed[row, where], alone, rtol=1e-9, atol=1e-9)
                n_docs += 1
                differs += not torch.allclose(plain[row, where], alone)
    assert n_docs > 6 and differs > 3  # several documents per row, and without the mask they would differ
