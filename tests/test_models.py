import copy
import math
import zlib

import pytest
import torch

from hlat.models import build_model, count_params, materialize
from hlat.models.config import model_config
from hlat.models.layers import apply_rope, rope_table
from hlat.models.llama import Llama
from hlat.models.neox import GPTNeoX

PUBLISHED = {  # parameter counts of the released checkpoints
    "llama2-7b": 6_738_415_616,
    "llama2-13b": 13_015_864_320,
    "llama2-70b": 68_976_648_192,
    "llama3-8b": 8_030_261_248,
    "pythia-6.9b": 6_857_302_016,
    "neox-20b": 20_554_567_680,
}


def small(family: str, **overrides):
    base = dict(dim=64, n_layers=2, n_heads=4, ffn_dim=96, vocab_size=128, max_seq_len=64)
    if family == "neox":
        base["rotary_pct"] = 0.25
    return model_config(family=family, **{**base, **overrides})


@pytest.mark.parametrize("preset", PUBLISHED)
def test_published_parameter_counts(preset):
    cfg = model_config(preset)
    model = build_model(cfg)
    assert count_params(model) == PUBLISHED[preset] == cfg.num_params()


@pytest.mark.parametrize(
    "preset, low, high",
    [("tiny", 2e6, 10e6), ("tiny-neox", 2e6, 10e6), ("small", 90e6, 130e6), ("small-neox", 90e6, 130e6)],
)
def test_cpu_preset_sizes(preset, low, high):
    cfg = model_config(preset)
    n = count_params(build_model(cfg))
    assert n == cfg.num_params() and low < n < high


def test_70b_builds_on_meta():
    model = build_model(model_config("llama2-70b"))
    tensors = [*model.parameters(), *model.buffers()]
    assert tensors and all(t.is_meta for t in tensors)


def test_module_layout():
    for family, cls in (("llama", Llama), ("neox", GPTNeoX)):
        model = build_model(small(family, tie_embeddings=True))
        assert type(model) is cls and list(model.layers) == ["0", "1"]
        block = model.layers["0"]
        assert {"wq", "wk", "wv", "wo"} <= dict(block.attention.named_children()).keys()
        assert block.attention_norm is not None and block.ffn_norm is not None and block.feed_forward is not None
        assert model.output.weight is model.tok_embeddings.weight and model.output.bias is None
        assert "rope" not in model.state_dict()
        assert isinstance(block.attention_norm, torch.nn.RMSNorm if family == "llama" else torch.nn.LayerNorm)


@pytest.mark.parametrize("tie", [False, True])
def test_materialize_keeps_ties_and_counts_once(tie):
    cfg = small("llama", tie_embeddings=tie)
    model = materialize(build_model(cfg), "cpu")
    assert (model.output.weight is model.tok_embeddings.weight) == tie
    assert count_params(model) == cfg.num_params()
    assert all(not t.is_meta for t in [*model.parameters(), *model.buffers()])
    assert torch.equal(model.rope, rope_table(cfg))


@pytest.mark.parametrize("weights", ["drawn", "per_shard"])  # per_shard: a rehearsal's, each rank its own shards
def test_init_std(weights):
    torch.manual_seed(0)
    cfg = model_config(
        family="neox", dim=256, n_layers=8, n_heads=4, ffn_dim=1024, vocab_size=4096, rotary_pct=0.25, init_std=0.03
    )
    model = materialize(build_model(cfg), "cpu", weights=weights)
    out_std = 0.03 / math.sqrt(2 * 8)
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif "norm" in name:
            assert torch.all(p == 1), name
        else:
            want = out_std if name.endswith(("wo.weight", "w2.weight")) else 0.03
            assert p.std().item() == pytest.approx(want, rel=0.05), name
            assert abs(p.mean().item()) < want / 10, name


def test_the_seed_sets_every_initial_weight():
    """Each parameter draws from a generator of its own, keyed by the run's seed and its name: another seed changes
    every random weight, the same seed gives the same ones (torch's CPU generator keeps 32 bits of a seed)."""
    cfg = small("llama")
    runs = [dict(materialize(build_model(cfg), "cpu", seed).named_parameters()) for seed in (0, 1, 1)]
    for name, p in runs[0].items():
        if "norm" not in name:
            assert not torch.equal(p, runs[1][name]), name
        assert torch.equal(runs[1][name], runs[2][name]), name


