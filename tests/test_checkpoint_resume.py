"""Before weights load: a checkpoint of another shape fails in one line naming the tensor, and a resume says
what it changes, refusing a changed learning-rate schedule unless asked."""

import pytest

from hlat import HlatError
from hlat.checkpoint.durable import write_checkpoint
from hlat.checkpoint.resume import check_model_shapes, check_resume, config_changes, schedule_changes
from hlat.checkpoint.state import model_state
from hlat.config.job import build_config
from hlat.models import build_model, materialize

TINY = {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_dim": 128, "vocab_size": 128}


def config(model=None, **sections):
    data = {"model": {**TINY, **(model or {})}, "optim": {"warmup_steps": 2}, "train": {"steps": 8}}
    for section, values in sections.items():
        data[section] = {**data.get(section, {}), **values}
    return build_config(data)


@pytest.fixture
def checkpoint(tmp_path):
    cfg = config()
    model = materialize(build_model(cfg.model), "cpu")
    return write_checkpoint(tmp_path / "step_00000004", {"model": model_state([model])}, cfg.to_toml())


def test_other_shape_is_one_line_naming_the_tensor(checkpoint):
    check_model_shapes(checkpoint, build_model(config().model))  # the same model passes
    with pytest.raises(HlatError) as err:
        check_model_shapes(checkpoint, build_model(config({"ffn_dim": 96}).model))
    message = str(err.value)
    assert (
        "\n" not in message
        and "tensor 'layers.0.feed_forward.w1.weight' has shape [128, 64] in the checkpoint but [96, 64] in this model"
        in message
        and "model.ffn_dim = 128" in message
    )
    with pytest.raises(HlatError, match="has no tensor 'layers.2.attention.wq.weight'"):
        check_model_shapes(checkpoint, build_model(config({"n_layers": 3}).model))


def test_changes_are_listed_and_where_they_run_is_not():
    saved = config()
    assert config_changes(saved, config(train={"run_dir": "elsewhere", "log_every": 3}, parallel={"tp": 2})) == []
    assert config_changes(saved, config(train={"global_batch": 16, "micro_batch": 8}, model={"dim": 128})) == [
        "model.dim: 64 -> 128",
        "train.global_batch: 8 -> 16",
    ]


def test_longer_run_reshapes_the_schedule_unless_its_length_is_fixed():
    saved = config()  # decay_steps 0: the cosine ends at train.steps
    assert schedule_changes(saved, config(train={"steps": 12}), step=4)
    assert not schedule_changes(
        config(optim={"decay_steps": 8}), config(train={"steps": 12}, optim={"decay_steps": 8}), step=4
    )
    assert schedule_changes(saved, config(optim={"lr": 1e-3}), step=4)
    assert schedule_changes(saved, config(optim={"warmup_steps": 3}), step=4)  # the cosine starts later
    assert not schedule_changes(saved, config(optim={"beta2": 0.99}), step=4)  # a change, but not of the lr


def test_resume_refuses_a_schedule_change_without_the_flag(checkpoint):
    assert check_resume(checkpoint, config(train={"log_every": 1})) == []
    with pytest.raises(HlatError) as err:
        check_resume(checkpoint, config(train={"steps": 12}))
    assert "\n" not in str(err.value) and "train.steps: 8 -> 12" in str(err.value)
    assert "--train.allow_schedule_change true" in str(err.value)
    assert check_resume(checkpoint, config(train={"steps": 12, "allow_schedule_change": True})) == [
        "train.steps: 8 -> 12"
    ]


def test_a_refused_schedule_change_names_only_what_moves_the_schedule(checkpoint):
    """Changes of precision, batch and schedule together: the refusal names the schedule's fields alone; the
    changes are all said when allowed."""
    changed = {"precision": {"mode": "bf16_mixed", "fp8": "tensorwise"}, "optim": {"lr": 1e-3, "beta2": 0.99}}
    with pytest.raises(HlatError) as err:
        check_resume(checkpoint, config(train={"steps": 12, "global_batch": 16}, **changed))
    assert "from step 4 on (optim.lr: 0.0003 -> 0.001; train.steps: 8 -> 12); pass" in str(err.value)
    allowed = check_resume(checkpoint, config(train={"steps": 12, "allow_schedule_change": True}, **changed))
    assert [line.partition(":")[0] for line in allowed] == [
        "optim.lr",
        "optim.beta2",
        "precision.mode",
        "precision.fp8",
        "train.steps",
    ]


def test_trainer_refuses_before_starting(tmp_path, capsys):
    """Through `hlat train`: a resume with more steps (cosine horizon = train.steps) is refused, then allowed
    with the flag, saying what changed; init_from of another shape stops in one line."""
    import json
    from pathlib import Path

    from hlat.cli import main

    run = tmp_path / "run"
    args = [
        "train",
        "--model.preset",
        "tiny",
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
        "--data.paths",
        str(Path(json.__file__).parent / "*.py"),
        "--data.workers",
        "0",
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
    assert main([*args, "--train.steps", "2"]) == 0
    capsys.readouterr()
    assert main([*args, "--train.steps", "4", "--resume", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "changes the learning-rate schedule from step 2 on (train.steps: 2 -> 4)" in err
    assert main([*args, "--train.steps", "3", "--resume", "auto", "--train.allow_schedule_change", "true"]) == 0
    assert "train.steps: 2 -> 3" in capsys.readouterr().out
    other = [a if a != "64" else "32" for a in args]  # model.dim 32
    assert (
        main([*other, "--train.steps", "1", "--train.run_dir", str(tmp_path / "b"), "--train.init_from", str(run)]) == 2
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tensor 'tok_embeddings.weight' has shape [384, 64] in the checkpoint" in err
