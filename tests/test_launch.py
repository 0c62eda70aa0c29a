"""`hlat launch` renders multi-node SLURM and Kubernetes jobs that match the layout and survive restarts."""

import json
import math
import subprocess

import pytest

from hlat import HlatError
from hlat.cli import main

# hlat-7b's 2,048 processes on trn2 (hlat cannot train on the recipe's trn1: test_trn1_is_priced_not_launched)
TRN2 = ["--cluster.hardware", "trn2.48xlarge", "--nodes", "32", "--nproc-per-node", "64"]
P5 = ["--cluster.hardware", "p5.48xlarge", "--nproc-per-node", "8"]


def render(capsys, *args, config="configs/hlat-7b.toml"):
    assert main(["launch", "--config", config, *args]) == 0
    return capsys.readouterr().out


def k8s_objects(text: str) -> dict[str, dict]:
    """The rendered Kubernetes objects by kind (one of each)."""
    return {item["kind"]: item for item in json.loads(text)["items"]}


def k8s_job(text: str) -> dict:
    return k8s_objects(text)["PyTorchJob"]


def test_slurm_script_stops_before_the_time_limit_and_requeues(capsys):
    script = render(
        capsys,
        "--target",
        "slurm",
        "--cluster.hardware",
        "trn2.48xlarge",
        "--nodes",
        "4",
        "--nproc-per-node",
        "64",
        "--cluster.time_limit",
        "2-00:00:00",
        "--cluster.stop_grace_s",
        "1200",
    )
    lines = script.splitlines()
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --time=2-00:00:00",
        "#SBATCH --requeue",
        "srun --het-group=0 hlat service --port 29500 &",
        "trap stop_and_requeue USR1",
        'kill -TERM "$train_pid"',
        'scontrol requeue "$SLURM_JOB_ID"',
        "export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=1200",
    ):
        assert line in script, line
    assert "#SBATCH --signal=B:USR1@1200" in lines
    assert not any("--gpus-per-node" in line for line in lines)  # trn2: Neuron devices, not GPUs
    # a heterogeneous job: the service alone on the first component's node (one task, two CPUs), where the script
    # runs; the 4 training nodes in the second, whole
    service, training = script.split("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=1" in service and "#SBATCH --cpus-per-task=2" in service and "--exclusive" not in service
    assert "#SBATCH --nodes=4" in training and "#SBATCH --exclusive" in training
    assert 'service_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)' in lines
    torchrun = next(line for line in lines if line.startswith("srun --het-group=1 hlat torchrun"))
    for flag in (
        "--nnodes=4",
        "--nproc-per-node=64",
        "--max-restarts=3",
        "--rdzv-backend=hlat",
        '--rdzv-endpoint="$service_node:29500"',
        '--rdzv-id="$SLURM_JOB_ID"',
    ):
        assert flag in torchrun
    assert torchrun.endswith(
        "-m hlat train --config configs/hlat-7b.toml --cluster.nodes 4 --cluster.nproc_per_node "
        "64 --cluster.hardware trn2.48xlarge --cluster.time_limit 2-00:00:00 "
        "--cluster.stop_grace_s 1200 --resume auto &"
    )
    assert not any("preflight" in line for line in lines)


@pytest.mark.parametrize("training", [False, True])
def test_slurm_stop_handler_requeues_during_preflight_and_training(training, capsys, tmp_path):
    """The USR1 handler under the script's `set -u`: before training starts (preflight) it only requeues; once
    training runs it stops the trainers, waits for them, then requeues."""
    script = render(capsys, "--target", "slurm", "--cluster.preflight", "true", *TRN2)
    lines = script.splitlines()
    handler = "\n".join(lines[lines.index(next(x for x in lines if x.startswith("stop_and_requeue() {"))) :][:9])
    assert handler.endswith("}")
    start = "sleep 30 & train_pid=$!\n" if training else ""
    done = subprocess.run(
        [
            "bash",
            "-c",
            'set -uo pipefail\nscontrol() { echo requeued "$@"; }\n'
            f"SLURM_JOB_ID=7\n{handler}\n{start}stop_and_requeue\necho not reached",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "requeued requeue 7" and "not reached" not in done.stdout


def test_slurm_on_gpus_with_preflight(capsys):
    script = render(capsys, "--target", "slurm", *P5, "--nodes", "32", "--cluster.preflight", "true")
    assert "#SBATCH --gpus-per-node=8" in script and "#SBATCH --time" not in script
    preflight = next(line for line in script.splitlines() if "hlat preflight" in line)
    assert preflight.startswith(
        "srun --het-group=1 hlat torchrun --nnodes=32 --nproc-per-node=8 --max-restarts=0 --rdzv-backend=hlat "
        '--rdzv-id="$SLURM_JOB_ID-preflight" --rdzv-endpoint="$service_node:29500" -m hlat '
        "preflight --config configs/hlat-7b.toml"
    )
    assert preflight.endswith(" || exit 1") and script.index(preflight) < script.index("--max-restarts=3")


@pytest.mark.parametrize("failures", [1, 3])
def test_slurm_runs_the_preflight_again_before_each_restart(failures, capsys, tmp_path):
    """cluster.preflight_restarts: the script starts torchrun itself (which restarts nothing), each start after a
    preflight, until training succeeds or max_restarts restarts have failed (srun stands in for the cluster)."""
    script = render(
        capsys,
        "--target",
        "slurm",
        "--cluster.preflight",
        "true",
        "--cluster.preflight_restarts",
        "true",
        "--cluster.max_restarts",
        "2",
        *TRN2,
    )
    lines = script.splitlines()
    tail = "\n".join(lines[lines.index("trap stop_and_requeue USR1") + 1 :])
    # training runs in the background (a subshell): its starts are counted in a file
    srun = (
        'srun() { for a in "$@"; do case $a in service) return 0;; preflight) echo preflight; return 0;; '
        'train) echo >> "$starts"; '
        f'echo "train $*"; [ "$(wc -l < "$starts")" -gt {failures} ]; return;; esac; done; }}'
    )
    setup = f"set -uo pipefail\nstarts={tmp_path / 'starts'}\nSLURM_JOB_ID=7\nservice_node=s"
    done = subprocess.run(
        ["bash", "-c", f"{setup}\n{srun}\n{tail}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    steps = [line.split()[0] for line in done.stdout.splitlines() if line.split()[0] in ("preflight", "train")]
    starts = min(failures + 1, 3)
    assert steps == ["preflight", "train"] * starts
    assert done.returncode == (0 if failures < 3 else 1), done.stdout + done.stderr
    trains = [line for line in done.stdout.splitlines() if line.startswith("train ")]
    assert all("--max-restarts=0" in t for t in trains) and "--rdzv-id=7-1" in trains[1]
    assert "hlat: training failed (start 1 of 3): preflight, then resume" in done.stdout
    # a restart's preflight needs the preflight itself
    assert (
        main(
            ["launch", "--config", "configs/hlat-7b.toml", "--target", "slurm", "--cluster.preflight_restarts", "true"]
        )
        == 2
    )
    assert "cluster.preflight_restarts: runs the preflight again before a restart" in capsys.readouterr().err


def test_slurm_does_not_restart_an_hlat_error(capsys, tmp_path):
    """With cluster.preflight_restarts the script restarts torchrun itself: not after exit code 2 (`hlat torchrun`
    passes on a trainer's full disk or other hlat error), which the same start would meet again."""
    script = render(
        capsys, "--target", "slurm", "--cluster.preflight", "true", "--cluster.preflight_restarts", "true", *TRN2
    )
    lines = script.splitlines()
    tail = "\n".join(lines[lines.index("trap stop_and_requeue USR1") + 1 :])
    srun = (
        'srun() { for a in "$@"; do case $a in service) return 0;; preflight) echo preflight; return 0;; '
        "train) echo train; return 2;; esac; done; }"
    )
    done = subprocess.run(
        ["bash", "-c", f"set -uo pipefail\nSLURM_JOB_ID=7\nservice_node=h\n{srun}\n{tail}"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and done.stdout.split()[:2] == ["preflight", "train"]
    assert done.stdout.splitlines().count("train") == 1 and "not restarted" in done.stdout


def run_script_tail(script: str, cases: str) -> subprocess.CompletedProcess:
    """The SLURM script after its traps, with `srun` answering by `cases` (bash case arms on its arguments) and
    `scontrol` echoing itself."""
    lines = script.splitlines()
    tail = "\n".join(lines[lines.index("trap stop_and_requeue USR1") + 1 :])
    srun = f'srun() {{ for a in "$@"; do case $a in {cases} esac; done; }}\nscontrol() {{ echo scontrol "$@"; }}'
    return subprocess.run(
        ["bash", "-c", f"set -uo pipefail\nSLURM_JOB_ID=7\nservice_node=h\n{srun}\n{tail}"],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("restarts", ["false", "true"])
def test_slurm_requeues_a_job_that_lost_its_service(restarts, capsys):
    """Training that ends with exit code 4 (the service lost: hlat torchrun's one line) requeues the job, which starts
    a new service and resumes; under cluster.preflight_restarts too, where the script restarts torchrun itself."""
    script = render(
        capsys, "--target", "slurm", "--cluster.preflight", "true", "--cluster.preflight_restarts", restarts, *TRN2
    )
    done = run_script_tail(
        script, "service) echo service; return 0;; preflight) return 0;; train) echo train; return 4;;"
    )
    out = done.stdout.splitlines()
    assert done.returncode == 0 and out.count("train") == 1, done.stdout + done.stderr
    # the service's step runs in the background: its line may come at any point
    assert "service" in out and [line for line in out if line != "service"][-1] == "scontrol requeue 7"


def test_kubernetes_pods_restart_through_the_preflight(capsys):
    job = k8s_job(
        render(capsys, "--target", "k8s", "--cluster.preflight", "true", "--cluster.preflight_restarts", "true", *TRN2)
    )
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    preflight, train = container["command"][2].split(" && exec ")
    assert "--max-restarts=0" in train and job["spec"]["runPolicy"]["backoffLimit"] == 3  # the pods restart


def test_kubernetes_job_keeps_runs_on_a_volume(capsys):
    objects = k8s_objects(
        render(
            capsys,
            "--target",
            "k8s",
            "--image",
            "reg/hlat:1",
            "--cluster.run_volume",
            "fsx",
            "--optim.lr",
            "1e-4",
            *TRN2,
        )
    )
    config_map, job = objects["ConfigMap"], objects["PyTorchJob"]
    assert (job["apiVersion"], job["kind"], job["spec"]["nprocPerNode"]) == ("kubeflow.org/v1", "PyTorchJob", "64")
    assert "lr = 0.0001" in config_map["data"]["config.toml"]  # the resolved config, overrides included
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 32
    pod = replicas["Worker"]["template"]["spec"]
    assert replicas["Worker"]["restartPolicy"] == "OnFailure" and pod["terminationGracePeriodSeconds"] == 900
    (container,) = pod["containers"]
    assert container["image"] == "reg/hlat:1"
    # the Trainium2 chips that hold 64 NeuronCores, the node's 16 EFA interfaces, 90% of its 192 CPUs and 2 TiB
    assert container["resources"] == {
        "limits": {"aws.amazon.com/neuron": 16, "vpc.amazonaws.com/efa": 16},
        "requests": {"cpu": "172", "memory": "1843Gi"},
    }
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert volumes["runs"]["persistentVolumeClaim"] == {"claimName": "fsx"} and mounts["runs"] == "/workspace/runs"
    assert container["workingDir"] == "/workspace"  # so the relative runs/hlat-7b is on the claim
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory" and mounts["shm"] == "/dev/shm"
    assert volumes["config"]["configMap"]["name"] == config_map["metadata"]["name"]
    assert volumes["data"]["persistentVolumeClaim"] == {"claimName": "hlat-data", "readOnly": True}
    assert mounts["data"] == "/data"  # where the recipes' data.paths and tokenizer are
    command = container["command"]
    for flag in (
        "--nnodes=32",
        "--max-restarts=3",
        "--rdzv-backend=hlat",
        "--rdzv-endpoint=hlat-7b-service:29500",
    ):
        assert flag in command
    assert command[-5:] == ["train", "--config", "/etc/hlat/config.toml", "--resume", "auto"]
    assert {"name": "TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "value": "900"} in container["env"]


def test_kubernetes_runs_the_service_apart_from_the_training_pods(capsys):
    """The service: a Deployment of one `hlat service` pod that may not share a node with the job's training pods (so
    that losing a training node never loses it too), and a Service that names it for every training pod's
    rendezvous."""
    objects = k8s_objects(render(capsys, "--target", "k8s", "--image", "reg/hlat:1", *TRN2))
    deployment, service, job = objects["Deployment"], objects["Service"], objects["PyTorchJob"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]
    assert container["command"] == ["hlat", "service", "--port", "29500"] and container["image"] == "reg/hlat:1"
    assert deployment["spec"]["replicas"] == 1 and container["resources"]["requests"] == {"cpu": "2", "memory": "2Gi"}
    assert service["metadata"]["name"] == "hlat-7b-service" and service["spec"]["ports"][0]["port"] == 29500
    assert service["spec"]["selector"] == pod["metadata"]["labels"] == deployment["spec"]["selector"]["matchLabels"]
    (away,) = pod["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert away["topologyKey"] == "kubernetes.io/hostname"
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        labels = replica["template"]["metadata"]["labels"]
        assert away["labelSelector"]["matchLabels"].items() <= labels.items()
        assert "--rdzv-endpoint=hlat-7b-service:29500" in replica["template"]["spec"]["containers"][0]["command"]


def test_kubernetes_preflight_keeps_torchrun_as_pid_1(capsys):
    job = k8s_job(render(capsys, "--target", "k8s", "--nodes", "1", "--cluster.preflight", "true", "--cpu"))
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    assert "Worker" not in job["spec"]["pytorchReplicaSpecs"] and container["resources"] == {}
    shell, flag, script = container["command"]
    preflight, train = script.split(" && exec ")
    assert (shell, flag) == ("bash", "-c") and preflight.startswith("hlat torchrun --nnodes=1 ")
    assert "--rdzv-id=hlat-7b-preflight" in preflight and "--rdzv-endpoint=hlat-7b-service:29500" in preflight
    assert preflight.endswith("-m hlat preflight --config /etc/hlat/config.toml")
    assert train.startswith("hlat torchrun ") and train.endswith(
        "-m hlat train --config /etc/hlat/config.toml --resume auto"
    )


def test_torchrun_waits_for_the_shutdown_checkpoint(monkeypatch):
    """The installed torchrun reads the grace period the job files set (it kills workers after 30 s otherwise)."""
    from torch.distributed.launcher.api import LaunchConfig

    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "900")
    assert LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1).shutdown_timeout == 900


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nodes", "2", "--target", "slurm", "--parallel.tp", "3"], "does not divide the world size 64"),
        (
            ["--nodes", "2", "--target", "k8s", "--parallel.tp", "16", "--parallel.dp_replicate", "2"],
            "but the world size is 64",
        ),
        (["--nodes", "0", "--target", "slurm"], "cluster.nodes: must be >= 1"),
        (
            ["--target", "k8s", "--train.run_dir", "/scratch/run", *TRN2],
            "train.run_dir: /scratch/run is outside the volume",
        ),
    ],
)
def test_layout_and_volume_are_checked(capsys, args, message):
    assert main(["launch", "--config", "configs/hlat-7b.toml", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_recipe_switched_to_p5_requests_its_gpus_and_efa(capsys):
    """The device request follows the hardware profile, not the recipe's Trainium: 8 GPUs per p5.48xlarge, its 32
    EFA interfaces and the libfabric settings EFA needs, under SLURM and Kubernetes alike."""
    efa = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}
    script = render(capsys, "--target", "slurm", *P5, "--nodes", "256")
    assert "#SBATCH --gpus-per-node=8" in script.splitlines()
    assert all(f"export {k}={v}" in script.splitlines() for k, v in efa.items())
    job = k8s_job(render(capsys, "--target", "k8s", *P5, "--nodes", "256"))
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["resources"] == {
        "limits": {"nvidia.com/gpu": 8, "vpc.amazonaws.com/efa": 32},
        "requests": {"cpu": "172", "memory": "1843Gi"},
    }
    assert efa.items() <= {e["name"]: e["value"] for e in container["env"]}.items()


def test_a_plain_cluster_gets_no_fabric(capsys):
    script = render(capsys, "--target", "slurm", "--cluster.hardware", "", "--nproc-per-node", "8", "--nodes", "256")
    assert "#SBATCH --gpus-per-node=8" in script and "FI_" not in script and "EFA" not in script
    job = k8s_job(
        render(
            capsys,
            "--target",
            "k8s",
            "--cluster.hardware",
            "",
            "--nproc-per-node",
            "8",
            "--nodes",
            "256",
            "--cluster.cpus",
            "90",
            "--cluster.memory_gib",
            "1000",
        )
    )
    (container,) = job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"]
    assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}, "requests": {"cpu": "90", "memory": "1000Gi"}}


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--cluster.hardware", "p5.48xlarge"],  # the recipe's 32 processes per node: the refusal names the fix
            "cluster.nproc_per_node: 32 processes per node, but p5.48xlarge has 8 devices per node (one process each): "
            "use --nproc-per-node 8 (64 nodes, 512 processes) or, for the same 2,048 processes, --nodes 256 "
            "--nproc-per-node 8",
        ),
        (
            [*P5, "--nodes", "256", "--cluster.accelerator", "neuron"],
            "cluster.accelerator: 'neuron', but cluster.hardware p5.48xlarge has 'gpu' devices",
        ),
        (
            [*P5, "--nodes", "256", "--cluster.devices_per_node", "16"],
            "cluster.devices_per_node: 16, but 8 processes on p5.48xlarge need 8",
        ),
        (
            [],
            "cluster.hardware: trn1.32xlarge: training needs other hardware: hlat trains on Trainium through "
            "TorchNeuron, which runs on trn2 and later (trn1 needs torch-xla); `hlat plan` prices this cluster; "
            "to launch the same 2,048 processes use --hardware trn2.48xlarge --nodes 32",
        ),
    ],
)
@pytest.mark.parametrize("target", ["slurm", "k8s"])
def test_a_cluster_that_contradicts_its_hardware_is_refused(target, args, message, capsys):
    assert main(["launch", "--config", "hlat-7b", "--target", target, *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_each_refusal_names_flags_that_launch(capsys):
    """What the refusals above name does launch hlat-7b's 2,048 processes."""
    for fix in (["--cluster.hardware", "p5.48xlarge", "--nodes", "256", "--nproc-per-node", "8"], TRN2[2:]):
        hardware = "p5.48xlarge" if "p5.48xlarge" in fix else "trn2.48xlarge"
        script = render(capsys, "--target", "slurm", "--hardware", hardware, *fix[2 * (fix[0] != "--nodes") :])
        assert "# world size: " in script and "= 2048" in script


def plan_and_launch(capsys, *flags: str, config: str = "hlat-70b") -> tuple[dict, str, str]:
    """`hlat plan --json` and `hlat launch --target slurm` of a config with the same cluster flags: the plan, the
    job script and launch's stderr."""
    assert main(["plan", "--config", config, *flags, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(["launch", "--config", config, "--target", "slurm", *flags]) == 0
    script, err = capsys.readouterr()
    return plan, script, err


@pytest.mark.parametrize(
    "flags, nodes, per_node",
    [
        (["--hardware", "p5.48xlarge"], 256, 8),  # the recipe's nodes, used whole: one process per GPU
        (["--hardware", "p5.48xlarge", "--nodes", "64"], 64, 8),
        (["--hardware", "trn2.48xlarge", "--nproc-per-node", "32"], 256, 32),  # half of each node's NeuronCores
    ],
)
def test_launch_takes_the_cluster_flags_of_plan_and_agrees_with_it(flags, nodes, per_node, capsys):
    """`hlat launch --hardware p5.48xlarge` renders what `hlat plan --hardware p5.48xlarge` prices: its nodes, its
    processes per node and its layout, and names the same unsuitable layout in the same words."""
    plan, script, err = plan_and_launch(capsys, *flags)
    (priced,) = [p for p in plan["plans"] if p["parallel"]["tp"] == 32]  # the recipe's layout (and what search finds)
    assert (plan["hardware"], plan["nodes"]) == (flags[1], nodes) and f"#SBATCH --nodes={nodes}" in script
    assert f"# world size: {nodes} nodes x {per_node} processes = {nodes * per_node}" in script
    assert priced["parallel"]["tp"] * priced["parallel"]["pp"] * priced["parallel"]["dp_shard"] == nodes * per_node
    assert err.removeprefix("hlat launch: ").strip() in plan["notes"]


def test_plan_and_launch_share_one_definition_of_the_cluster_flags(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "120")

    def cluster_section(command: str) -> str:
        """The section of `hlat COMMAND --help` that lists the cluster flags."""
        with pytest.raises(SystemExit):
            main([command, "--help"])
        return capsys.readouterr().out.split("\n\nthe cluster")[1].split("\n\n")[0].rstrip()

    assert cluster_section("plan") == cluster_section("launch")
    assert [line.split()[0] for line in cluster_section("plan").splitlines() if line.startswith("  --")] == [
        "--hardware",
        "--nodes",
        "--nproc-per-node",
    ]


def test_a_launch_whose_tensor_parallelism_spans_nodes_says_so_beside_the_planners_layout(capsys):
    """On stderr (the job file stays whole on stdout), one line: the 70B recipe's TP32 on 8-GPU p5 nodes, and on trn2
    nodes running 16 processes each; a layout that suits its nodes gets none."""
    for args, group in (
        (P5 + ["--nodes", "256"], "on 4 p5.48xlarge nodes of 8 processes"),
        (
            ["--cluster.hardware", "trn2.48xlarge", "--nodes", "512", "--nproc-per-node", "16"],
            "on 2 trn2.48xlarge nodes of 16 processes",
        ),
    ):
        assert main(["launch", "--config", "hlat-70b", "--target", "slurm", *args]) == 0
        out, err = capsys.readouterr()
        assert out.startswith("#!/bin/bash") and err.count("\n") == 1
        assert err.startswith("hlat launch: tensor parallelism across nodes: TP32 ") and group in err
        assert "`hlat plan --search` on " in err and " chooses TP" in err
    render(capsys, "--target", "slurm", *TRN2)  # hlat-7b's TP8 on trn2: within a node, its links used well
    assert capsys.readouterr().err == ""


def test_train_names_a_tensor_parallel_group_across_the_nodes_torchrun_gives_it(capsys, monkeypatch, tmp_path):
    """`hlat train` reads the cluster it runs on from torchrun (WORLD_SIZE processes, LOCAL_WORLD_SIZE per node) and
    says so before training starts; without a hardware profile it names the group alone."""
    import hlat.train.loop

    def stop(cfg, console):
        raise HlatError("not training in this test")

    monkeypatch.setattr(hlat.train.loop, "train", stop)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2048")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    run = ["--train.run_dir", str(tmp_path / "run")]
    assert main(["train", "--config", "hlat-70b", "--cluster.hardware", "p5.48xlarge", *run]) == 2
    out = capsys.readouterr().out
    assert (
        out.startswith(
            "tensor parallelism across nodes: TP32 PP8 DP8 mb1 1F1B SP ZeRO-1 AC:sel puts each TP32 "
            "group on 4 p5.48xlarge nodes of 8 processes"
        )
        and "`hlat plan --search` on 256 x" in out
    )
    assert main(["train", "--config", "hlat-70b", "--cluster.hardware", "", *run]) == 2
    assert capsys.readouterr().out.startswith(
        "tensor parallelism across nodes: parallel.tp 32 spans nodes of 8 processes"
    )
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "32")  # trn1's 32 NeuronCores hold TP32 whole
    assert main(["train", "--config", "hlat-70b", *run]) == 2
    assert capsys.readouterr().out == ""


def test_an_elastic_job_names_the_node_counts_it_can_go_on_with(capsys):
    """cluster.min_nodes: torchrun's node range and rendezvous timings, and which counts in the range the layout
    fits (tp 8 over 4 processes per node: whole tensor-parallel groups need an even number of nodes)."""
    script = render(
        capsys,
        "--target",
        "slurm",
        "--cpu",
        "--nodes",
        "4",
        "--nproc-per-node",
        "4",
        "--parallel.tp",
        "8",
        "--cluster.min_nodes",
        "2",
        "--cluster.heartbeat_s",
        "3",
    )
    assert "srun --het-group=1 hlat torchrun --nnodes=2:4 " in script
    assert " --rdzv-conf=last_call_timeout=5,keep_alive_interval=3 " in script
    assert "# elastic: after a lost node the job goes on with 2 or 4 nodes" in script
    assert "# with 3 nodes the layout does not fit" in script
    assert (
        main(
            [
                "launch",
                "--config",
                "configs/hlat-7b.toml",
                "--target",
                "slurm",
                "--cpu",
                "--nodes",
                "4",
                "--nproc-per-node",
                "4",
                "--parallel.tp",
                "8",
                "--cluster.min_nodes",
                "1",
            ]
        )
        == 2
    )
    assert "cluster.min_nodes: 1 nodes do not fit the layout" in capsys.readouterr().err


def test_a_torchrun_job_the_trainers_would_refuse_is_refused_before_any_process(capsys, monkeypatch):
    """`hlat torchrun ... -m hlat train` checks the config and layout at the world size torchrun would start (4
    processes here) and refuses in one line, with hlat's exit code, without starting one; an elastic job (a node
    range) is left to its trainers, which check each world size; `--help` names the command."""
    import torch.distributed.run

    from hlat.jobs.torchrun import FINISHED_DIR, OWN_STORE_PER_ATTEMPT

    def started(args):
        raise AssertionError("torchrun started processes")

    monkeypatch.setattr(torch.distributed.run, "run", started)
    for name in (FINISHED_DIR, OWN_STORE_PER_ATTEMPT):  # what torchrun sets for its workers: gone after this test
        monkeypatch.setenv(name, "")
    job = ["--standalone", "--nproc-per-node", "4", "-m", "hlat", "train", "--config", "tiny"]
    for flags, line in (
        (["--parallel.cp", "3"], "parallel.cp: 3 does not divide the world size 4"),
        (
            ["--parallel.cp", "2", "--train.micro_batch", "8", "--eval.every", "5", "--eval.holdout", "0.1"],
            "eval.every",
        ),
        (["--optim.lrr", "1"], "unknown config key 'optim.lrr'; did you mean 'optim.lr'?"),
    ):
        assert main(["torchrun", *job, *flags]) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.startswith(f"hlat: error: {line}") and err.count("\n") == 1
    with pytest.raises(AssertionError, match="torchrun started processes"):  # fixed worlds only
        main(["torchrun", "--nnodes", "1:2", *job[1:], "--parallel.cp", "3"])
    with pytest.raises(SystemExit) as done:
        main(["torchrun", "--help"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("usage: hlat torchrun [-h]")


def test_the_launch_file_sets_the_hang_watchdog_at_30_of_the_planners_steps(capsys, tmp_path):
    """A shipped recipe's job runs with its hang watchdog (the recipe sets it from the planner's step:
    tests/test_config.py), which the script states. A config that leaves it off gets it in the job's command line:
    30 x the step `hlat plan` predicts on the same cluster, rounded up to whole minutes, said on stderr; an explicit
    `--train.hang_timeout_s 0` keeps it off."""
    script = render(capsys, "--target", "slurm", *TRN2)
    assert "# hang watchdog: a rank whose step has not finished in 120 s is named and the job restarts" in script
    off = tmp_path / "off.toml"
    off.write_text("[train]\nhang_timeout_s = 0\n")
    flags = ["--hardware", "trn2.48xlarge", "--nodes", "32", "--nproc-per-node", "64"]
    assert main(["plan", "--config", "hlat-7b", "--config", str(off), *flags, "--json"]) == 0
    step = json.loads(capsys.readouterr().out)["plans"][0]["step_time_s"]["total"]
    timeout = 60 * math.ceil(30 * step / 60)
    assert main(["launch", "--config", "hlat-7b", "--config", str(off), "--target", "slurm", *flags]) == 0
    script, err = capsys.readouterr()
    train = next(line for line in script.splitlines() if " -m hlat train " in line)
    assert train.split().count("--train.hang_timeout_s") == 1 and f"--train.hang_timeout_s {timeout} " in train
    assert f"# hang watchdog: a rank whose step has not finished in {timeout} s" in script
    assert err.startswith(f"hlat launch: train.hang_timeout_s = {timeout} s in the job: 30 x the planner's predicted")
    assert main(["launch", "--config", "hlat-7b", "--target", "slurm", *TRN2, "--train.hang_timeout_s", "0"]) == 0
    kept_off, err = capsys.readouterr()
    assert "# hang watchdog off (train.hang_timeout_s = 0): a frozen rank holds the job for" in kept_off and not err


def test_slurm_runs_one_torchrun_per_replica_group_and_requeues_a_lost_service(capsys):
    """parallel.replica_groups = 2 on 4 nodes: two torchrun jobs of 2 nodes each (each its own rendezvous at the
    service, its own restarts, its group's index), run together; one that lost the service requeues the job. Refused
    where a group would not be whole nodes, on either target."""
    flags = ["--target", "slurm", "--nodes", "4", "--nproc-per-node", "2", "--parallel.replica_groups", "2"]
    script = render(capsys, *flags, "--train.global_batch", "16", "--train.micro_batch", "2", config="tiny")
    groups = [line for line in script.splitlines() if "hlat torchrun" in line]
    for g, line in enumerate(groups):
        assert line.strip().startswith(f"srun --het-group=1 --nodes=2 --relative={2 * g} hlat torchrun --nnodes=2 ")
        assert f'--rdzv-id="$SLURM_JOB_ID-replica{g}"' in line and line.endswith(
            f"--parallel.replica_group {g} & pids+=($!)"
        )
    # group 1 lost the service (exit code 4) at once: 200 runs, since a group that ended before the script waited
    # for it used to lose its exit code, in about 2% of runs (`jobs -p` no longer listed it)
    for _ in range(200):
        done = run_script_tail(script, "service) return 0;; 1) echo group1; return 4;; 0) echo group0; return 0;;")
        out = done.stdout.splitlines()
        # the groups run in the background: their lines may come at any point
        groups_said = sorted(line for line in out if line.startswith("group"))
        assert done.returncode == 0 and groups_said == ["group0", "group1"], done.stdout + done.stderr
        assert [line for line in out if not line.startswith("group")][-1:] == ["scontrol requeue 7"], done.stdout
    for refused in (["--nodes", "3"], ["--nodes", "3", "--target", "k8s"]):
        assert main(["launch", "--config", "tiny", *flags, *refused]) == 2
        assert "parallel.replica_groups: 2 groups are rendered each on a whole number of" in capsys.readouterr().err


def test_kubernetes_runs_one_pytorchjob_per_replica_group(capsys):
    """parallel.replica_groups = 2 on 4 nodes: one PyTorchJob of 2 pods per group (a failure restarts its own pods),
    each torchrun with a rendezvous of its own at the one service and its group's index; every pod is kept off the
    service's node."""
    flags = ["--target", "k8s", "--nodes", "4", "--nproc-per-node", "2", "--parallel.replica_groups", "2"]
    text = render(capsys, *flags, "--train.global_batch", "16", "--train.micro_batch", "2", config="tiny")
    items = json.loads(text)["items"]
    jobs = [item for item in items if item["kind"] == "PyTorchJob"]
    assert [item["kind"] for item in items].count("Deployment") == 1 and len(jobs) == 2
    away = next(item for item in items if item["kind"] == "Deployment")["spec"]["template"]["spec"]["affinity"]
    (rule,) = away["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    for g, job in enumerate(jobs):
        specs = job["spec"]["pytorchReplicaSpecs"]
        assert job["metadata"]["name"].endswith(f"-replica{g}")
        assert (specs["Master"]["replicas"], specs["Worker"]["replicas"]) == (1, 1)
        for spec in specs.values():
            command = spec["template"]["spec"]["containers"][0]["command"]
            assert "--nnodes=2" in command and command[-2:] == ["--parallel.replica_group", str(g)]
            assert next(a for a in command if a.startswith("--rdzv-id=")).endswith(f"-replica{g}")
            assert rule["labelSelector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
