"""Seeing and using a run: metrics (grad-norm statistics, cost), TensorBoard files, validation loss, `hlat eval`,
`hlat compare`, and `hlat generate` against transformers' greedy generation."""

import json
import math
import os
import re
import time
from collections import Counter
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from hlat.checkpoint.durable import verify_checkpoint
from hlat.cli import main
from hlat.config.job import build_config
from hlat.data.readers import iter_documents
from hlat.data.records import held_out
from hlat.data.tokenizer import load_tokenizer
from hlat.fields import ConfigError
from hlat.models import build_model, materialize
from hlat.models.config import model_config
from hlat.models.generate import generate, next_token
from hlat.models.hf import write_hf_dir
from hlat.models.kv_cache import KVCache
from hlat.paths import complete_checkpoints
from hlat.tools.inference import load_trained
from hlat.train.loop import train

CORPUS_DIR = os.path.dirname(json.__file__)
CORPUS = os.path.join(CORPUS_DIR, "*.py")
TINY = {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 512}
PRICE = 3600.0  # USD per device-hour: one dollar per second, so cost_usd reads as seconds


def records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two real short runs of different lengths and log intervals; the first validates and checkpoints every 3 steps
    on a hash split of its data and is priced through a hardware profile (two devices per node)."""
    root = tmp_path_factory.mktemp("runs")
    profile = root / "box.toml"
    profile.write_text(f"devices_per_node = 2\nprice_on_demand = {2 * PRICE}\n")
    common = {
        "model": dict(TINY),
        "data": {"paths": [CORPUS]},
        "optim": {"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2, "decay_steps": 8},
    }
    a = build_config(
        {
            **common,
            "train": {
                "steps": 6,
                "global_batch": 4,
                "micro_batch": 2,
                "seq_len": 32,
                "log_every": 1,
                "ckpt_every": 3,
                "run_dir": str(root / "a"),
            },
            "eval": {"holdout": 0.3, "every": 3, "batches": 2},
            "cost": {"hardware": str(profile)},
        }
    )
    b = build_config(
        {
            **common,
            "train": {
                "steps": 8,
                "global_batch": 4,
                "micro_batch": 2,
                "seq_len": 32,
                "log_every": 2,
                "run_dir": str(root / "b"),
            },
            "precision": {"mode": "bf16_sr"},
        }
    )
    train(a)
    train(b)
    return root / "a", root / "b"


def test_metrics_grad_norm_statistics_and_cost(runs):
    a, b = (records(r) for r in runs)
    for r in a:  # one step per interval: the statistics are that step's norm
        assert r["grad_norm_mean"] == r["grad_norm_max"] == r["grad_norm"]
    step4 = next(r for r in b if r["step"] == 4)  # steps 3 and 4
    # two different norms: the maximum is one of them (the last or the other), the mean lies between
    other = 2 * step4["grad_norm_mean"] - step4["grad_norm"]
    assert step4["grad_norm_max"] == pytest.approx(max(other, step4["grad_norm"]), rel=1e-5)
    assert min(other, step4["grad_norm"]) < step4["grad_norm_mean"] < step4["grad_norm_max"]
    times = [r["time"] for r in a]
    assert times == sorted(times) and abs(times[-1] - time.time()) < 600
    rounding = PRICE / 3600 * 5e-4 + 1e-6  # times are logged to the millisecond, dollars to 1e-6
    for r in a:  # $3600 per device-hour from the profile (7200 per node of 2): one dollar per second
        assert r["cost_usd"] == pytest.approx(PRICE / 3600 * r["elapsed_s"], abs=rounding)
        # logged to 0.1 tokens per dollar: a slow first step under load makes that rounding show beyond 1e-3
        assert r["tokens_per_usd"] == pytest.approx(r["tokens_seen"] / r["cost_usd"], rel=1e-3, abs=0.05)
        assert r["projected_cost_usd"] == pytest.approx(PRICE / 3600 * r["projected_time_s"], abs=rounding)
        assert r["projected_time_s"] == pytest.approx(r["elapsed_s"] + r["step_time_s"] * (6 - r["step"]), abs=2e-3)
    assert "cost_usd" not in b[0]  # no price, no cost figures


def test_tensorboard_files_read_back(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(runs[0]))
    events.Reload()
    logged = records(runs[0])
    for tag, key in (
        ("train/loss", "loss"),
        ("train/grad_norm_max", "grad_norm_max"),
        ("cost/usd", "cost_usd"),
        ("eval/loss", "val_loss"),
    ):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        want = [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged if key in r]
        assert got == want, tag


def test_validation_loss_is_logged_on_held_out_documents(runs):
    logged = [r for r in records(runs[0]) if "val_loss" in r]
    assert [r["step"] for r in logged] == [3, 6]
    for r in logged:
        assert r["val_perplexity"] == pytest.approx(math.exp(r["val_loss"]))
        assert r["val_tokens"] == 2 * 2 * 32  # eval.batches micro-batches of full rows


def hand_loss(model, ids: list[int], seq_len: int) -> tuple[float, int]:
    """Cross-entropy over consecutive windows of seq_len + 1 tokens sharing one token, computed one window at a
    time in float64."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - 1, seq_len):
        window = torch.tensor(ids[start : start + seq_len + 1])
        logits = model(window[None, :-1]).double()[0]
        total += F.cross_entropy(logits, window[1:], reduction="sum").item()
        count += len(window) - 1
    return total / count, count


