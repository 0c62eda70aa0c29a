"""The whole job's config: one typed dataclass per section, loaded from TOML plus command-line overrides and
validated before any work starts. The model, data, optimizer, precision and parallel sections are their packages'
own (`hlat/<package>/config.py`); the training run's, evaluation's, cost's, cluster's, health's and tracking's are
here. Torch-free, like the machinery it is built on (`hlat.config`)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hlat import HlatError
from hlat.data.config import DataConfig
from hlat.fields import ConfigError, load_toml, merge_tables, parse_overrides, set_path, to_dict, to_toml, update
from hlat.models.config import ModelConfig, preset_config
from hlat.optim.config import OptimConfig, PrecisionConfig
from hlat.optim.schedule import lr_at
from hlat.parallel.config import ParallelConfig, check_layout, world_size_from_env
from hlat.profiles import HardwareProfile, load_profile
from hlat.resources import config_path

# the shortest train.lease_s: a pause of a live process (a loaded host, a long call holding the GIL) of a second or
# two must not end its lease
LEASE_MIN_S = 3.0


@dataclass
class TrainConfig:
    steps: int = 300  # optimizer steps in the whole run (a resumed run continues up to this)
    global_batch: int = 8  # sequences per optimizer step, across all data-parallel ranks
    micro_batch: int = 8  # sequences per forward/backward; global_batch = micro_batch x grad_accum x dp
    seq_len: int = 256
    log_every: int = 10
    ckpt_every: int = 0  # 0: save only at the end
    keep_checkpoints: int = 2  # older complete checkpoints are deleted; 0 keeps all
    async_checkpoint: bool = False  # training stalls only to copy the state to host memory; written meanwhile
    # the memory tier (docs/fault-tolerance.md): each rank's state every N steps in node-local memory, with a copy
    # on the next node; a failure then costs at most N steps and a reload from memory. -1: every step, or as
    # often as keeps a snapshot's measured cost under 5% of the step time; 0: off
    snapshot_every: int = -1
    snapshot_dir: str = "/dev/shm/hlat"  # node-local memory (a tmpfs) that outlives the trainer, not its node
    run_dir: str = "runs/default"
    resume: str = ""  # "" starts fresh, "auto" continues from the newest good snapshot or checkpoint, or a path
    init_from: str = ""  # start a fresh run from these weights (a checkpoint, e.g. from `hlat import-hf`)
    # a resume that changes the learning-rate schedule (e.g. more train.steps with optim.decay_steps = 0) is
    # refused unless this is set
    allow_schedule_change: bool = False
    seed: int = 0
    device: str = "auto"  # auto (the available accelerator, else cpu) | cpu | an accelerator type: cuda, xpu, neuron...
    peak_flops: float = 0.0  # per device, for MFU; 0 looks the device up in hlat.train.metrics.PEAK_FLOPS
    # fault handling (docs/fault-tolerance.md)
    on_bad_step: Literal["skip", "rollback", "stop"] = "skip"  # a non-finite loss or gradient norm (or a spike)
    max_bad_steps: int = 5  # bad steps in a row after which the run stops (skip, rollback)
    spike_sigmas: float = 0.0  # > 0: a loss this many running deviations above the running mean is a bad step
    hang_timeout_s: float = 0.0  # > 0: no step finished for this long ends the process (stacks in the run dir)
    collective_timeout_s: float = 600.0  # the process group's timeout for one collective
    # a rank that has not renewed its lease in the job's store for this long (a beat a second) is declared lost, and
    # the others end and resume without it instead of waiting out collective_timeout_s; 0: no leases. Between
    # LEASE_MIN_S and collective_timeout_s (docs/fault-tolerance.md, "Leases": how the timeouts must relate)
    lease_s: float = 10.0
    debug_nan_step: int = 0  # > 0: poison this step's gradients with NaN once (tests the bad-step policy)

    def validate(self, model: ModelConfig) -> TrainConfig:
        for name in ("steps", "global_batch", "micro_batch", "seq_len", "log_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}: must be positive, got {getattr(self, name)}")
        for name in (
            "ckpt_every",
            "keep_checkpoints",
            "peak_flops",
            "spike_sigmas",
            "hang_timeout_s",
            "lease_s",
            "debug_nan_step",
        ):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name}: must be >= 0, got {getattr(self, name)}")
        if self.global_batch % self.micro_batch:
            raise ConfigError(
                f"train.global_batch: {self.global_batch} is not a multiple of train.micro_batch {self.micro_batch}"
            )
        if self.seq_len > model.max_seq_len:
            raise ConfigError(f"train.seq_len: {self.seq_len} exceeds model.max_seq_len {model.max_seq_len}")
        if self.snapshot_every < -1:
            raise ConfigError(
                "train.snapshot_every: must be -1 (as often as the snapshots' measured cost allows), 0 "
                f"(off) or a number of steps, got {self.snapshot_every}"
            )
        for name in ("max_bad_steps", "collective_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name}: must be positive, got {getattr(self, name)}")
        if not re.fullmatch(r"[a-z][a-z0-9_]*", self.device):
            raise ConfigError(f"train.device: {self.device!r} is not 'auto', 'cpu' or a device type such as 'cuda'")
        self.check_lease()
        return self

    def check_lease(self) -> None:
        """A lease shorter than LEASE_MIN_S flaps (a beat delayed by a loaded host or a pause of the process declares
        a live rank lost); one as long as the collective timeout is never what finds a silent peer."""
        if self.lease_s and self.lease_s < LEASE_MIN_S:
            raise ConfigError(
                f"train.lease_s: {self.lease_s:g} s would declare live ranks lost whenever a beat is late; use at "
                f"least {LEASE_MIN_S:g} s (10 by default), or 0 for no leases"
            )
        if self.lease_s >= self.collective_timeout_s:
            raise ConfigError(
                f"train.lease_s: {self.lease_s:g} s is not shorter than train.collective_timeout_s "
                f"{self.collective_timeout_s:g} s: a silent peer would hold the others for the whole collective "
                "timeout before its lease ran out; shorten the lease or lengthen the timeout"
            )

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len


@dataclass
class ClusterConfig:
    """Where the job runs, as a recipe states it: `hlat launch` renders job files for it and `hlat plan` prices
    it; the trainer itself takes its world size from torchrun."""

    hardware: str = ""  # a hardware profile (hardware/*.toml, `hlat plan --hardware`); "" = not stated
    nodes: int = 1
    nproc_per_node: int = 8  # processes per node, one per device (GPU, or NeuronCore)
    # the devices job files request for each node; "" = the hardware profile's (gpu without one)
    accelerator: Literal["", "gpu", "neuron", "cpu"] = ""
    # devices to request per node; 0 = from the hardware profile (a GPU per process; the Neuron chips that hold
    # the processes' NeuronCores), or nproc_per_node without one
    devices_per_node: int = 0
    time_limit: str = ""  # SLURM --time, e.g. "7-00:00:00"; "" = the partition's limit
    # seconds between the stop signal and the kill (SLURM: before the time limit; Kubernetes: the termination
    # grace period): the current step and a shutdown checkpoint must fit in it
    stop_grace_s: int = 900
    max_restarts: int = 3  # torchrun restarts all workers this many times after a failure (resuming each time)
    # elastic: after losing nodes the job goes on with as few as this many (torchrun --nnodes MIN:MAX), at a smaller
    # data-parallel size; 0 = cluster.nodes (not elastic). Check that the model fits there: hlat plan --nodes MIN
    min_nodes: int = 0
    # elastic: once min_nodes have joined a rendezvous, how long it waits for more (torchrun's last_call_timeout,
    # 30 s by default): the survivors of a lost node go on this much sooner; a node later than this at the start
    # joins at the job's next restart, which it causes
    last_call_s: int = 5
    # elastic: each node's torchrun tells the rendezvous it is alive this often (torchrun's keep_alive_interval, 5 s
    # by default); a node silent for 3 beats is lost and the survivors go on without it, so shorter beats recover
    # sooner. Each beat of each node is a write to the rendezvous store (on the first node): raise it for many
    # hundreds of nodes
    heartbeat_s: int = 2
    run_volume: str = "hlat-runs"  # Kubernetes: ReadWriteMany PersistentVolumeClaim that holds the run directories
    data_volume: str = (
        "hlat-data"  # Kubernetes: PersistentVolumeClaim of the data, mounted read-only at /data; "" = none
    )
    shm_gib: int = 64  # Kubernetes: memory-backed /dev/shm per pod (data workers, collectives)
    # Kubernetes: CPUs and memory (GiB) each pod requests; 0 = 90% of the hardware profile's node (none without one)
    cpus: int = 0
    memory_gib: int = 0
    preflight: bool = False  # run `hlat preflight` on every node before training starts
    # and again before each restart after a failure (the job file restarts torchrun, up to max_restarts times,
    # rather than torchrun restarting its workers)
    preflight_restarts: bool = False

    def validate(self) -> ClusterConfig:
        if self.preflight_restarts and not self.preflight:
            raise ConfigError(
                "cluster.preflight_restarts: runs the preflight again before a restart; set "
                "cluster.preflight = true too"
            )
        for name in ("nodes", "nproc_per_node", "stop_grace_s", "shm_gib", "last_call_s", "heartbeat_s"):
            if getattr(self, name) < 1:
                raise ConfigError(f"cluster.{name}: must be >= 1, got {getattr(self, name)}")
        if self.min_nodes > self.nodes:
            raise ConfigError(f"cluster.min_nodes: {self.min_nodes} is more than cluster.nodes {self.nodes}")
        for name in ("devices_per_node", "max_restarts", "min_nodes", "cpus", "memory_gib"):
            if getattr(self, name) < 0:
                raise ConfigError(f"cluster.{name}: must be >= 0, got {getattr(self, name)}")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.nproc_per_node

    def node_request(self) -> NodeRequest:
        """What each node's job asks its scheduler for, from the hardware profile when one is stated; a cluster
        that contradicts its profile, or hardware hlat cannot train on, is refused in one line."""
        if not self.hardware:
            devices = 0 if self.accelerator == "cpu" else self.devices_per_node or self.nproc_per_node
            return NodeRequest(self.accelerator or "gpu", devices, "", 0, self.cpus, self.memory_gib)
        try:
            hw = load_profile(self.hardware)
        except HlatError as e:
            raise ConfigError(f"cluster.hardware: {e}") from None
        self.check_against(hw, load_profile(hw.launch_instead) if hw.unsupported else None)
        if hw.accelerator == "cpu":
            devices = 0
        else:  # a GPU per process; Neuron: the chips that hold the processes' cores
            devices = -(-self.nproc_per_node * (hw.scheduler_devices or hw.devices_per_node) // hw.devices_per_node)
        if self.devices_per_node and self.devices_per_node != devices:
            raise ConfigError(
                f"cluster.devices_per_node: {self.devices_per_node}, but {self.nproc_per_node} "
                f"processes on {hw.name} need {devices}; leave it out (0) to follow the hardware"
            )
        return NodeRequest(
            hw.accelerator,
            devices,
            hw.fabric,
            hw.fabric_devices,
            self.cpus or int(0.9 * hw.vcpus),
            self.memory_gib or int(0.9 * hw.host_memory_gib),
        )

    def check_against(self, hw: HardwareProfile, instead: HardwareProfile | None) -> None:
        """The cluster against its hardware profile `hw`; `instead`: the profile to propose when hlat cannot train
        on `hw`."""
        if hw.unsupported:
            nodes = -(-self.world_size // instead.devices_per_node)
            raise ConfigError(
                f"cluster.hardware: {hw.name}: training needs other hardware: {hw.unsupported}; "
                f"`hlat plan` prices this cluster; to launch the same {self.world_size:,} processes use "
                f"--hardware {instead.name} --nodes {nodes}"
            )
        if self.accelerator and self.accelerator != hw.accelerator:
            raise ConfigError(
                f"cluster.accelerator: {self.accelerator!r}, but cluster.hardware {hw.name} has "
                f"{hw.accelerator!r} devices; leave it out (it follows the hardware)"
            )
        if hw.accelerator != "cpu":
            self.check_processes(hw)

    def check_processes(self, hw: HardwareProfile) -> None:
        """No more processes per node than `hw` has devices (one process each); the refusal names the flags that
        would do: the same nodes used whole, or the same processes on more nodes."""
        per_node = hw.devices_per_node
        if self.nproc_per_node <= per_node:
            return
        whole = f"--nproc-per-node {per_node} ({self.nodes:,} nodes, {self.nodes * per_node:,} processes)"
        same = (
            f" or, for the same {self.world_size:,} processes, --nodes {self.world_size // per_node} --nproc-per-node "
            f"{per_node}"
            if self.world_size % per_node == 0
            else ""
        )
        raise ConfigError(
            f"cluster.nproc_per_node: {self.nproc_per_node} processes per node, but {hw.name} has {per_node} "
            f"devices per node (one process each): use {whole}{same}"
        )


@dataclass
class NodeRequest:
    """What a job file asks for on each node (`ClusterConfig.node_request`)."""

    accelerator: str  # gpu | neuron | cpu
    devices: int  # as the scheduler counts them (GPUs, Neuron chips); 0 = none
    fabric: str  # "" | "efa"
    fabric_devices: int  # EFA interfaces
    cpus: int  # 0 = no request
    memory_gib: int


@dataclass
class CostConfig:
    """What the run costs as it runs: a price per device-hour, or a hardware profile's node price."""

    hardware: str = ""  # a hardware profile name (e.g. p5.48xlarge) or TOML file; "" = none
    pricing: Literal["on_demand", "reserved"] = "on_demand"  # which of the profile's prices
    price_per_device_hour: float = 0.0  # USD; overrides the profile's price; 0 = take it from the profile

    def validate(self) -> CostConfig:
        if self.price_per_device_hour < 0:
            raise ConfigError(f"cost.price_per_device_hour: must be >= 0, got {self.price_per_device_hour}")
        if self.hardware and not self.price_per_device_hour:
            try:
                profile = load_profile(self.hardware)
            except HlatError as e:
                raise ConfigError(f"cost.hardware: {e}") from None
            if not profile.price(self.pricing):
                raise ConfigError(
                    f"cost.hardware: profile {profile.name!r} has no {self.pricing} price; set "
                    "cost.price_per_device_hour"
                )
        return self


