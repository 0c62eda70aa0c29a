"""hlat <-> Hugging Face transformers: small random models, no hub access."""

import contextlib
import dataclasses
import json
import logging
import os
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)

from hlat import HlatError
from hlat.models import build_model
from hlat.models.config import model_config
from hlat.models.hf import (
    hf_config_to_model_config,
    hf_state_to_hlat,
    hlat_state_to_hf,
    model_config_to_hf_config,
    read_hf_dir,
    write_hf_dir,
)

SIZES = dict(
    vocab_size=96,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    max_position_embeddings=64,
)
HF_MODELS = {
    "llama-gqa": lambda: LlamaForCausalLM(
        LlamaConfig(
            **SIZES,
            num_key_value_heads=2,
            rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 5e3},
            attn_implementation="eager",
        )
    ),
    "llama-tied": lambda: LlamaForCausalLM(LlamaConfig(**SIZES, tie_word_embeddings=True, attn_implementation="eager")),
    "neox-parallel": lambda: GPTNeoXForCausalLM(GPTNeoXConfig(**SIZES, rotary_pct=0.25, attn_implementation="eager")),
    "mixtral": lambda: MixtralForCausalLM(
        MixtralConfig(
            **SIZES, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, attn_implementation="eager"
        )
    ),
    "neox-sequential-tied": lambda: GPTNeoXForCausalLM(
        GPTNeoXConfig(
            **SIZES, rotary_pct=0.25, use_parallel_residual=False, tie_word_embeddings=True, attn_implementation="eager"
        )
    ),
}


