"""`hlat launch`: render a multi-node job for SLURM (sbatch script) or Kubernetes (Kubeflow PyTorchJob) from the
config's `[cluster]` table. The layout is checked against nodes x processes per node before anything is written.

What each node asks for follows the hardware profile of `cluster.hardware` (`ClusterConfig.node_request`): its
devices (a GPU per process, or the Neuron chips that hold the processes' NeuronCores), its fabric's devices and
settings (EFA), and in Kubernetes 90% of its CPUs and memory; a cluster that contradicts its profile is refused.

Both survive restarts the same way: the job's store and rendezvous run as `hlat service` on a host that trains
nothing (SLURM: the first component of a heterogeneous job, a step of its own; Kubernetes: a Deployment behind a
Service), every node runs torchrun (as `hlat torchrun`, which exits 0 after a clean stop) with the service's
rendezvous (`--rdzv-backend=hlat`, its client), `--max-restarts` and `--resume auto`, and the run directory lives on
storage that outlasts the job (the shared file system under SLURM, a PersistentVolumeClaim on Kubernetes). A stop
signal comes `cluster.stop_grace_s` seconds before the job is killed, torchrun passes it to the trainers (waiting
that long, TORCH_ELASTIC_SHUTDOWN_TIMEOUT), and the trainers checkpoint after the current step and exit; SLURM then
requeues the job, which resumes. A job that lost its service exits 4 (hlat.LOST_EXIT): the SLURM script requeues
it, Kubernetes restarts the service's pod (its Deployment) and the training pods (restartPolicy OnFailure).
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import PurePosixPath

from hlat import ERROR_EXIT, LOST_EXIT
from hlat.config.job import ClusterConfig, Config, NodeRequest, load_config
from hlat.fields import ConfigError

SERVICE_PORT = 29500  # where `hlat service` listens for the job's store and rendezvous
SERVICE_BACKEND = "hlat"  # torchrun's --rdzv-backend for a rendezvous at the service (hlat/jobs/service.py)
SERVICE_CPUS = 2  # what the service asks for: a store of small keys, a few requests per rank per second
SERVICE_MEMORY = "2Gi"
K8S_WORKDIR = "/workspace"  # the container's working directory; relative run directories land on the volume
K8S_RUNS = f"{K8S_WORKDIR}/runs"
K8S_CONFIG = "/etc/hlat/config.toml"
K8S_DATA = "/data"  # where cluster.data_volume is mounted (the recipes' data.paths point there)
DEVICE_RESOURCE = {"gpu": "nvidia.com/gpu", "neuron": "aws.amazon.com/neuron"}  # the vendors' device plugins
FABRIC_RESOURCE = {"efa": "vpc.amazonaws.com/efa"}  # the AWS EFA Kubernetes device plugin
# What a node's fabric needs in the environment, and where each setting comes from. EFA is reached through
# libfabric: by NCCL via the aws-ofi-nccl plugin, by Neuron's collectives directly.
FABRIC_ENV = {
    "efa": {
        # libfabric offers its EFA provider only, not its TCP or sockets ones (libfabric fi_efa(7); AWS EFA guides)
        "FI_PROVIDER": "efa",
        # RDMA straight to and from device memory: GPUDirect RDMA on p4d/p5/p5e, Trainium's RDMA on trn (fi_efa(7);
        # AWS "Get started with EFA and NCCL" and AWS Neuron's multi-node training examples)
        "FI_EFA_USE_DEVICE_RDMA": "1",
        # a fork after EFA has registered memory stays safe (fi_efa(7); set by AWS Neuron's multi-node examples)
        "FI_EFA_FORK_SAFE": "1",
    }
}


def _job_name(configs: list[str]) -> str:
    stem = re.sub(r"[^a-z0-9-]+", "-", PurePosixPath(configs[0]).name.removesuffix(".toml").lower()).strip("-")
    return stem if stem.startswith("hlat") else f"hlat-{stem}"


def _env(c: ClusterConfig) -> dict[str, str]:
    # torchrun waits this long for the trainers' shutdown checkpoint before it kills them (default 30 s)
    return {"OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(c.stop_grace_s)}


def _torchrun(c: ClusterConfig, rdzv_id: str, endpoint: str, restarts: int) -> list[str]:
    elastic = bool(c.min_nodes) and c.min_nodes < c.nodes
    nodes = f"{c.min_nodes}:{c.nodes}" if elastic else str(c.nodes)
    return [
        "hlat",
        "torchrun",
        f"--nnodes={nodes}",
        f"--nproc-per-node={c.nproc_per_node}",
        f"--max-restarts={restarts}",
        f"--rdzv-backend={SERVICE_BACKEND}",
        f"--rdzv-id={rdzv_id}",
        f"--rdzv-endpoint={endpoint}",
        *([f"--rdzv-conf={rendezvous_conf(c)}"] if elastic else []),
    ]


def rendezvous_conf(c: ClusterConfig) -> str:
    """An elastic job's rendezvous timings: how long a round waits for more nodes once enough have joined, and how
    often each node's torchrun says it is alive (a node silent for 3 beats is dropped from the next round)."""
    return f"last_call_timeout={c.last_call_s},keep_alive_interval={c.heartbeat_s}"


