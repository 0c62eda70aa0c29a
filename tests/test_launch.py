"""`hlat launch` renders multi-node SLURM and Kubernetes jobs whose world size matches the layout."""

import json

import pytest

from hlat.cli import main


def render(capsys, *args):
    assert main(["launch", "--config", "configs/hlat-7b.toml", *args]) == 0
    return capsys.readouterr().out


def test_slurm_script(capsys):
    script = render(capsys, "--nodes", "4", "--nproc-per-node", "8", "--target", "slurm", "--parallel.tp", "8")
    assert "#SBATCH --nodes=4" in script and "#SBATCH --gpus-per-node=8" in script
    torchrun = next(line for line in script.splitlines() if line.startswith("srun torchrun"))
    assert "--nnodes=4" in torchrun and "--nproc-per-node=8" in torchrun
    assert "--rdzv-backend=c10d" in torchrun and '--rdzv-endpoint="$head_node:29500"' in torchrun
    assert '--rdzv-id="$SLURM_JOB_ID"' in torchrun and "scontrol show hostnames" in script
    assert torchrun.endswith("-m hlat train --config configs/hlat-7b.toml --parallel.tp 8 --resume auto")


def test_kubernetes_pytorchjob(capsys):
    job = json.loads(render(capsys, "--nodes", "4", "--target", "k8s", "--image", "reg/hlat:1", "--parallel.tp", "8"))
    assert (job["apiVersion"], job["kind"], job["spec"]["nprocPerNode"]) == ("kubeflow.org/v1", "PyTorchJob", "8")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 4
    container = replicas["Worker"]["template"]["spec"]["containers"][0]
    assert container["image"] == "reg/hlat:1" and container["resources"]["limits"]["nvidia.com/gpu"] == 8
    command = container["command"]
    for flag in ("--nnodes=$(PET_NNODES)", "--node-rank=$(PET_NODE_RANK)", "--master-addr=$(PET_MASTER_ADDR)",
                 "--master-port=$(PET_MASTER_PORT)", "--nproc-per-node=8"):
        assert flag in command
    assert command[-2:] == ["--resume", "auto"]
    assert {"name": "OMP_NUM_THREADS", "value": "1"} in container["env"]


@pytest.mark.parametrize("args, message", [
    (["--nodes", "2", "--target", "slurm", "--parallel.tp", "3"], "does not divide the world size 16"),
    (["--nodes", "2", "--target", "k8s", "--parallel.tp", "16", "--parallel.dp_shard", "2"],
     "but the world size is 16"),
    (["--nodes", "0", "--target", "slurm"], "--nodes and --nproc-per-node must be >= 1"),
])
def test_layout_is_checked_against_the_cluster(capsys, args, message):
    assert main(["launch", "--config", "configs/hlat-7b.toml", *args]) == 2
    assert message in capsys.readouterr().err