@dataclass
class EvalConfig:
    """Validation loss during training (and the data `hlat eval` reads by default)."""

    # held-out files, directories or globs (as data.paths); empty = the documents of the training data that
    # `holdout` sets aside
    paths: list[str] = field(default_factory=list)
    # fraction of the training documents set aside by a hash of their text (the training stream skips them,
    # validation reads only them); used when eval.paths is empty
    holdout: float = 0.0
    # named validation sets, "NAME:PATTERN" (a file, directory or glob as data.paths; a name given twice gathers
    # both patterns), each logged as val_NAME_loss, val_NAME_perplexity, val_NAME_tokens; beside the val_loss of
    # eval.paths or eval.holdout, or on their own
    sets: list[str] = field(default_factory=list)
    every: int = 0  # optimizer steps between evaluations (also at the last step); 0 = no validation
    batches: int = 8  # micro-batches (train.micro_batch x train.seq_len tokens) per evaluation, at most
    # a validation loss to keep the best checkpoint by ("val_loss", or "val_NAME_loss" of a set): where it is lowest
    # so far, the run saves checkpoints/best_step_N (apart from rotation; best.json says which); "" = not kept
    keep_best: str = ""

    def validate(self) -> EvalConfig:
        if not 0.0 <= self.holdout <= 0.5:
            raise ConfigError(f"eval.holdout: must be in [0, 0.5], got {self.holdout}")
        for name in ("every", "batches"):
            if getattr(self, name) < 0 or (name == "batches" and self.batches == 0):
                raise ConfigError(
                    f"eval.{name}: must be {'>= 0' if name == 'every' else 'positive'}, got {getattr(self, name)}"
                )
        if self.every and not self.paths and not self.holdout and not self.sets:
            raise ConfigError(
                "eval.every: validation needs held-out data: set eval.paths, eval.sets, or eval.holdout "
                "to the fraction of training documents to set aside (e.g. 0.01)"
            )
        if self.paths and self.holdout:
            raise ConfigError(
                "eval.holdout: set eval.paths (held-out files) or eval.holdout (a split of the training data), not both"
            )
        self.named_sets()
        self.check_keep_best()
        return self

    def named_sets(self) -> dict[str, list[str]]:
        """eval.sets as {name: patterns}, in the order first named."""
        out: dict[str, list[str]] = {}
        for i, entry in enumerate(self.sets):
            name, _, pattern = entry.partition(":")
            if not re.fullmatch(r"[a-z0-9_]+", name) or not pattern:
                raise ConfigError(
                    f"eval.sets[{i}]: {entry!r} is not NAME:PATTERN with a name of lowercase letters, "
                    'digits and _ (e.g. "code:heldout/*.py")'
                )
            out.setdefault(name, []).append(pattern)
        return out

    def check_keep_best(self) -> None:
        if not self.keep_best:
            return
        known = ["val_loss"] * bool(self.paths or self.holdout) + [f"val_{n}_loss" for n in self.named_sets()]
        if self.keep_best not in known:
            raise ConfigError(
                f"eval.keep_best: {self.keep_best!r} is not a validation loss of this run (it has: "
                f"{', '.join(known) or 'none'})"
            )
        if not self.every:
            raise ConfigError("eval.keep_best: needs validation during training (set eval.every)")


