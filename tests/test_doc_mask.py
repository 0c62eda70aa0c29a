"""model.doc_mask: a packed row gives every document the logits it gets when run alone; FlexAttention's block mask
(CUDA's kernel) allows what the dense mask (the CPU's) allows."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention

from hlat.data.config import DataConfig
from hlat.data.packing import build_stream
from hlat.data.sources import one_source
from hlat.data.tokenizer import train_bpe
from hlat.models import build_model
from hlat.models.config import model_config
from hlat.models.layers import block_sparse_mask, dense_mask, document_mask, row_positions

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
    cfg = model_config(
        family=family, dim=64, n_layers=2, n_heads=4, ffn_dim=96, vocab_size=320, max_seq_len=64, doc_mask=True, **extra
    )
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


def packed_doc_ids(lengths: list[list[int]]) -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in lengths])


def dense_document_mask(doc_ids: torch.Tensor) -> torch.Tensor:
    index = row_positions(doc_ids)
    return dense_mask(index, index, doc_ids, doc_ids)


def document_block_mask(doc_ids: torch.Tensor):
    index = row_positions(doc_ids)
    return block_sparse_mask(index, index, doc_ids, doc_ids)


# Rows of 384 tokens: three of FlexAttention's 128-token blocks, documents starting inside and across them.
LENGTHS = [[100, 200, 84], [128, 256], [30, 30, 300, 24]]


def test_block_mask_keeps_exactly_the_blocks_the_dense_mask_needs():
    """The block mask CUDA's FlexAttention runs from (built on the CPU here) lists a block of 128 x 128 scores
    exactly where the dense mask allows any of them, and its mask function is the dense mask elementwise."""
    doc_ids = packed_doc_ids(LENGTHS)
    dense = dense_document_mask(doc_ids)[:, 0]
    block_mask = document_block_mask(doc_ids)
    blocks = dense.unflatten(1, (3, 128)).unflatten(3, (3, 128)).any(4).any(2)
    assert torch.equal(block_mask.to_dense()[:, 0].bool(), blocks)
    index = torch.arange(384)
    elementwise = block_mask.mask_mod(torch.arange(3)[:, None, None], 0, index[None, :, None], index[None, None, :])
    assert torch.equal(elementwise, dense)
    assert blocks.sum() == 3 * 6 - 2  # the second row's later blocks of queries skip its first document's keys


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_forward_equals_sdpa_with_the_dense_mask():
    """FlexAttention's forward on the CPU (eager: it has no backward pass here, which is why the CPU keeps the
    dense mask) with the block mask gives SDPA's output with the dense mask, grouped-query heads included. float64:
    the two differ by the order of sums over at most 384 keys, 2^-53 each, far below 1e-12."""
    doc_ids = packed_doc_ids(LENGTHS)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 384, 16, generator=generator, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 384, 16, generator=generator, dtype=torch.float64) for _ in range(2))
    flex = flex_attention(q, k, v, block_mask=document_block_mask(doc_ids), enable_gqa=True)
    dense = F.scaled_dot_product_attention(q, k, v, attn_mask=dense_document_mask(doc_ids), enable_gqa=True)
    torch.testing.assert_close(flex, dense, rtol=1e-12, atol=1e-12)
    assert isinstance(document_mask(doc_ids), torch.Tensor)  # the CPU's choice: the dense mask


def test_a_context_parallel_ranks_mask_is_its_rows_of_the_whole_mask():
    """Under context parallelism a rank's queries are its two chunks of each row and the keys every rank's chunks
    in rank order; the mask made from their true positions within documents and their document ids is the whole
    rows' mask, its rows and columns taken in that order."""
    from hlat.parallel.context import split_batch

    cp = 3  # 384-token rows in 6 chunks of 64, documents crossing chunk boundaries
    doc_ids = packed_doc_ids(LENGTHS)
    positions = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in LENGTHS])
    index = row_positions(doc_ids)
    whole = dense_document_mask(doc_ids)
    parts = [split_batch({"inputs": index, "positions": positions, "doc_ids": doc_ids}, cp, rank) for rank in range(cp)]
    key_order = torch.cat([part["inputs"] for part in parts], dim=1)  # each key's place in its row
    key_positions = torch.cat([part["positions"] for part in parts], dim=1)
    key_docs = torch.cat([part["doc_ids"] for part in parts], dim=1)
    for part in parts:
        mask = dense_mask(part["positions"], key_positions, part["doc_ids"], key_docs)
        rows = torch.gather(whole[:, 0], 1, part["inputs"][:, :, None].expand(-1, -1, 384))
        assert torch.equal(mask[:, 0], torch.gather(rows, 2, key_order[:, None, :].expand(-1, rows.shape[1], -1)))
    assert sorted(key_order[0].tolist()) == list(range(384))
