"""Config loading and validation: every mistake is one line naming the field, before any work starts."""

import pytest

from hlat.cli import main
from hlat.config import ConfigError
from hlat.optim import lr_at
from hlat.train.config import build_config, load_config


def test_preset_then_overrides():
    cfg = build_config({"model": {"preset": "llama2-7b", "n_layers": 2}}, ["--optim.lr", "1e-3", "--train.steps=7"])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.optim.lr, cfg.train.steps) == (4096, 2, 1e-3, 7)
    # a preset given on the command line still applies first
    cfg = build_config({"model": {"n_layers": 3}}, ["--model.preset", "tiny"])
    assert cfg.model.preset == "tiny" and cfg.model.n_layers == 3


@pytest.mark.parametrize("data, overrides, message", [
    ({"optim": {"lrr": 1.0}}, [], "unknown config key 'optim.lrr'"),
    ({}, ["--optim.lr", "fast"], "optim.lr: expected float, got 'fast'"),
    ({}, ["--optim.lr", "-1"], "optim.lr: must be positive"),
    ({"model": {"n_heads": 6, "n_kv_heads": 4, "dim": 48}}, [], "model.n_heads: 6 is not divisible by n_kv_heads=4"),
    ({"model": {"preset": "gpt5"}}, [], "model.preset: unknown preset 'gpt5'"),
    ({"train": {"seq_len": 4096}, "model": {"preset": "tiny"}}, [], "train.seq_len: 4096 exceeds"),
    ({"train": {"steps": "ten"}}, [], "train.steps: expected int"),
    ({"precision": {"mode": "fp8"}}, [], "precision.mode: 'fp8' is not one of"),
    ({"bogus": {}}, [], "unknown config key 'bogus'"),
    ({}, ["--nosection", "1"], "unexpected argument '--nosection'"),
])
def test_bad_config_names_the_field(data, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_config(data, overrides)


def test_cli_config_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nlearning_rate = 1e-3\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hlat: error: unknown config key 'optim.learning_rate'") and "\n" not in err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_shipped_configs_load():
    for name in ("tiny", "hlat-7b", "hlat-70b", "pythia-6.9b", "neox-20b"):
        load_config(f"configs/{name}.toml")


def test_hlat_7b_recipe():
    cfg = load_config("configs/hlat-7b.toml")
    assert cfg.model.num_params() == 6_738_415_616
    assert (cfg.train.seq_len, cfg.train.global_batch, cfg.optim.lr, cfg.optim.min_lr) == (
        4096, 1024, 3e-4, 3e-5)
    assert (cfg.optim.warmup_steps, cfg.optim.decay_steps, cfg.optim.weight_decay) == (2000, 500_000, 0.1)


def test_lr_schedule():
    lrs = [lr_at(s, 1.0, 0.1, warmup_steps=10, decay_steps=110) for s in range(120)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[60] == pytest.approx(0.55)  # halfway through the cosine
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:]))  # never rises after warmup
    assert lrs[110] == lrs[119] == 0.1


def test_describe_70b_without_allocating(capsys):
    assert main(["describe", "--model", "llama2-70b"]) == 0
    out = capsys.readouterr().out
    assert "68,976,648,192" in out and "bf16_sr" in out