@dataclass
class HealthConfig:
    """A rank slower than its peers while the run trains (docs/monitoring.md): each rank's own compute per step (the
    forward of its model blocks, timed apart from the collectives between them) and its wait at the step's
    all-reduce are gathered every train.log_every steps and compared with the other ranks of its pipeline stage."""

    slow_margin: float = 0.25  # a rank whose compute per step exceeds the median of its peers' by this fraction...
    slow_intervals: int = 3  # ...in this many log intervals in a row is named (rank and host); 0 = no check
    debug_delay: str = ""  # "RANK:MS": rank RANK's forward takes MS ms longer each micro-batch (tests the check)

    def validate(self) -> HealthConfig:
        if self.slow_margin <= 0:
            raise ConfigError(f"health.slow_margin: must be positive, got {self.slow_margin}")
        if self.slow_intervals < 0:
            raise ConfigError(f"health.slow_intervals: must be >= 0, got {self.slow_intervals}")
        self.delay()
        return self

    def delay(self) -> tuple[int, float]:
        """(rank, seconds) of health.debug_delay; (-1, 0.0) when unset."""
        if not self.debug_delay:
            return -1, 0.0
        rank, _, ms = self.debug_delay.partition(":")
        try:
            if int(rank) >= 0 and float(ms) >= 0:
                return int(rank), float(ms) / 1e3
        except ValueError:
            pass
        raise ConfigError(f'health.debug_delay: expected RANK:MS (e.g. "2:100"), got {self.debug_delay!r}')