def fabric_env(node: NodeRequest) -> dict[str, str]:
    return FABRIC_ENV.get(node.fabric, {})


def render_slurm(configs: list[str], cfg: Config, overrides: list[str], node: NodeRequest) -> str:
    c, name = cfg.cluster, _job_name(configs)
    config_args = [arg for path in configs for arg in ("--config", path)]
    train = ["-m", "hlat", "train", *config_args, *overrides, "--resume", "auto"]
    endpoint = f'"$service_node:{SERVICE_PORT}"'
    # every rank of the job, as training will run: devices, links, numerics and stragglers across nodes
    preflight = _torchrun(c, '"$SLURM_JOB_ID-preflight"', endpoint, 0)
    check = f"{TRAINING_STEP} {' '.join(preflight)} {shlex.join(['-m', 'hlat', 'preflight', *config_args, *overrides])}"
    lines = [
        *_slurm_header(c, name, node),
        "set -uo pipefail",
        'service_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST_HET_GROUP_0" | head -n 1)',
        *(f"export {k}={v}" for k, v in _env(c).items()),
        *(
            [f"# {node.fabric.upper()} fabric settings (where each comes from: hlat/jobs/launch.py, FABRIC_ENV)"]
            if node.fabric
            else []
        ),
        *(f"export {k}={v}" for k, v in fabric_env(node).items()),
        f"# world size: {c.nodes} nodes x {c.nproc_per_node} processes = {c.world_size}",
        *(f"# {line}" for line in elastic_range(cfg)),
        f"# {watchdog_text(cfg)}",
        "stop_and_requeue() {  # the time limit is near: the trainers checkpoint and exit, the job queues again",
        '    echo "hlat: time limit in ' + str(c.stop_grace_s) + ' s: checkpointing, then requeueing $SLURM_JOB_ID"',
        '    if [ -n "${train_pid:-}" ]; then  # unset until training starts: nothing to checkpoint yet',
        '        kill -TERM "$train_pid"',
        '        wait "$train_pid"',
        "    fi",
        '    scontrol requeue "$SLURM_JOB_ID"',
        "    exit 0",
        "}",
        "trap stop_and_requeue USR1",
        "# the job's store and rendezvous, a step of its own on the first component's node (this script's)",
        f"srun --het-group=0 hlat service --port {SERVICE_PORT} &",
        *_slurm_training(c, check, train, endpoint, cfg.parallel.replica_groups),
    ]
    return "\n".join(lines) + "\n"


TRAINING_STEP = "srun --het-group=1"
# a job that lost its service ends with LOST_EXIT: queued again, it starts a service and resumes
REQUEUE_LOST = (
    f'[ "$code" -eq {LOST_EXIT} ] && {{ echo "hlat: the job lost its service: requeueing $SLURM_JOB_ID to resume"; '
    'scontrol requeue "$SLURM_JOB_ID"; exit 0; }'
)


def _slurm_header(c: ClusterConfig, name: str, node: NodeRequest) -> list[str]:
    """A heterogeneous job: the service on a node of its own, which runs this script too, and the training nodes."""
    time_limit = [f"#SBATCH --time={c.time_limit}"] if c.time_limit else []
    return [
        "#!/bin/bash",
        f"#SBATCH --job-name={name}",
        "# component 0: hlat service, the job's store and rendezvous, on a node that trains nothing",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        f"#SBATCH --cpus-per-task={SERVICE_CPUS}",
        *time_limit,
        f"#SBATCH --signal=B:USR1@{c.stop_grace_s}",  # to this script, stop_grace_s before the time limit
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={name}-%j.out",
        "#SBATCH hetjob",
        f"# component 1: the {c.nodes} training nodes",
        f"#SBATCH --nodes={c.nodes}",
        "#SBATCH --ntasks-per-node=1",
        *([f"#SBATCH --gpus-per-node={node.devices}"] if node.accelerator == "gpu" else []),
        "#SBATCH --exclusive",
        *time_limit,
    ]


