"""Experiment tracking beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow, fed by `MetricsLog` the
same records it appends to metrics.jsonl (their numeric fields, at the record's step), from the main rank.

Both work without a network: W&B in offline mode writes under `<run>/wandb` (`wandb sync` uploads it later), and
MLflow's file store keeps runs in `<run>/mlruns` unless `tracking.mlflow_uri` names a server. Every start of the
process (a resume included) is one tracking run named after the run, whose config it records; the steps a
resume runs again are logged again by the new tracking run. The packages are optional (`pip install
'hlat[tracking]'`); `require_backends` fails in one line, before any work, when one is asked for and missing.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from hlat import optional_import
from hlat.config.job import Config, TrackingConfig
from hlat.fields import to_dict

PACKAGES = {"wandb": "wandb", "mlflow": "mlflow"}
INSTALL = "'hlat[tracking]'"
MLFLOW_PARAMS_PER_CALL = 100  # MLflow's limit on parameters in one batch


def require_backends(cfg: TrackingConfig) -> None:
    for backend in cfg.backends:
        optional_import(PACKAGES[backend], f"tracking.backends = [{backend!r}]", INSTALL)


def numeric(record: dict) -> dict[str, float]:
    """The record's numbers (not its step and time, which every backend takes apart; not null or lists)."""
    return {
        k: v
        for k, v in record.items()
        if k not in ("step", "time") and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class WandbTracker:
    def __init__(self, cfg: Config, run_dir: Path):
        self.wandb = wandb = optional_import("wandb", "tracking.backends = ['wandb']", INSTALL)
        name = cfg.tracking.run_name or run_dir.resolve().name
        # console="off": the run's own output is left alone (W&B would otherwise wrap stdout and stderr)
        self.run = wandb.init(
            project=cfg.tracking.project,
            name=name,
            group=name,
            dir=str(run_dir),
            mode=cfg.tracking.wandb_mode,
            config=to_dict(cfg),
            settings=wandb.Settings(console="off", silent=True),
        )

    def log(self, record: dict) -> None:
        self.run.log(numeric(record), step=record["step"])

    def close(self) -> None:
        """Finish the run, its files written. W&B's service keeps the run's log (<run>/wandb/.../run-*.wandb) in
        32 KiB blocks and writes the last of them when it closes the run, which `finish` asks of it without waiting:
        until then the log may hold no record at all. `teardown` waits for the service to close it, and exit."""
        self.run.finish()
        self.wandb.teardown()


class MlflowTracker:
    def __init__(self, cfg: Config, run_dir: Path):
        mlflow = optional_import("mlflow", "tracking.backends = ['mlflow']", INSTALL)
        self.entities = optional_import("mlflow.entities", "tracking.backends = ['mlflow']", INSTALL)
        uri = cfg.tracking.mlflow_uri or (run_dir / "mlruns").resolve().as_uri()
        if not cfg.tracking.mlflow_uri:  # MLflow 3 keeps its file store in maintenance mode, behind this switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = mlflow.MlflowClient(tracking_uri=uri)
        project = cfg.tracking.project
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
        name = cfg.tracking.run_name or run_dir.resolve().name
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [self.entities.Param(k, str(v)) for k, v in flat(to_dict(cfg)).items()]
        for i in range(0, len(params), MLFLOW_PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_PARAMS_PER_CALL])

    def log(self, record: dict) -> None:
        stamp = int(1000 * (record.get("time") or time.time()))
        metrics = [self.entities.Metric(k, float(v), stamp, record["step"]) for k, v in numeric(record).items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def flat(d: dict, prefix: str = "") -> dict:
    """{"train.steps": 300, ...}: a config as MLflow's flat parameters."""
    out = {}
    for k, v in d.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


TRACKERS = {"wandb": WandbTracker, "mlflow": MlflowTracker}


def open_trackers(cfg: Config) -> list:
    """The configured backends' trackers for this run (call on the main rank only)."""
    return [TRACKERS[backend](cfg, Path(cfg.train.run_dir)) for backend in cfg.tracking.backends]