@dataclass
class TrackingConfig:
    """Experiment tracking beside metrics.jsonl and TensorBoard: the same records, sent to Weights & Biases and/or
    MLflow by the main rank (docs/monitoring.md). Both work offline; each needs its optional package."""

    backends: list[str] = field(default_factory=list)  # any of "wandb", "mlflow"; empty = no tracking
    project: str = "hlat"  # the W&B project, and the MLflow experiment
    run_name: str = ""  # "" = the run directory's name
    wandb_mode: Literal["offline", "online"] = "offline"  # offline: files under <run>/wandb (`wandb sync` uploads)
    mlflow_uri: str = ""  # "" = a file store in <run>/mlruns (`mlflow ui --backend-store-uri` it); or a server's URI

    def validate(self) -> TrackingConfig:
        for i, backend in enumerate(self.backends):
            if backend not in ("wandb", "mlflow"):
                raise ConfigError(f"tracking.backends[{i}]: {backend!r} is not one of 'wandb', 'mlflow'")
        if not self.project:
            raise ConfigError("tracking.project: must not be empty")
        return self


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    cost: CostConfig = field(default_factory=CostConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)

    def validate(self) -> Config:
        """Check every section; the parallel layout is checked by `resolved_parallel` once the world size is
        known (a config can be written on one machine for a cluster of another size)."""
        self.model.validate()
        self.data.validate()
        self.optim.validate()
        self.precision.validate()
        if self.model.moe and self.precision.fp8 != "none":
            raise ConfigError(
                "precision.fp8: not supported for mixture-of-experts models (model.n_experts > 0): their experts "
                "are grouped matmuls, not the linear layers FP8 converts"
            )
        self.train.validate(self.model)
        self.eval.validate()
        self.cost.validate()
        self.cluster.validate()
        self.health.validate()
        self.tracking.validate()
        return self

    def resolved_parallel(self, world_size: int | None = None) -> ParallelConfig:
        """The parallel layout with dp_shard filled in, checked against the model and the batch."""
        train = self.train
        p = check_layout(
            self.parallel,
            self.model,
            world_size or world_size_from_env(),
            train.global_batch,
            train.micro_batch,
            train.seq_len,
        )
        for degree in ("pp", "cp"):
            if self.eval.every and getattr(p, degree) > 1:
                raise ConfigError(
                    f"eval.every: validation during training is not supported with parallel.{degree} "
                    "> 1; evaluate checkpoints with `hlat eval` instead"
                )
        return p

    def for_replica_group(self) -> Config:
        """The config this torchrun job trains: under parallel.replica_groups, each replica group keeps its own run
        directory, train.run_dir/replica<g> (its metrics, goodput, snapshots and checkpoints: no group waits for
        another's files, and a restarted group heals from a live one rather than from them)."""
        if not self.parallel.replica_groups:
            return self
        run_dir = str(Path(self.train.run_dir) / f"replica{self.parallel.replica_group}")
        return Config(**{**self.__dict__, "train": TrainConfig(**{**self.train.__dict__, "run_dir": run_dir})})

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step `step` (0-based): optim's warmup, then its cosine decay over
        optim.decay_steps, or over the whole run (train.steps) when that is 0."""
        optim = self.optim
        return lr_at(step, optim.lr, optim.min_lr, optim.warmup_steps, optim.decay_steps or self.train.steps)

    def to_toml(self) -> str:
        return to_toml(to_dict(self))

    def run_record(self, layout: ParallelConfig) -> str:
        """The run directory's config.toml: this config with the layout the run resolved (dp_shard filled in for
        its world size), so that `hlat plan --calibrate` reads back exactly what ran."""
        return Config(**{**self.__dict__, "parallel": layout}).to_toml()


def build_config(data: dict | None = None, overrides: list[str] | None = None) -> Config:
    """A validated Config from a TOML-shaped dict and `--section.key value` overrides.

    `model.preset` is applied first, wherever it was given, so the other model fields override the preset."""
    data = {k: dict(v) if isinstance(v, dict) else v for k, v in (data or {}).items()}
    pairs = parse_overrides(overrides or [])
    preset = dict(pairs).get("model.preset", (data.get("model") or {}).get("preset", ""))
    if not isinstance(preset, str):
        raise ConfigError(f"model.preset: expected a string, got {preset!r}")
    cfg = Config(model=preset_config(preset))
    if isinstance(data.get("model"), dict):
        data["model"].pop("preset", None)
    update(cfg, data)
    for key, value in pairs:
        if key != "model.preset":
            set_path(cfg, key, value)
    return cfg.validate()


def load_config(paths: str | Path | list[str | Path] | None, overrides: list[str] | None = None) -> Config:
    """A validated Config from config files (or recipe names) merged in order, then `--section.key value`
    overrides: a later file sets only the keys it names (e.g. a recipe, then the [parallel] of `hlat plan --emit`)."""
    data: dict = {}
    for path in [paths] if isinstance(paths, (str, Path)) else paths or []:
        data = merge_tables(data, load_toml(config_path(path)))
    return build_config(data, overrides)


def figures_seq_len(given: int | None, configured: int | None, model: ModelConfig) -> tuple[int, str]:
    """The sequence length that `hlat describe` and `hlat plan` figure FLOPs and steps at, and what set it: --seq-len,
    else `configured`, the train.seq_len of a config (what `hlat train` would run it at), else the model's own
    max_seq_len (a bare preset: not train.seq_len's default, 256, sized for a CPU run)."""
    if given:
        return given, "--seq-len"
    if configured:
        return configured, "train.seq_len"
    return model.max_seq_len, "the model's max_seq_len"