def perturbed(model):
    """Random values everywhere, so norms, biases and every mapping matter."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def hf_model(name):
    torch.manual_seed(0)
    return perturbed(HF_MODELS[name]())


def assert_logits_close(ours, theirs):
    assert ours.shape == theirs.shape
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def compare(hlat_model, hf, offset=0):
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(12).expand(2, 12) + offset
    with torch.no_grad():
        assert_logits_close(hlat_model(tokens, positions), hf(tokens, position_ids=positions).logits)


def hlat_from_state(cfg, state):
    model = build_model(cfg, "cpu")
    model.load_state_dict(state)  # strict: every tensor present, none extra
    return model.eval()


@pytest.mark.parametrize("name", HF_MODELS)
def test_logits_match_transformers(name):
    hf = hf_model(name)
    cfg = hf_config_to_model_config(hf.config.to_dict())
    assert cfg.tie_embeddings == hf.config.tie_word_embeddings
    model = hlat_from_state(cfg, hf_state_to_hlat(cfg, hf.state_dict()))
    compare(model, hf, offset=5)


@pytest.mark.parametrize("name", ["llama-gqa", "neox-parallel"])
def test_read_save_pretrained_dir(name, tmp_path):
    hf = hf_model(name)
    hf.save_pretrained(tmp_path)
    cfg, state = read_hf_dir(tmp_path)
    if name == "llama-gqa":
        assert (cfg.family, cfg.kv_heads, cfg.rope_theta, cfg.norm_eps) == ("llama", 2, 5e3, 1e-5)
    else:
        assert (cfg.family, cfg.rotary_pct, cfg.parallel_residual) == ("neox", 0.25, True)
    compare(hlat_from_state(cfg, state), hf)


@pytest.mark.parametrize(
    "family, tie, shard_bytes", [("llama", False, 40_000), ("neox", True, 10**9), ("neox", False, 40_000)]
)
def test_write_dir_loads_in_transformers(family, tie, shard_bytes, tmp_path):
    extra = {"rotary_pct": 0.25, "parallel_residual": False} if family == "neox" else {"n_kv_heads": 2}
    cfg = model_config(
        family=family,
        dim=64,
        n_layers=2,
        n_heads=4,
        ffn_dim=128,
        vocab_size=96,
        max_seq_len=64,
        tie_embeddings=tie,
        rope_theta=2e4,
        norm_eps=1e-6,
        **extra,
    )
    torch.manual_seed(0)
    model = perturbed(build_model(cfg, "cpu"))
    write_hf_dir(cfg, model.state_dict(), tmp_path, max_shard_bytes=shard_bytes)
    assert (tmp_path / "model.safetensors.index.json").exists() == (shard_bytes < 10**9)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    assert type(hf) is (LlamaForCausalLM if family == "llama" else GPTNeoXForCausalLM)
    compare(model, hf, offset=3)
    # and back: config and every tensor survive the trip through the directory unchanged
    cfg2, state = read_hf_dir(tmp_path)
    assert cfg2 == cfg
    assert state.keys() == model.state_dict().keys()
    assert all(torch.equal(state[k], t) for k, t in model.state_dict().items())


def test_mixture_of_experts_export_loads_in_transformers_with_the_same_logits(tmp_path):
    """The tiny MoE preset (shrunk) exported: transformers loads it as Mixtral (its experts one tensor each on
    disk) with hlat's logits, and hlat reads the directory back bit for bit, as it reads transformers' own."""
    cfg = model_config(
        "tiny-moe",
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=48,
        vocab_size=96,
        max_seq_len=64,
        n_experts=4,
        capacity_factor=1.0,
        aux_loss_coef=0.02,
    )
    torch.manual_seed(0)
    model = perturbed(build_model(cfg, "cpu"))
    write_hf_dir(cfg, model.state_dict(), tmp_path / "ours", max_shard_bytes=100_000)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", attn_implementation="eager").eval()
    assert type(hf) is MixtralForCausalLM and hf.config.router_aux_loss_coef == 0.02
    compare(model, hf, offset=3)
    cfg2, state = read_hf_dir(tmp_path / "ours")
    assert cfg2 == dataclasses.replace(cfg, preset="", capacity_factor=0.0)  # capacity is hlat's training alone
    assert all(torch.equal(state[k], t) for k, t in model.state_dict().items())
    hf.save_pretrained(tmp_path / "theirs")
    assert read_hf_dir(tmp_path / "theirs")[0] == cfg2
    edit_config(tmp_path / "theirs", sliding_window=16)
    expect_error(tmp_path / "theirs", "config.json", "sliding_window=16")


@pytest.mark.parametrize("family", ["llama", "neox"])
@pytest.mark.parametrize("tie", [False, True])
def test_state_round_trip_is_bit_exact(family, tie):
    extra = {"rotary_pct": 0.5} if family == "neox" else {"n_kv_heads": 1}
    cfg = model_config(
        family=family, dim=64, n_layers=2, n_heads=4, ffn_dim=96, vocab_size=50, tie_embeddings=tie, **extra
    )
    torch.manual_seed(0)
    state = perturbed(build_model(cfg, "cpu")).to(torch.bfloat16).state_dict()
    hf_state = hlat_state_to_hf(cfg, state)
    assert all(t.dtype == torch.bfloat16 for t in hf_state.values())
    back = hf_state_to_hlat(cfg, hf_state)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[k], t) for k, t in state.items())
    assert hf_config_to_model_config(model_config_to_hf_config(cfg)) == cfg


# Configs as the released checkpoints spell them (transformers 4 era, top-level rotary fields).
PYTHIA_6_9B = {
    "architectures": ["GPTNeoXForCausalLM"],
    "model_type": "gpt_neox",
    "hidden_act": "gelu",
    "hidden_size": 4096,
    "intermediate_size": 16384,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "layer_norm_eps": 1e-05,
    "max_position_embeddings": 2048,
    "rotary_emb_base": 10000,
    "rotary_pct": 0.25,
    "tie_word_embeddings": False,
    "use_parallel_residual": True,
    "vocab_size": 50432,
    "initializer_range": 0.02,
    "torch_dtype": "float16",
}
LLAMA2_7B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-05,
    "rope_scaling": None,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
    "initializer_range": 0.02,
}


@pytest.mark.parametrize("hf_cfg, preset", [(PYTHIA_6_9B, "pythia-6.9b"), (LLAMA2_7B, "llama2-7b")])
def test_released_configs(hf_cfg, preset):
    cfg = hf_config_to_model_config(hf_cfg)
    assert cfg == dataclasses.replace(model_config(preset), preset="", init_std=0.02)
    # transformers' own reading of the old spelling (its to_dict writes the new one) agrees
    upgraded = AutoConfig.for_model(**hf_cfg).to_dict()
    assert "rope_parameters" in upgraded and hf_config_to_model_config(upgraded) == cfg


@pytest.fixture
def saved(tmp_path):
    hf_model("neox-parallel").save_pretrained(tmp_path)
    return tmp_path


def edit_config(path, **changes):
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, **changes}))


def expect_error(path, *fragments):
    with pytest.raises(HlatError) as err:
        read_hf_dir(path)
    message = str(err.value)
    assert "\n" not in message and all(f in message for f in fragments), message


def test_bad_dirs(saved, tmp_path_factory):
    expect_error(saved / "nope", "nope", "not a directory")
    empty = tmp_path_factory.mktemp("empty")
    expect_error(empty, "config.json", "not found")
    (empty / "config.json").write_text("{not json")
    expect_error(empty, "config.json", "invalid JSON")

    weights = load_file(saved / "model.safetensors")
    (saved / "model.safetensors").rename(saved / "pytorch_model.bin")
    expect_error(saved, "model.safetensors")
    save_file(
        {k: v for k, v in weights.items() if "layers.1.mlp.dense_4h_to_h.bias" not in k}, saved / "model.safetensors"
    )
    expect_error(saved, "missing tensor", "gpt_neox.layers.1.mlp.dense_4h_to_h.bias")
    stray = {"gpt_neox.layers.2.mlp.dense_4h_to_h.bias": torch.zeros(64)}
    save_file({**weights, **stray}, saved / "model.safetensors")
    expect_error(saved, "unexpected tensor", "layers.2")
    save_file(weights, saved / "model.safetensors")
    edit_config(saved, intermediate_size=256)
    expect_error(saved, "dense_h_to_4h.weight", "shape")
    edit_config(saved, intermediate_size=128, hidden_act="gelu_new")
    expect_error(saved, "config.json", "hidden_act")
    edit_config(saved, hidden_act="gelu", model_type="mistral")
    expect_error(saved, "config.json", "model_type", "mistral")
    edit_config(saved, model_type="gpt_neox", rope_parameters={"rope_type": "linear", "factor": 2.0})
    expect_error(saved, "config.json", "linear")
    edit_config(saved, rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.1})
    expect_error(saved, "config.json", "rotary_pct")


def test_sharded_index_names_missing_shard(tmp_path):
    cfg = model_config("tiny-neox", n_layers=1, vocab_size=64)
    write_hf_dir(cfg, build_model(cfg, "cpu").state_dict(), tmp_path, max_shard_bytes=100_000)
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 2
    assert read_hf_dir(tmp_path)[0] == dataclasses.replace(cfg, preset="")
    shards[1].unlink()
    expect_error(tmp_path, shards[1].name, "not found")
    with pytest.raises(HlatError, match="already holds a model"):
        write_hf_dir(cfg, build_model(cfg, "cpu").state_dict(), tmp_path)


class Messages(logging.Handler):
    """Collects what a logger logs."""

    def __init__(self):
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def transformers_messages():
    """Every message transformers logs (its logger does not propagate) or warns while the block runs."""
    logged, logger = Messages(), logging.getLogger("transformers")
    logger.addHandler(logged)
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            yield logged.messages
        logged.messages.extend(str(w.message) for w in warned)
    finally:
        logger.removeHandler(logged)


@pytest.mark.parametrize("family", ["llama", "neox"])
def test_exported_run_generates_in_transformers(family, tmp_path, capsys):
    """A trained run exported with `hlat export-hf` loads with AutoTokenizer and AutoModelForCausalLM as they
    are, gives hlat's logits, and generate() (greedy, stopping on the run's EOS) continues a prompt exactly as
    hlat's own greedy decoding does."""
    from transformers import AutoTokenizer

    from hlat.checkpoint.state import load_weights
    from hlat.cli import main
    from hlat.config.job import load_config
    from hlat.data.tokenizer import load_tokenizer
    from hlat.models import materialize
    from hlat.paths import latest_checkpoint

    corpus = str(Path(json.__file__).parent / "*.py")
    model = [
        "--model.preset",
        "tiny-neox" if family == "neox" else "tiny",
        "--model.dim",
        "64",
        "--model.n_layers",
        "2",
        "--model.n_heads",
        "4",
        "--model.ffn_dim",
        "128",
        "--model.vocab_size",
        "384",
        "--model.rope_theta",
        "20000",
    ]
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                *model,
                "--data.paths",
                corpus,
                "--data.workers",
                "0",
                "--train.steps",
                "2",
                "--train.global_batch",
                "2",
                "--train.micro_batch",
                "2",
                "--train.seq_len",
                "32",
                "--optim.warmup_steps",
                "1",
                "--train.run_dir",
                str(run),
            ]
        )
        == 0
    )
    out = tmp_path / "hf"
    umask = os.umask(0o027)
    try:
        assert main(["export-hf", str(run), "--out", str(out)]) == 0
    finally:
        os.umask(umask)
    assert "bos = eos = '<|endoftext|>'" in capsys.readouterr().out
    assert {f.name: f.stat().st_mode & 0o777 for f in out.iterdir()} == dict.fromkeys(
        [
            "config.json",
            "generation_config.json",
            "model.safetensors",
            "tokenizer.json",
            "tokenizer_config.json",
            "special_tokens_map.json",
        ],
        0o640,
    )  # as the umask says, weights too

    ckpt = latest_checkpoint(run)
    cfg = load_config(ckpt / "config.toml")
    ours = materialize(build_model(cfg.model), "cpu").eval()
    load_weights(ckpt, [ours])
    eos = load_tokenizer(run).eos_id
    with transformers_messages() as messages:
        tok = AutoTokenizer.from_pretrained(out)
        hf = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
        hf.generate(**tok("def", return_tensors="pt"), max_new_tokens=2)
    assert not [m for m in messages if "max_length" in m], messages
    assert (tok.eos_token_id, tok.bos_token_id, hf.config.eos_token_id, hf.generation_config.eos_token_id) == (eos,) * 4
    prompt = tok("def encode(obj):\n    return", return_tensors="pt")
    assert prompt.input_ids.tolist() == [load_tokenizer(run).encode_batch(["def encode(obj):\n    return"])[0]]

    ids = prompt.input_ids
    with torch.no_grad():
        assert_logits_close(ours(ids), hf(ids).logits)
        expected = ids
        for _ in range(8):  # hlat's greedy decoding, no cache
            token = ours(expected)[:, -1].argmax(-1, keepdim=True)
            expected = torch.cat([expected, token], dim=1)
            if token.item() == eos:
                break
        generated = hf.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert generated.tolist() == expected.tolist()
    assert isinstance(tok.decode(generated[0]), str)