def _slurm_training(c: ClusterConfig, preflight: str, train: list[str], endpoint: str, groups: int) -> list[str]:
    """The preflight (cluster.preflight), then training in the background, for the stop handler to signal. With
    cluster.preflight_restarts the script itself starts torchrun (which then restarts nothing) up to
    1 + max_restarts times, with the preflight before each start. Under parallel.replica_groups, one torchrun per
    group (`_slurm_replica_groups`). A job that lost its service is requeued."""
    if not c.preflight_restarts:
        torchrun = _torchrun(c, '"$SLURM_JOB_ID"', endpoint, c.max_restarts)
        return [
            *([f"{preflight} || exit 1"] if c.preflight else []),
            *(
                _slurm_replica_groups(c, train, endpoint, groups)
                if groups
                else [f"{TRAINING_STEP} {' '.join(torchrun)} {shlex.join(train)} &"]
            ),
            "train_pid=$!",
            'wait "$train_pid"; code=$?',
            REQUEUE_LOST,
            'exit "$code"',
        ]
    torchrun = _torchrun(c, '"$SLURM_JOB_ID-$attempt"', endpoint, 0)
    return [
        f"for attempt in $(seq 0 {c.max_restarts}); do  # the preflight before each start",
        f"    {preflight}; code=$?",
        f"    {REQUEUE_LOST}",
        '    [ "$code" -ne 0 ] && exit 1',
        f"    {TRAINING_STEP} {' '.join(torchrun)} {shlex.join(train)} &",
        "    train_pid=$!",
        '    wait "$train_pid"; code=$?',
        '    [ "$code" -eq 0 ] && exit 0',
        f"    {REQUEUE_LOST}",
        f'    [ "$code" -eq {ERROR_EXIT} ] && {{ echo "hlat: training failed with an hlat error (exit code '
        f'{ERROR_EXIT}): not restarted"; exit {ERROR_EXIT}; }}  # a full disk, a bad config: the same start would '
        "fail the same way",
        f'    echo "hlat: training failed (start $((attempt + 1)) of {c.max_restarts + 1}): preflight, then resume"',
        "done",
        "exit 1",
    ]


def _slurm_replica_groups(c: ClusterConfig, train: list[str], endpoint: str, groups: int) -> list[str]:
    """One torchrun per replica group (parallel.replica_groups), each on its share of the training nodes with a
    rendezvous of its own at the service, restarting only its own workers; a function run in the background, which
    passes the stop signal on to every group and returns the last failure's exit code."""
    nodes = c.nodes // groups
    group = ClusterConfig(**{**c.__dict__, "nodes": nodes})
    steps = []
    for g in range(groups):
        torchrun = _torchrun(group, f'"$SLURM_JOB_ID-replica{g}"', endpoint, c.max_restarts)
        steps.append(
            f"    {TRAINING_STEP} --nodes={nodes} --relative={g * nodes} {' '.join(torchrun)} "
            f"{shlex.join([*train, '--parallel.replica_group', str(g)])} & pids+=($!)"
        )
    # each group's pid kept as it starts: `jobs -p` omits a job that already ended, and its exit code with it
    return [
        f"train_replica_groups() {{  # {groups} replica groups of {nodes} nodes: a failure restarts its group alone",
        "    pids=()",
        """    trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM""",
        *steps,
        "    code=0",
        '    for pid in "${pids[@]}"; do wait "$pid" || code=$?; done',
        '    return "$code"',
        "}",
        "train_replica_groups &",
    ]