def test_hlat_eval_equals_loss_by_hand(runs, capsys):
    file = os.path.join(CORPUS_DIR, "scanner.py")
    assert main(["eval", str(runs[0]), "--data", file, "--json", "--batch-size", "3"]) == 0
    got = json.loads(capsys.readouterr().out)
    _, model, tok = load_trained(runs[0])
    ids = [i for doc in iter_documents(file) for i in [*tok.encode_batch([doc])[0], tok.eos_id]]
    with torch.no_grad():
        loss, count = hand_loss(model, ids, 32)
    assert (got["checkpoint"], got["step"]) == (str(runs[0] / "checkpoints" / "step_00000006"), 6)  # the latest
    assert got["tokens"] == count == len(ids) - 1
    assert got["loss"] == pytest.approx(loss, rel=1e-5)
    assert got["perplexity"] == pytest.approx(math.exp(loss), rel=1e-4)


def test_hlat_eval_names_each_checkpoint_it_evaluates(runs, capsys):
    common = ["--data", os.path.join(CORPUS_DIR, "scanner.py"), "--max-batches", "2"]
    assert main(["eval", str(runs[0]), str(runs[1]), "--all", *common, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    expected = [*complete_checkpoints(runs[0]), *complete_checkpoints(runs[1])]
    assert [(r["checkpoint"], r["step"]) for r in rows] == [(str(p), s) for s, p in expected] and len(rows) == 3
    for row in rows:  # each row holds the figures of its own checkpoint
        assert main(["eval", row["checkpoint"], *common, "--json"]) == 0
        assert json.loads(capsys.readouterr().out) == row
    assert main(["eval", str(runs[0]), *common, "--all"]) == 0
    header, *table = capsys.readouterr().out.splitlines()
    assert header.split() == ["step", "loss", "perplexity", "tokens", "set", "checkpoint"]
    assert [line.split() for line in table] == [
        [str(r["step"]), f"{r['loss']:.4f}", f"{r['perplexity']:.2f}", f"{r['tokens']:,}", "-", r["checkpoint"]]
        for r in rows[:2]
    ]


def test_hlat_eval_says_what_it_is_doing_and_prints_no_header_before_an_error(runs, capsys, monkeypatch):
    """Without --data, on the run's held-out split, each phase (reading and tokenizing it, evaluating it) made slow
    here until a line on stderr has named it, with its count so far: a long eval is seen to move, stdout keeps the
    table alone. A run without validation data is refused in one line, no table header before it."""
    import threading

    from hlat import console
    from hlat.train import validation

    heard = {"reading and tokenizing": threading.Event(), "evaluating": threading.Event()}
    say, documents, evaluate = console.Ticker.say, validation.validation_documents, validation.evaluate

    def said(self, what):
        say(self, what)
        for phase, event in heard.items():
            if re.search(rf": {phase} \(\w+: [1-9]", what):  # a line said at its count 0 does not show it moving
                event.set()

    def slowed(items, phase: str):
        for i, item in enumerate(items):
            assert i != 1 or heard[phase].wait(60), f"no line said {phase!r}"
            yield item

    monkeypatch.setattr(console, "EVERY_S", 0.05)
    monkeypatch.setattr(console.Ticker, "say", said)
    monkeypatch.setattr(
        validation, "validation_documents", lambda *a, **k: slowed(documents(*a, **k), "reading and tokenizing")
    )
    monkeypatch.setattr(
        validation, "evaluate", lambda model, batches, *a: evaluate(model, slowed(batches, "evaluating"), *a)
    )
    assert main(["eval", str(runs[0])]) == 0
    out, err = capsys.readouterr()
    assert len(out.splitlines()) == 2 and out.split()[:2] == ["step", "loss"]  # the header and one row
    checkpoint = runs[0] / "checkpoints" / "step_00000006"
    assert re.search(
        rf"^hlat eval: {checkpoint}: the validation set: reading and tokenizing \(documents: [1-9]", err, re.M
    )
    assert re.search(r": the validation set: evaluating \(batches: [1-9]\d* of [1-9]\d*\) \(\d+ s\)$", err, re.M)
    monkeypatch.undo()
    assert main(["eval", str(runs[1])]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("hlat: error: --data: give the files to evaluate") and err.count("\n") == 1


def test_output_to_a_pipe_is_never_wrapped(tmp_path):
    """Piped into a log, every message and table row is whole: a grep for the checkpoint path finds it."""
    import subprocess
    import sys

    run_dir = tmp_path / ("a-run-directory-whose-name-is-longer-than-a-terminal-is-wide-" * 2)
    cfg = build_config(
        {
            "model": dict(TINY),
            "data": {"paths": [CORPUS], "workers": 0},
            "train": {"steps": 1, "global_batch": 2, "micro_batch": 2, "seq_len": 16, "run_dir": str(run_dir)},
        }
    )
    (tmp_path / "c.toml").write_text(cfg.to_toml())
    done = subprocess.run(
        [sys.executable, "-m", "hlat", "train", "--config", str(tmp_path / "c.toml")],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "COLUMNS": ""},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    checkpoint = str(run_dir / "checkpoints" / "step_00000001")
    assert any(checkpoint in line for line in done.stdout.splitlines()), done.stdout


def test_holdout_split_is_disjoint_from_training():
    docs = [doc for doc in iter_documents(os.path.join(CORPUS_DIR, "__init__.py"))] + [f"doc {i}" for i in range(400)]
    held = [d for d in docs if held_out(d, 0.25)]
    assert 0.15 < len(held) / len(docs) < 0.35
    assert all(held_out(d, 0.5) for d in held)  # a larger fraction keeps what a smaller one set aside


def test_compare_deviations_equal_hand_computation(runs, tmp_path, capsys):
    png = tmp_path / "cmp.png"
    assert main(["compare", str(runs[0]), str(runs[1]), "--out", str(png), "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    a, b = ({r["step"]: r for r in records(r)} for r in runs)
    common = sorted(a.keys() & b.keys())
    assert common == [1, 2, 4, 6]  # a logs every step to 6, b every 2 steps (and its first) to 8
    (row,) = got["deviations"]
    for metric, key in (("loss", "loss"), ("grad_norm", "grad_norm_mean")):
        rel = [abs(b[s][key] - a[s][key]) / abs(a[s][key]) for s in common]
        assert row[metric] == {"steps": 4, "max": pytest.approx(max(rel)), "mean": pytest.approx(sum(rel) / 4)}
    assert "val_loss" not in row  # only the first run validated


def test_compare_rejects_a_directory_without_metrics(tmp_path, capsys):
    assert main(["compare", str(tmp_path), "--out", str(tmp_path / "x.png")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_generate_cli_greedy_matches_the_function(runs, capsys):
    base = ["generate", str(runs[0]), "--prompt", "def ", "--max-new-tokens", "12"]
    assert main(base + ["--temperature", "0"]) == 0
    assert main(base + ["--temperature", "0", "--seed", "5"]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first == second and first.startswith("def ")
    _, model, tok = load_trained(runs[0])
    (ids,) = tok.encode_batch(["def "])
    (new,) = generate(model, [ids], 12, eos_id=tok.eos_id)
    assert first == "def " + tok.decode([t for t in new if t != tok.eos_id])


def test_an_imported_checkpoint_keeps_its_tokenizer_and_samples_come_apart(runs, tmp_path, capsys):
    """`hlat import-hf` puts the transformers directory's tokenizer into the checkpoint, where `hlat generate`
    finds it (without one it says where it looked); several samples each follow a line of their own."""
    assert main(["export-hf", str(runs[0]), "--out", str(tmp_path / "hf")]) == 0
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 0
    assert capsys.readouterr().out.endswith("(with its tokenizer, tokenizer.json)\n")
    sampled = []
    for source in (tmp_path / "ckpt", runs[0]):  # the imported weights and the run's own, greedy
        assert (
            main(
                [
                    "generate",
                    str(source),
                    "--prompt",
                    "def ",
                    "--max-new-tokens",
                    "6",
                    "--temperature",
                    "0",
                    "--samples",
                    "2",
                    "--seed",
                    "4",
                ]
            )
            == 0
        )
        sampled.append(capsys.readouterr().out)
    assert sampled[0] == sampled[1]
    first, *rest = sampled[0].split("--- sample 2 of 2 (seed 5)\n")
    assert first.startswith("--- sample 1 of 2 (seed 4)\ndef ") and rest == [first.split("\n", 1)[1]]
    (tmp_path / "hf" / "tokenizer.json").unlink()
    assert main(["import-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "bare")]) == 0
    assert main(["generate", str(tmp_path / "bare"), "--prompt", "def "]) == 2
    assert f"{tmp_path / 'bare'}: no tokenizer in it or in its run directory" in capsys.readouterr().err


def random_model(preset: str, **fields):
    """A model with large random weights (std 0.5): its greedy choices are far from ties."""
    cfg = model_config(
        preset, dim=64, n_layers=2, n_heads=4, ffn_dim=128, vocab_size=256, max_seq_len=128, init_std=0.5, **fields
    )
    return materialize(build_model(cfg), "cpu", seed=3).double()


@pytest.mark.parametrize("preset,fields", [("tiny", {"n_kv_heads": 2}), ("tiny-neox", {})])
def test_kv_cache_equals_full_forward(preset, fields):
    model = random_model(preset, **fields)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = KVCache(model.cfg, 2, 24, "cpu", torch.float64)
        pieces = [model(tokens[:, :9], cache=cache), model(tokens[:, 9:13], cache=cache)]
        pieces += [model(tokens[:, i : i + 1], cache=cache) for i in range(13, 24)]
    assert (torch.cat(pieces, dim=1) - full).abs().max() < 1e-10


@pytest.mark.parametrize("preset,fields", [("tiny", {"n_kv_heads": 2}), ("tiny-neox", {"rotary_pct": 0.25})])
def test_greedy_generate_equals_transformers(tmp_path, preset, fields):
    transformers = pytest.importorskip("transformers")
    model = random_model(preset, **fields)
    write_hf_dir(model.cfg, model.state_dict(), tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float64).eval()
    prompt = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(1))
    hf.generation_config.eos_token_id = None
    theirs = hf.generate(prompt, max_new_tokens=32, do_sample=False, pad_token_id=0)[0, 7:].tolist()
    ours = generate(model, prompt.tolist(), 32)[0]
    assert len(ours) == 32 and ours == theirs
    assert generate(model, prompt.tolist(), 32, use_cache=False)[0] == ours


def test_top_p_keeps_the_nucleus_only():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().expand(4000, 4)
    drawn = next_token(logits, 1.0, 0.7, torch.Generator().manual_seed(0))
    counts = torch.bincount(drawn, minlength=4).tolist()
    assert counts[2] == counts[3] == 0  # 0.5 + 0.3 reach 0.7: the rest is never drawn
    assert counts[0] / 4000 == pytest.approx(0.5 / 0.8, abs=0.04)
    assert next_token(logits[:1], 0.0, 0.7, None).tolist() == [0]


def test_cost_needs_a_priced_profile(tmp_path):
    from hlat.fields import ConfigError

    with pytest.raises(ConfigError, match="cost.hardware: profile 'cpu' has no on_demand price"):
        build_config({"cost": {"hardware": "cpu"}})
    with pytest.raises(ConfigError, match="eval.every: validation needs held-out data"):
        build_config({"eval": {"every": 10}})


def test_tokenizer_of_a_checkpoint_is_the_runs(runs):
    cfg, _, tok = load_trained(runs[0] / "checkpoints" / "step_00000006")
    assert tok.vocab_size == load_tokenizer(runs[0] / "tokenizer.json").vocab_size and cfg.train.steps == 6


def test_validation_under_tensor_parallelism_matches_one_process(tmp_path, warm_torchrun):
    """Validation through the tensor-parallel model (vocabulary-sharded logits under loss_parallel) gives the
    single process's validation loss."""
    data = {
        "model": dict(TINY),
        "data": {"paths": [CORPUS]},
        "eval": {"holdout": 0.3, "every": 2, "batches": 2},
        "optim": {"lr": 3e-3, "warmup_steps": 1, "decay_steps": 4},
        "train": {"steps": 2, "global_batch": 4, "micro_batch": 2, "seq_len": 32, "log_every": 1},
    }
    single = build_config({**data, "train": {**data["train"], "run_dir": str(tmp_path / "one")}})
    train(single)
    config = tmp_path / "tp.toml"
    config.write_text(build_config({**data, "train": {**data["train"], "run_dir": str(tmp_path / "tp")}}).to_toml())
    done = warm_torchrun.run(
        2, ["train", "--config", str(config), "--parallel.tp", "2", "--parallel.sequence_parallel", "true"]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    one, tp = ([r["val_loss"] for r in records(tmp_path / name) if "val_loss" in r] for name in ("one", "tp"))
    assert len(one) == 1 and tp == pytest.approx(one, rel=1e-4)


def test_named_validation_sets_and_the_best_checkpoint(tmp_path, capsys):
    """Two named sets beside the holdout set, each logged under its name and equal to `hlat eval` of the
    checkpoint on its files; the best checkpoint by one of them is where that loss was lowest, outside the
    rotation, verified, and evaluates and resumes like any other."""
    prose = tmp_path / "prose.txt"
    prose.write_text("The river runs past the mill and under the old stone bridge. " * 40)
    code = [os.path.join(CORPUS_DIR, name) for name in ("scanner.py", "tool.py")]
    run = tmp_path / "run"
    cfg = build_config(
        {
            "model": dict(TINY),
            "data": {"paths": [CORPUS]},
            "optim": {"lr": 0.05, "warmup_steps": 1},
            "train": {
                "steps": 6,
                "global_batch": 4,
                "micro_batch": 2,
                "seq_len": 32,
                "log_every": 1,
                "ckpt_every": 1,
                "keep_checkpoints": 1,
                "run_dir": str(run),
            },
            "eval": {
                "holdout": 0.3,
                "every": 1,
                "batches": 2,
                "keep_best": "val_prose_loss",
                "sets": [f"code:{code[1]}", f"prose:{prose}", f"code:{code[0]}"],
            },
        }
    )
    train(cfg)
    logged = records(run)
    for r in logged:
        for name in ("", "code_", "prose_"):
            assert r[f"val_{name}perplexity"] == pytest.approx(math.exp(r[f"val_{name}loss"]))
            assert r[f"val_{name}tokens"] == 2 * 2 * 32
    best = json.loads((run / "checkpoints" / "best.json").read_text())
    losses = [r["val_prose_loss"] for r in logged]
    assert best == {
        "step": logged[losses.index(min(losses))]["step"],
        "metric": "val_prose_loss",
        "value": min(losses),
        "checkpoint": f"best_step_{best['step']:08d}",
    }
    kept = {best["checkpoint"], "best.json", "step_00000006", "run_token"}  # run_token: the memory tier's
    assert {p.name for p in (run / "checkpoints").iterdir()} == kept
    best_dir = run / "checkpoints" / best["checkpoint"]
    verify_checkpoint(best_dir)
    capsys.readouterr()
    assert main(["checkpoint", "verify", str(run), "--json"]) == 0  # the best checkpoint is one of the run's
    verified = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(v["checkpoint"], v["step"], v["ok"]) for v in verified} == {
        (str(best_dir), best["step"], True),
        (str(run / "checkpoints" / "step_00000006"), 6, True),
    }

    def evaluated(checkpoint, *files):
        assert main(["eval", str(checkpoint), "--data", *files, "--json", "--max-batches", "2"]) == 0
        return json.loads(capsys.readouterr().out.splitlines()[-1])["loss"]

    assert evaluated(best_dir, str(prose)) == pytest.approx(best["value"], rel=1e-5)
    assert evaluated(run, *code) == pytest.approx(logged[-1]["val_code_loss"], rel=1e-5)
    # without --data, each of the run's own sets, as training evaluated them (eval.batches = 2)
    assert main(["eval", str(run), "--json", "--max-batches", "2"]) == 0
    rows = {row["set"]: row for row in map(json.loads, capsys.readouterr().out.splitlines())}
    assert list(rows) == ["", "code", "prose"]
    for name, row in rows.items():
        assert row["loss"] == pytest.approx(logged[-1][f"val_{name + '_' if name else ''}loss"], rel=1e-5)
    train(
        replace(
            cfg, train=replace(cfg.train, run_dir=str(tmp_path / "again"), resume=str(best_dir), steps=best["step"] + 1)
        )
    )
    assert [r["step"] for r in records(tmp_path / "again")] == [best["step"] + 1]
    compared(run, tmp_path / "again", capsys)


def compared(run, other, capsys) -> None:
    """`hlat compare` of two runs that logged named validation sets: a panel each in the figure, two columns each
    in the table, and their deviations (the resumed run's step is the first run's step again: none)."""
    from hlat.tools.compare import plot, read_run

    titles = plot([read_run(run, "a"), read_run(other, "b")], run.parent / "cmp.png")
    assert titles == [
        "training loss",
        "gradient norm",
        "validation loss",
        "validation loss: code",
        "validation loss: prose",
    ]
    capsys.readouterr()
    assert main(["compare", str(run), str(other), "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["deviations"]
    for metric in ("val_loss", "val_code_loss", "val_prose_loss"):
        assert row[metric] == {"steps": 1, "max": 0.0, "mean": 0.0}
    assert main(["compare", str(run), str(other)]) == 0
    header = capsys.readouterr().out
    assert all(f"{m} {s}" in header for m in ("val_code_loss", "val_prose_loss") for s in ("max", "mean"))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"sets": ["Code:x.py"]}, "eval.sets[0]: 'Code:x.py' is not NAME:PATTERN"),
        ({"sets": ["code"]}, "eval.sets[0]: 'code' is not NAME:PATTERN"),
        (
            {"sets": ["code:x.py"], "keep_best": "val_loss"},
            "eval.keep_best: 'val_loss' is not a validation loss of this run (it has: val_code_loss)",
        ),
        ({"holdout": 0.1, "keep_best": "val_loss", "every": 0}, "eval.keep_best: needs validation during training"),
    ],
)
def test_validation_sets_and_keep_best_are_checked(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        build_config({"eval": {"every": 1, **fields}})


def test_the_data_mix_is_logged_per_source_over_each_interval_and_the_run(tmp_path, capsys):
    """Two weighted sources whose documents share no letter, so each row's source shows in its text: metrics.jsonl,
    TensorBoard and the console carry each source's target share and the shares of the token positions trained on,
    over each interval and over the run, equal to a count of the same rows made here from their letters (the
    stream rebuilt as the trainer builds it, with the run's tokenizer); over whole shuffle windows the run's share
    is within one row of the weight (the mixer's bound, test_the_mix_counts_each_sources_rows_as_taken...)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hlat.data.packing import Ranks, build_stream
    from hlat.data.sources import resolve_sources

    for name, letters in (("kjv", "abc"), ("shakespeare", "xyz")):
        docs = [" ".join(letters[(i + j) % 3] * (1 + (i * j) % 5) for j in range(12 + i % 9)) for i in range(200)]
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    run = tmp_path / "run"
    # a shuffle window of one step's rows: every record falls on whole windows (test_data.py's bound applies)
    cfg = build_config(
        {
            "model": dict(TINY),
            "data": {
                "sources": [f"kjv:0.3:{tmp_path}/kjv.jsonl", f"shakespeare:0.7:{tmp_path}/shakespeare.jsonl"],
                "workers": 0,
                "shuffle_rows": 8,
            },
            "train": {
                "steps": 6,
                "global_batch": 8,
                "micro_batch": 4,
                "seq_len": 32,
                "log_every": 2,
                "run_dir": str(run),
            },
        }
    )
    train(cfg)
    logged = records(run)
    assert "mix run/target: kjv " in capsys.readouterr().out  # on the first record's line
    stream = build_stream(
        cfg.data, load_tokenizer(run / "tokenizer.json"), resolve_sources(cfg.data), 32, 4, ranks=Ranks(accum=2)
    )
    counted, previous = Counter(), Counter()
    for record in logged:
        while sum(counted.values()) < record["tokens_seen"]:
            for row in next(stream)["inputs"].tolist():
                text = set(stream.tokenizer.decode(row))
                counted["kjv" if text & set("abc") else "shakespeare"] += len(row)
        interval = sum(counted.values()) - sum(previous.values())
        for name, weight in (("kjv", 0.3), ("shakespeare", 0.7)):
            assert record[f"mix_{name}_target"] == weight and record[f"mix_{name}_tokens"] == counted[name]
            assert record[f"mix_{name}_run"] == pytest.approx(counted[name] / record["tokens_seen"])
            rows = record["tokens_seen"] // 32  # within (k - 1) / rows of the weight, k = 2 sources
            assert abs(record[f"mix_{name}_run"] - weight) < 1 / rows
            assert record[f"mix_{name}_interval"] == pytest.approx((counted[name] - previous[name]) / interval)
        previous = Counter(counted)
    events = EventAccumulator(str(run))
    events.Reload()
    assert [e.value for e in events.Scalars("data_mix/kjv_run")] == pytest.approx([r["mix_kjv_run"] for r in logged])
