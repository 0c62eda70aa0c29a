"""`hlat launch`: render a multi-node job for SLURM (sbatch script) or Kubernetes (Kubeflow PyTorchJob) from
the same config. The layout is checked against nodes x processes per node before anything is written; every
node runs torchrun with c10d rendezvous and `--resume auto`, so a requeued or restarted job continues from its
latest complete checkpoint."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from hlat.train.config import load_config

RDZV_PORT = 29500


def _train_args(config: str, overrides: list[str]) -> list[str]:
    return ["-m", "hlat", "train", "--config", config, *overrides, "--resume", "auto"]


def _job_name(config: str) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(config).stem.lower()).strip("-")
    return stem if stem.startswith("hlat") else f"hlat-{stem}"


def render_slurm(config: str, nodes: int, nproc_per_node: int, overrides: list[str], gpus: bool = True) -> str:
    name = _job_name(config)
    torchrun = ["torchrun", f"--nnodes={nodes}", f"--nproc-per-node={nproc_per_node}", '--rdzv-id="$SLURM_JOB_ID"',
                "--rdzv-backend=c10d", f'--rdzv-endpoint="$head_node:{RDZV_PORT}"']
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={nproc_per_node}"] if gpus else []),
        "#SBATCH --exclusive",
        "#SBATCH --requeue",
        f"#SBATCH --output={name}-%j.out",
        "set -euo pipefail",
        'head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        "export OMP_NUM_THREADS=1",
        f"# world size: {nodes} nodes x {nproc_per_node} processes = {nodes * nproc_per_node}",
        "srun " + " ".join(torchrun) + " " + shlex.join(_train_args(config, overrides)),
    ]
    return "\n".join(lines) + "\n"


def render_k8s(config: str, nodes: int, nproc_per_node: int, overrides: list[str], image: str,
               gpus: bool = True) -> str:
    """A Kubeflow PyTorchJob: the operator sets PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR/PORT for torchrun."""
    command = ["torchrun", "--nnodes=$(PET_NNODES)", f"--nproc-per-node={nproc_per_node}",
               "--node-rank=$(PET_NODE_RANK)", "--master-addr=$(PET_MASTER_ADDR)",
               "--master-port=$(PET_MASTER_PORT)", *_train_args(config, overrides)]
    resources = {"limits": {"nvidia.com/gpu": nproc_per_node}} if gpus else {}

    def replica(count: int) -> dict:
        container = {"name": "pytorch", "image": image, "command": command,
                     "env": [{"name": "OMP_NUM_THREADS", "value": "1"}], "resources": resources}
        return {"replicas": count, "restartPolicy": "OnFailure", "template": {"spec": {"containers": [container]}}}

    job = {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": _job_name(config)},
        "spec": {"nprocPerNode": str(nproc_per_node),
                 "pytorchReplicaSpecs": {"Master": replica(1), **({"Worker": replica(nodes - 1)} if nodes > 1 else {})}},
    }
    # JSON is valid YAML, and needs no YAML library
    return json.dumps(job, indent=2) + "\n"


def render(config: str, nodes: int, nproc_per_node: int, target: str, overrides: list[str], image: str,
           gpus: bool = True) -> str:
    """The job file for `target`, after checking the config and its layout for nodes x nproc_per_node ranks."""
    load_config(config, overrides).resolved_parallel(nodes * nproc_per_node)
    if target == "slurm":
        return render_slurm(config, nodes, nproc_per_node, overrides, gpus)
    return render_k8s(config, nodes, nproc_per_node, overrides, image, gpus)