def render_k8s(configs: list[str], cfg: Config, image: str, node: NodeRequest) -> str:
    """A ConfigMap with the resolved config, the service (a Deployment of `hlat service`, kept off the training pods'
    nodes, behind a Service that names it) and a Kubeflow PyTorchJob that trains at it (one per replica group under
    parallel.replica_groups); run directories live on the `cluster.run_volume` claim."""
    c, name = cfg.cluster, _job_name(configs)
    run_dir = PurePosixPath(K8S_WORKDIR, cfg.train.run_dir)  # an absolute run_dir stays as it is
    if not run_dir.is_relative_to(K8S_RUNS):
        raise ConfigError(
            f"train.run_dir: {cfg.train.run_dir} is outside the volume mounted at {K8S_RUNS}: a "
            f"restarted pod would not find its checkpoints; use a relative path such as runs/{name}"
        )
    config_map = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": f"{name}-config"},
        "data": {PurePosixPath(K8S_CONFIG).name: cfg.to_toml()},
    }
    groups = cfg.parallel.replica_groups
    if groups:  # one PyTorchJob per replica group, on its share of the nodes: a failure restarts its group's pods alone
        share = ClusterConfig(**{**c.__dict__, "nodes": c.nodes // groups})
        jobs = [_pytorch_job(share, name, k8s_pod(share, name, image, node, g), g) for g in range(groups)]
    else:
        jobs = [_pytorch_job(c, name, k8s_pod(c, name, image, node))]
    items = [config_map, *k8s_service(name, image), *jobs]
    # JSON is valid YAML and needs no YAML library; a List applies every object with one `kubectl apply -f`
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": items}, indent=2) + "\n"


def _pytorch_job(c: ClusterConfig, name: str, pod: dict, group: int | None = None) -> dict:
    """The PyTorchJob of the job's `c.nodes` training pods (of replica group `group`, where given)."""
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": group_name(name, group)},
        "spec": {
            "nprocPerNode": str(c.nproc_per_node),
            "runPolicy": {"backoffLimit": c.max_restarts},
            "pytorchReplicaSpecs": {
                "Master": _replica(pod, 1, name),
                **({"Worker": _replica(pod, c.nodes - 1, name)} if c.nodes > 1 else {}),
            },
        },
    }


def _replica(pod: dict, count: int, name: str) -> dict:
    template = {"metadata": {"labels": {"hlat/trains": name}}, "spec": pod}
    return {"replicas": count, "restartPolicy": "OnFailure", "template": template}


def k8s_service(name: str, image: str) -> list[dict]:
    """`hlat service` as a Deployment of one pod (restarted wherever it is lost) on a node without the job's
    training pods (so that losing a training node never loses it too), and a Service that gives it a stable name."""
    labels = {"hlat/service": name}
    away = {"labelSelector": {"matchLabels": {"hlat/trains": name}}, "topologyKey": "kubernetes.io/hostname"}
    container = {
        "name": "service",
        "image": image,
        "command": ["hlat", "service", "--port", str(SERVICE_PORT)],
        "ports": [{"containerPort": SERVICE_PORT}],
        "resources": {"requests": {"cpu": str(SERVICE_CPUS), "memory": SERVICE_MEMORY}},
    }
    pod = {"affinity": {"podAntiAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [away]}}}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": service_name(name)},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {**pod, "containers": [container]}},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": service_name(name)},
        "spec": {"selector": labels, "ports": [{"port": SERVICE_PORT, "targetPort": SERVICE_PORT}]},
    }
    return [deployment, service]


def group_name(name: str, group: int | None) -> str:
    """Replica group `group`'s PyTorchJob and rendezvous id (the job's own name where there are no groups)."""
    return name if group is None else f"{name}-replica{group}"


def service_name(name: str) -> str:
    return f"{name}-service"