def test_a_large_weight_is_drawn_in_chunks_the_same_whatever_the_threads(monkeypatch):
    """A parameter over DRAW_CHUNK elements is drawn chunk by chunk, each from a generator of its own, by parallel
    threads: its value is the same on one thread as on several, no two chunks repeat one seed's stream, and a
    parameter of one chunk is drawn as before chunking (one generator for the whole)."""
    from hlat.models import layers

    monkeypatch.setattr(layers, "DRAW_CHUNK", 1000)
    large = torch.empty(7, 999, device="meta")  # 6993 elements: 7 chunks, the last one short
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)
        several = layers.initial_value(large, "layers.0.feed_forward.w1.weight", 0.02, 0)
        torch.set_num_threads(1)
        one = layers.initial_value(large, "layers.0.feed_forward.w1.weight", 0.02, 0)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(several, one)
    chunks = several.view(-1)[:6000].view(6, 1000)
    assert all(not torch.equal(chunks[0], chunks[k]) for k in range(1, 6))
    assert several.std().item() == pytest.approx(0.02, rel=0.05)
    whole = layers.initial_value(torch.empty(1000, device="meta"), "norm.weight", 0.02, 0)
    assert torch.equal(
        whole, torch.empty(1000).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(zlib.crc32(b"norm.weight")))
    )


def reference_partial_rope(x, positions, head_dim, rotary_dim, theta):
    """Slice out the rotated dimensions (first rotary_dim/2 of each half in hlat's layout), rotate them the
    usual rotate-half way in float64 and concatenate them back with the passed-through ones."""
    half, r = head_dim // 2, rotary_dim // 2
    rot_idx = torch.cat([torch.arange(r), half + torch.arange(r)])
    pass_idx = torch.cat([torch.arange(r, half), half + torch.arange(r, half)])
    inv_freq = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angles = positions.double()[:, None] * inv_freq  # [seq, r]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    xr = x[..., rot_idx]
    rotate_half = torch.cat([-xr[..., r:], xr[..., :r]], dim=-1)
    out = torch.empty_like(x)
    out[..., rot_idx] = xr * cos + rotate_half * sin
    out[..., pass_idx] = x[..., pass_idx]
    return out


@pytest.mark.parametrize("rotary_pct", [0.25, 0.5, 1.0])
def test_partial_rotary_matches_slice_and_concat(rotary_pct):
    cfg = model_config(family="neox", dim=256, n_heads=4, rotary_pct=rotary_pct, max_seq_len=512)
    x = torch.randn(2, 300, 4, cfg.head_dim, dtype=torch.float64)
    got = apply_rope(x, rope_table(cfg).double()[:300])
    want = reference_partial_rope(x, torch.arange(300), cfg.head_dim, cfg.rotary_dim, cfg.rope_theta)
    # float32 angles: error up to position * 2^-24 rad, times |x| of a few units
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    if rotary_pct < 1:  # the passed-through dimensions are untouched
        half, r = cfg.head_dim // 2, cfg.rotary_dim // 2
        assert torch.equal(got[..., r:half], x[..., r:half])


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_causal(family):
    torch.manual_seed(0)
    model = build_model(small(family, n_kv_heads=2 if family == "llama" else 0), "cpu")
    tokens = torch.randint(0, 128, (2, 16))
    changed = tokens.clone()
    changed[:, 10] = (changed[:, 10] + 1) % 128
    with torch.no_grad():
        a, b = model(tokens), model(changed)
    assert a.shape == (2, 16, 128)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_positions_select_rope_rows():
    torch.manual_seed(0)
    model = build_model(small("neox"), "cpu")
    tokens = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        default = model(tokens)
        assert torch.equal(model(tokens, torch.arange(8).expand(2, 8)), default)
        # per-row positions: row 1 restarts at a document boundary, so its tail sees positions 0..3
        positions = torch.tensor([list(range(8)), [0, 1, 2, 3, 0, 1, 2, 3]])
        mixed = model(tokens, positions)
        assert torch.equal(mixed[0], default[0])
        assert not torch.allclose(mixed[1, 4:], default[1, 4:])


def test_pipeline_stages_skip_missing_parts():
    torch.manual_seed(0)
    model = build_model(small("llama", n_layers=4, tie_embeddings=True), "cpu")
    first, last = copy.deepcopy(model), copy.deepcopy(model)
    first.norm = first.output = None
    for i in ("2", "3"):
        del first.layers[i]
    last.tok_embeddings = None
    last.layers["0"] = last.layers["1"] = None
    tokens = torch.randint(0, 128, (2, 8))
    with torch.no_grad():
        hidden = first(tokens)
        assert hidden.shape == (2, 8, 64)
        torch.testing.assert_close(last(hidden), model(tokens), rtol=0, atol=0)
