"""Config loading and validation: every mistake is one line naming the field, before any work starts."""

import dataclasses
import json
import math
import re

import pytest

from hlat.cli import main
from hlat.config.job import Config, build_config, load_config
from hlat.fields import ConfigError
from hlat.optim import lr_at
from hlat.profiles import load_profile


def test_preset_then_overrides():
    cfg = build_config({"model": {"preset": "llama2-7b", "n_layers": 2}}, ["--optim.lr", "1e-3", "--train.steps=7"])
    assert (cfg.model.dim, cfg.model.n_layers, cfg.optim.lr, cfg.train.steps) == (4096, 2, 1e-3, 7)
    # a preset given on the command line still applies first
    cfg = build_config({"model": {"n_layers": 3}}, ["--model.preset", "tiny"])
    assert cfg.model.preset == "tiny" and cfg.model.n_layers == 3


@pytest.mark.parametrize(
    "data, overrides, message",
    [
        ({"optim": {"lrr": 1.0}}, [], "unknown config key 'optim.lrr'; did you mean 'optim.lr'? (known in this"),
        ({"trian": {"steps": 1}}, [], "unknown config key 'trian'; did you mean 'train'?"),
        ({}, ["--optim.warmup", "5"], "unknown config key 'optim.warmup'; did you mean 'optim.warmup_steps'?"),
        ({}, ["--optm.lr", "1"], "unknown config section 'optm'; did you mean 'optim'? (sections: cluster, cost,"),
        ({}, ["--model.zzz", "1"], "unknown config key 'model.zzz' (known in this section: aux_loss_coef, capacity_f"),
        ({}, ["--optim.lr", "fast"], "optim.lr: expected float, got 'fast'"),
        ({}, ["--optim.lr", "-1"], "optim.lr: must be positive"),
        (
            {"model": {"n_heads": 6, "n_kv_heads": 4, "dim": 48}},
            [],
            "model.n_heads: 6 is not divisible by n_kv_heads=4",
        ),
        ({"model": {"preset": "gpt5"}}, [], "model.preset: unknown preset 'gpt5'"),
        ({"train": {"seq_len": 4096}, "model": {"preset": "tiny"}}, [], "train.seq_len: 4096 exceeds"),
        ({"train": {"steps": "ten"}}, [], "train.steps: expected int"),
        ({"precision": {"mode": "fp8"}}, [], "precision.mode: 'fp8' is not one of"),
        ({"bogus": {}}, [], "unknown config key 'bogus'"),
        ({}, ["--nosection", "1"], "unexpected argument '--nosection'"),
        (
            {},
            ["--data.paths", "[a.jsonl]"],
            "data.paths: '[a.jsonl]' is not a TOML array (a value starting with [ is read as one): quote each string",
        ),
        ({}, ["--data.paths", "[1]"], "data.paths[0]: expected a string, got 1"),
        # a lease that flaps, and one the collective timeout would always beat (docs/fault-tolerance.md, "Leases")
        ({}, ["--train.lease_s", "1"], "train.lease_s: 1 s would declare live ranks lost whenever a beat is late"),
        ({}, ["--train.lease_s", "-1"], "train.lease_s: must be >= 0"),
        (
            {},
            ["--train.collective_timeout_s", "10"],
            "train.lease_s: 10 s is not shorter than train.collective_timeout_s 10 s",
        ),
    ],
)
def test_bad_config_names_the_field(data, overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config(data, overrides)


@pytest.mark.parametrize(
    "text, paths",
    [
        ("[]", []),
        ('["a b.jsonl", "c.jsonl"]', ["a b.jsonl", "c.jsonl"]),
        (' [ "x,y.jsonl" ] ', ["x,y.jsonl"]),
        ("a.jsonl,b.jsonl", ["a.jsonl", "b.jsonl"]),
        ("a.jsonl", ["a.jsonl"]),
    ],
)
def test_a_list_override_is_comma_separated_or_a_toml_array(text, paths, capsys):
    assert build_config({}, ["--data.paths", text]).data.paths == paths
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "TOML array" in capsys.readouterr().out.replace("\n", " ")


def test_cli_config_error_is_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nlearning_rate = 1e-3\n")
    assert main(["train", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hlat: error: unknown config key 'optim.learning_rate'") and "\n" not in err
    assert main(["train", "--config", str(tmp_path / "missing.toml")]) == 2
    assert "config file not found" in capsys.readouterr().err


# What each recipe states: the published model, precision, layout, batch, schedule and cluster (sources in each file).
RECIPES = {
    "hlat-7b": dict(
        params=6_738_415_616,
        precision="bf16_sr",
        layout=(8, 1, 256, 1, False),
        batch=(4096, 1024, 1),
        schedule=(3e-4, 3e-5, 2000, 500_000, 450_000, 0.1),
        cluster=("trn1.32xlarge", 64, 32, "neuron"),
    ),
    "hlat-70b": dict(
        params=68_976_648_192,
        precision="bf16_mixed",
        layout=(32, 8, 1, 32, True),
        batch=(4096, 1024, 1),
        schedule=(1.5e-4, 1.5e-5, 2000, 500_000, 450_000, 0.1),
        cluster=("trn1.32xlarge", 256, 32, "neuron"),
    ),
    "neox-20b": dict(
        params=20_554_567_680,
        precision="bf16_sr",
        layout=(8, 4, 1, 64, True),
        batch=(2048, 1536, 1),
        schedule=(9.7e-5, 9.7e-6, 1500, 150_000, 150_000, 0.01),
        cluster=("trn1.32xlarge", 64, 32, "neuron"),
    ),
    "pythia-6.9b": dict(
        params=6_857_302_016,
        precision="bf16_sr",
        layout=(8, 1, 1, 16, True),
        batch=(2048, 256, 1),
        schedule=(1.2e-4, 1.2e-5, 1430, 143_000, 143_000, 0.01),
        cluster=("trn1.32xlarge", 4, 32, "neuron"),
    ),
}


@pytest.mark.parametrize("name", RECIPES)
def test_recipe_states_the_published_run(name):
    want, cfg = RECIPES[name], load_config(name)
    assert cfg.model.num_params() == want["params"] and cfg.precision.mode == want["precision"]
    c = cfg.cluster
    assert (c.hardware, c.nodes, c.nproc_per_node, load_profile(c.hardware).accelerator) == want["cluster"]
    p = cfg.resolved_parallel(c.world_size)  # the layout runs as is on the stated cluster
    assert (p.tp, p.pp, p.dp_replicate, p.dp_shard, p.zero1) == want["layout"]
    assert p.sequence_parallel and p.activation_checkpoint == "selective"
    t, o = cfg.train, cfg.optim
    assert (t.seq_len, t.global_batch, t.micro_batch) == want["batch"]
    assert (o.lr, o.min_lr, o.warmup_steps, o.decay_steps, t.steps, o.weight_decay) == want["schedule"]
    assert (o.beta1, o.beta2, o.clip_grad_norm) == (0.9, 0.95, 1.0)
    assert cfg.data.paths and cfg.data.tokenizer  # the user's corpus and tokenizer, not the stdlib default


@pytest.mark.parametrize("name", RECIPES)
def test_plan_prices_each_recipe_as_it_stands(name, capsys):
    assert main(["plan", "--config", f"{name}.toml", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    (plan,) = out["plans"]
    tp, pp, dp_replicate, dp_shard, zero1 = RECIPES[name]["layout"]
    assert (out["hardware"], out["nodes"]) == RECIPES[name]["cluster"][:2] and out["precision"] == RECIPES[name][
        "precision"
    ]
    assert plan["parallel"]["tp"] == tp and plan["parallel"]["pp"] == pp and plan["parallel"]["zero1"] == zero1
    assert plan["fits"] and plan["tokens_per_dollar"] > 0 and plan["budget"]["days"] > 0


@pytest.mark.parametrize("name", [*RECIPES, "hlat-7b-long", "hlat-70b-long", "mixtral-8x7b"])
def test_recipe_turns_on_what_a_long_run_needs(name, capsys):
    """Asynchronous checkpoints, and the hang watchdog at a timeout suited to the step: 30x the planner's predicted
    step time for the recipe's layout rounded up to whole minutes (docs/fault-tolerance.md; a planner change that
    moves it asks for the recipe to be derived again), below the collective timeout so that a hung rank is named
    before a collective gives up."""
    cfg = load_config(name)
    assert main(["plan", "--config", name, "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["plans"][0]["step_time_s"]["total"]
    assert cfg.train.async_checkpoint
    assert cfg.train.hang_timeout_s == 60 * math.ceil(30 * step / 60) < cfg.train.collective_timeout_s


def test_recipe_without_its_data_stops_at_once(capsys):
    single = [
        "--parallel.tp",
        "1",
        "--parallel.pp",
        "1",
        "--parallel.dp_replicate",
        "1",
        "--parallel.dp_shard",
        "1",
        "--parallel.zero1",
        "false",
    ]
    assert main(["train", "--config", "hlat-7b", *single]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hlat: error: data.paths: no files match '/data/hlat/train/*.jsonl.zst'") and "\n" not in err


def test_tiny_config_loads():
    cfg = load_config("configs/tiny.toml")
    assert cfg.model.preset == "tiny" and cfg.data.paths == []


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


@pytest.mark.parametrize(
    "args, seq_len, source",
    [
        (["--model", "llama2-7b"], 4096, "the model's max_seq_len"),  # a bare preset: its own context
        (["--config", "tiny"], 128, "train.seq_len"),  # what `hlat train --config tiny` runs
        (["--config", "tiny", "--train.seq_len", "64"], 64, "train.seq_len"),
        (["--model", "llama2-7b", "--seq-len", "512"], 512, "--seq-len"),
    ],
)
def test_describe_and_plan_figure_at_the_same_sequence_length(args, seq_len, source, capsys):
    hardware = "cpu" if "tiny" in args else "p4d.24xlarge"
    assert main(["plan", *args, "--hardware", hardware, "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert (planned["seq_len"], planned["seq_len_from"]) == (seq_len, source)
    assert main(["describe", *args]) == 0
    (row,) = [line for line in capsys.readouterr().out.splitlines() if "FLOPs/token" in line]
    model = (load_config("tiny") if "--config" in args else build_config({"model": {"preset": "llama2-7b"}})).model
    assert f"(seq {seq_len}: {source})" in row and f"{model.flops_per_token(seq_len):.4g}" in row


def test_configs_merge_in_order(tmp_path, capsys):
    """A recipe, then the tables `hlat plan --emit` writes, then overrides: later files set only what they name."""
    emitted = tmp_path / "plan.toml"
    assert (
        main(
            [
                "plan",
                "--model",
                "llama2-7b",
                "--hardware",
                "p5.48xlarge",
                "--nodes",
                "2",
                "--precision",
                "bf16_mixed",
                "--emit",
                str(emitted),
            ]
        )
        == 0
    )
    capsys.readouterr()
    cfg = load_config(["hlat-7b", str(emitted)], ["--train.steps", "5"])
    base = load_config("hlat-7b")
    assert cfg.precision.mode == "bf16_mixed" != base.precision.mode  # [precision] comes with the plan
    assert cfg.parallel.dp_replicate != -1  # [parallel] from the plan
    assert cfg.parallel.tp * cfg.parallel.pp * cfg.parallel.dp_replicate * abs(cfg.parallel.dp_shard) <= 16
    assert (cfg.optim, cfg.data, cfg.train.seq_len) == (base.optim, base.data, base.train.seq_len)  # the recipe's
    assert (cfg.train.steps, cfg.model) == (5, base.model)
    # the other order: the fields the recipe names win
    p = load_config([str(emitted), "hlat-7b"]).parallel
    assert (p.tp, p.pp, p.dp_replicate, p.dp_shard, p.zero1, p.activation_checkpoint) == (
        8,
        1,
        -1,
        1,
        False,
        "selective",
    )


def test_print_config_shows_every_field_and_reloads(tmp_path, capsys):
    first, second = tmp_path / "a.toml", tmp_path / "b.toml"
    first.write_text('[model]\npreset = "tiny"\nn_layers = 3\n[optim]\nlr = 1e-3\n')
    second.write_text("[optim]\nwarmup_steps = 7\n[train]\nsteps = 9\n")
    assert (
        main(["train", "--config", str(first), "--config", str(second), "--optim.min_lr", "1e-5", "--print-config"])
        == 0
    )
    printed = capsys.readouterr().out
    out = tmp_path / "resolved.toml"
    out.write_text(printed)
    cfg = load_config(str(out))
    assert (cfg.model.n_layers, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.min_lr, cfg.train.steps) == (
        3,
        1e-3,
        7,
        1e-5,
        9,
    )
    assert cfg == load_config([str(first), str(second)], ["--optim.min_lr", "1e-5"])
    assert not (tmp_path / "runs").exists() and "clip_grad_norm = 1.0" in printed  # every field, nothing run


def test_config_fields_lists_types_defaults_and_comments(capsys):
    assert main(["config", "fields"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    cfg = Config()
    assert len(rows) == sum(len(dataclasses.fields(getattr(cfg, f.name))) for f in dataclasses.fields(cfg))
    assert rows["train.steps"].split()[1:3] == ["int", "300"] and "optimizer steps" in rows["train.steps"]
    # a choice's type lists the choices, its default is written as TOML writes it
    assert "'fp32' | 'bf16_mixed' | 'bf16_sr' | 'bf16_kahan'  \"fp32\"" in rows["precision.mode"]
    assert "'concat' | 'best_fit'" in rows["data.packing"]
    assert main(["config", "fields", "cluster"]) == 0
    assert all(line.startswith("cluster.") for line in capsys.readouterr().out.splitlines())


@pytest.mark.parametrize(
    "fields, world, message",
    [
        ({"replica_groups": 1}, 2, "needs at least 2 groups"),
        ({"replica_groups": 2, "replica_group": 2}, 2, "0 <= replica_group < replica_groups"),
        ({"replica_groups": 2, "data_sharding": "files"}, 2, "needs data_sharding = 'global'"),
        ({"replica_groups": 2, "pp": 2}, 2, "and pp = 1"),
        # 4 micro-batches a step: 2 groups of 2 ranks share them, 3 would not
        (
            {"replica_groups": 3},
            2,
            "must divide among any number of live groups of 2 data-parallel ranks: make them a multiple of 12",
        ),
    ],
)
def test_replica_groups_refuse_what_they_cannot_serve_in_one_line(fields, world, message):
    cfg = build_config({"model": {"preset": "tiny"}, "train": {"global_batch": 8, "micro_batch": 2}})
    cfg.parallel = dataclasses.replace(cfg.parallel, **fields)
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg.resolved_parallel(world)


def test_each_replica_group_keeps_its_own_run_directory():
    train = {"run_dir": "runs/a", "global_batch": 8, "micro_batch": 2}
    cfg = build_config({"train": train, "parallel": {"replica_groups": 2, "replica_group": 1}})
    assert cfg.for_replica_group().train.run_dir == "runs/a/replica1"
    assert cfg.for_replica_group().resolved_parallel(2).dp == 2
    plain = build_config({"train": {"run_dir": "runs/a"}})
    assert plain.for_replica_group() is plain