def k8s_pod(c: ClusterConfig, name: str, image: str, node: NodeRequest, group: int | None = None) -> dict:
    """The pod of each node (of replica group `group`, where given: a rendezvous of its own): torchrun (after
    preflight, if asked) at the service, what the node asks for, the volumes."""
    endpoint = f"{service_name(name)}:{SERVICE_PORT}"
    rdzv_id = group_name(name, group)
    # with cluster.preflight_restarts the pods restart (runPolicy.backoffLimit), each start after its preflight
    restarts = 0 if c.preflight_restarts else c.max_restarts
    command = [
        *_torchrun(c, rdzv_id, endpoint, restarts),
        *("-m", "hlat", "train", "--config", K8S_CONFIG, "--resume", "auto"),
        *(() if group is None else ("--parallel.replica_group", str(group))),
    ]
    if c.preflight:  # exec: the training torchrun stays PID 1 and receives the pod's SIGTERM
        preflight = [
            *_torchrun(c, f"{rdzv_id}-preflight", endpoint, 0),
            "-m",
            "hlat",
            "preflight",
            "--config",
            K8S_CONFIG,
        ]
        command = ["bash", "-c", f"{shlex.join(preflight)} && exec {shlex.join(command)}"]
    data = bool(c.data_volume)
    container = {
        "name": "pytorch",
        "image": image,
        "workingDir": K8S_WORKDIR,
        "command": command,
        "env": [{"name": k, "value": v} for k, v in (_env(c) | fabric_env(node)).items()],
        "resources": k8s_resources(node),
        "volumeMounts": [
            {"name": "runs", "mountPath": K8S_RUNS},
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "config", "mountPath": str(PurePosixPath(K8S_CONFIG).parent), "readOnly": True},
        ]
        + [{"name": "data", "mountPath": K8S_DATA, "readOnly": True}] * data,
    }
    return {
        "terminationGracePeriodSeconds": c.stop_grace_s,
        "containers": [container],
        "volumes": [
            {"name": "runs", "persistentVolumeClaim": {"claimName": c.run_volume}},
            {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": f"{c.shm_gib}Gi"}},
            {"name": "config", "configMap": {"name": f"{name}-config"}},
        ]
        + [{"name": "data", "persistentVolumeClaim": {"claimName": c.data_volume, "readOnly": True}}] * data,
    }


def k8s_resources(node: NodeRequest) -> dict:
    """A pod's devices and fabric devices (limits: extended resources are requested as limited) and its CPUs and
    memory (requests: what the scheduler reserves on the node; no limits, which would throttle data workers)."""
    limits = {
        **({DEVICE_RESOURCE[node.accelerator]: node.devices} if node.devices else {}),
        **({FABRIC_RESOURCE[node.fabric]: node.fabric_devices} if node.fabric else {}),
    }
    requests = {
        **({"cpu": str(node.cpus)} if node.cpus else {}),
        **({"memory": f"{node.memory_gib}Gi"} if node.memory_gib else {}),
    }
    return {**({"limits": limits} if limits else {}), **({"requests": requests} if requests else {})}


def elastic_range(cfg: Config) -> list[str]:
    """What an elastic job (cluster.min_nodes) goes on with after losing nodes: the node counts from min_nodes up
    whose world the layout fits, and those it does not (torchrun may form them; the trainers then refuse in one
    line and the job restarts). Refused when the layout does not fit min_nodes itself."""
    c = cfg.cluster
    if not c.min_nodes or c.min_nodes >= c.nodes:
        return []
    fits, not_fits = [], []
    for n in range(c.min_nodes, c.nodes + 1):
        try:
            cfg.resolved_parallel(n * c.nproc_per_node)
            fits.append(n)
        except ConfigError as e:
            if n == c.min_nodes:
                raise ConfigError(f"cluster.min_nodes: {n} nodes do not fit the layout: {e}") from None
            not_fits.append(n)
    return [
        f"elastic: after a lost node the job goes on with {_either(fits)} nodes, at a smaller data-parallel "
        "size, from the newest snapshot (docs/fault-tolerance.md)"
    ] + (
        [f"with {_either(not_fits)} nodes the layout does not fit: the trainers refuse in one line"] if not_fits else []
    )


def watchdog_text(cfg: Config) -> str:
    """What a frozen rank costs the job under its hang watchdog (docs/fault-tolerance.md, "Timeouts")."""
    hang, collective = cfg.train.hang_timeout_s, cfg.train.collective_timeout_s
    if hang:
        return f"hang watchdog: a rank whose step has not finished in {hang:g} s is named and the job restarts"
    return (
        f"hang watchdog off (train.hang_timeout_s = 0): a frozen rank holds the job for the collective timeout "
        f"({collective:g} s) and then torchrun's shutdown wait ({cfg.cluster.stop_grace_s:g} s)"
    )


def _either(counts: list[int]) -> str:
    return " or ".join([", ".join(map(str, counts[:-1])), str(counts[-1])] if len(counts) > 1 else [str(counts[0])])


def render(configs: list[str], target: str, overrides: list[str], image: str) -> str:
    """The job file for `target`, after checking the configs (merged in order), the layout on the `[cluster]`
    they state and that cluster against its hardware profile."""
    cfg = load_config(configs, overrides)
    groups = cfg.parallel.replica_groups
    if groups and (cfg.cluster.nodes % groups or cfg.cluster.min_nodes or cfg.cluster.preflight_restarts):
        raise ConfigError(
            f"parallel.replica_groups: {groups} groups are rendered each on a whole number of the "
            f"{cfg.cluster.nodes} nodes, without cluster.min_nodes or cluster.preflight_restarts (each group restarts "
            "its own workers)"
        )
    cfg.resolved_parallel(cfg.cluster.world_size // (groups or 1))  # a replica group's layout: its own job's
    elastic_range(cfg)  # refuses a min_nodes the layout does not fit
    node = cfg.cluster.node_request()
    if target == "slurm":
        return render_slurm(configs, cfg, overrides, node)
    return render_k8s(configs, cfg, image, node)
