"""Experiment tracking: Weights & Biases (offline) and MLflow (its file store) receive the records metrics.jsonl
gets, each at its step, and the run's name, config and clean end, read back from what each wrote in the run directory
as soon as training returns; both packages are test dependencies, so these tests run rather than skip. A backend whose
package is missing is one line before any work."""

import json
import os
import sys
from pathlib import Path

import pytest

from hlat.cli import main
from hlat.config.job import build_config
from hlat.train.loop import train

CORPUS = os.path.join(os.path.dirname(json.__file__), "*.py")
TINY = {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 512}


def tracked_run(run_dir: Path, backend: str) -> dict[int, dict]:
    """A 4-step run with validation at steps 2 and 4, tracked by `backend`; metrics.jsonl's numbers by step."""
    train(
        build_config(
            {
                "model": TINY,
                "data": {"paths": [CORPUS]},
                "train": {
                    "steps": 4,
                    "global_batch": 4,
                    "micro_batch": 2,
                    "seq_len": 32,
                    "log_every": 1,
                    "run_dir": str(run_dir),
                },
                "eval": {"holdout": 0.3, "every": 2, "batches": 2},
                "tracking": {"backends": [backend], "project": "tests", "run_name": "tiny"},
            }
        )
    )
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {
        r["step"]: {k: v for k, v in r.items() if k not in ("step", "time") and type(v) in (int, float)}
        for r in records
    }


def wandb_records(path: Path) -> list[bytes]:
    """The records of a W&B transaction log (.wandb): a 7-byte file header, then LevelDB-log records (checksum,
    length, type; type 1 is whole, 2-4 first, middle and last pieces) in 32 KiB blocks."""
    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, piece, out = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # too little left in the block for a header: padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        piece += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            out.append(piece)
            piece = b""
    return out


def wandb_history(run_dir: Path) -> dict[int, dict]:
    """The history of the one offline W&B run in `run_dir`, whose name, project and config are checked, and which
    must have ended cleanly: an exit record, code 0, the log's last, which W&B's service writes when it closes the
    run (hlat waits for that: hlat/train/tracking.py)."""
    from wandb.proto import wandb_internal_pb2

    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    history, runs, exits = {}, [], []
    for raw in wandb_records(log):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item}
            history[record.history.step.num] = {k: v for k, v in items.items() if not k.startswith("_")}
        elif kind == "run":
            runs.append(record.run)
        elif kind == "exit":
            exits.append(record.exit.exit_code)
    (run,) = runs
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert (run.display_name, run.project, config["train"]["steps"], config["model"]["dim"]) == ("tiny", "tests", 4, 64)
    assert exits == [0]
    return history


def mlflow_history(run_dir: Path) -> dict[int, dict]:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=(run_dir / "mlruns").as_uri())
    (run,) = client.search_runs([client.get_experiment_by_name("tests").experiment_id])
    assert (run.info.run_name, run.data.params["train.steps"], run.data.params["model.dim"]) == ("tiny", "4", "64")
    assert run.info.status == "FINISHED"
    history: dict[int, dict] = {}
    for key in run.data.metrics:
        for metric in client.get_metric_history(run.info.run_id, key):
            history.setdefault(metric.step, {})[key] = metric.value
    return history


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_tracking_gets_the_records_of_metrics_jsonl(backend, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # hlat turns on MLflow 3's file store itself
    expected = tracked_run(tmp_path / "run", backend)
    assert expected[2]["val_loss"] > 0 and "val_loss" not in expected[3]
    tracked = wandb_history(tmp_path / "run") if backend == "wandb" else mlflow_history(tmp_path / "run")
    assert tracked == expected


def test_a_missing_tracking_package_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed: importing it fails
    code = main(
        [
            "train",
            "--data.paths",
            CORPUS,
            "--train.run_dir",
            str(tmp_path / "run"),
            "--tracking.backends",
            "wandb",
            "--model.n_layers",
            "1",
            "--train.steps",
            "1",
        ]
    )
    assert code == 2 and capsys.readouterr().err == (
        "hlat: error: tracking.backends = ['wandb'] needs the optional package 'wandb': pip install 'hlat[tracking]'\n"
    )
    assert not (tmp_path / "run").exists()
