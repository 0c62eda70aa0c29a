"""Running a job: `hlat train` (alone, under torchrun, or supervised with --max-restarts), `hlat torchrun` (torchrun,
with hlat's exit code after a stop), `hlat service` (a multi-node job's store and rendezvous, on a host that trains
nothing) and `hlat launch` (a multi-node job file)."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from hlat import HlatError
from hlat.config.cli import add_cluster_arguments, cluster_overrides
from hlat.config.job import TrainConfig
from hlat.fields import OVERRIDES_HELP
from hlat.jobs.launch import SERVICE_PORT


def register(commands) -> None:
    register_train(commands)
    register_torchrun(commands)
    register_service(commands)
    register_launch(commands)
    register_snapshots(commands)


def register_train(commands) -> None:
    p = commands.add_parser(
        "train", help="train a model from a config", description=f"Train from a TOML config. {OVERRIDES_HELP}"
    )
    add_train_arguments(p)
    p.set_defaults(func=run_train, overrides=True)


def register_torchrun(commands) -> None:
    commands.add_parser(
        "torchrun",
        help="torchrun (same arguments), exiting 0 when a stop signal found every "
        "trainer checkpointed (torchrun itself exits 1)",
        add_help=False,
    )


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config",
        action="append",
        help="TOML config file or recipe name (default: the built-in "
        "defaults); repeat it to lay later files over earlier ones",
    )
    p.add_argument("--resume", help="'auto' (latest complete checkpoint of the run dir, if any) or a checkpoint path")
    p.add_argument("--print-config", action="store_true", help="print the resolved config, every field, and exit")
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="N",
        help="supervise the job: start it again (with --resume auto) after up to N failures",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=1,
        metavar="K",
        help="with --max-restarts: run a single-node torchrun job of K processes",
    )


def register_launch(commands) -> None:
    p = commands.add_parser(
        "launch",
        help="render a multi-node SLURM script or Kubernetes PyTorchJob for a config",
        description="Render a multi-node job for the config's [cluster] table (time limit, stop "
        "signal, restarts, volumes: see hlat/config/job.py ClusterConfig); config "
        "overrides (--section.key value) are passed on.",
    )
    p.add_argument(
        "--config", action="append", required=True, help="TOML config file or recipe name (repeatable, merged in order)"
    )
    add_cluster_arguments(p)
    p.add_argument("--target", choices=["slurm", "k8s"], required=True)
    p.add_argument("--image", default="hlat:latest", help="container image for k8s")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="plain CPU nodes: no hardware profile, no devices, no fabric "
        "(cluster.hardware = '', cluster.accelerator = cpu)",
    )
    p.add_argument("--out", help="file to write (default: print)")
    p.set_defaults(func=run_launch, overrides=True)


def register_snapshots(commands) -> None:
    p = commands.add_parser(
        "snapshots",
        help="list the memory tier's snapshots on this node; --clear removes those of runs no live job writes",
        description="The memory tier's snapshots outlive a killed run (in node-local memory, /dev/shm by default) "
        "until the node reboots. List them, with whether a live job still writes their run directory; --clear "
        "removes those of runs that are finished or given up (a running run's are kept).",
    )
    p.add_argument("runs", nargs="*", metavar="RUN_DIR", help="only these run directories (default: every run)")
    p.add_argument("--snapshot-dir", default=TrainConfig.snapshot_dir, help="train.snapshot_dir (default %(default)s)")
    p.add_argument("--clear", action="store_true", help="remove the snapshots of the runs no live job writes")
    p.set_defaults(func=run_snapshots, overrides=False)


def run_torchrun(argv: list[str]) -> int:
    """`hlat torchrun`: an `hlat train` job's config and layout are checked before any process starts, so that a
    mistake is one line, as from `hlat train` alone, not the trainers' line inside torchrun's report."""
    from hlat.jobs.torchrun import torchrun

    return torchrun(argv, check_training, held_state)


def fixed_world_size(args) -> int | None:
    """The processes a torchrun command line starts (nodes x processes per node), or None when that is not fixed
    here: an elastic node range, or a count torchrun takes from the devices it finds."""
    nodes = args.nnodes.split(":")
    if len(set(nodes)) != 1 or not (nodes[0].isdigit() and args.nproc_per_node.isdigit()):
        return None
    return int(nodes[0]) * int(args.nproc_per_node)


def check_training(args) -> None:
    """An `hlat train` job's config and layout at the world size torchrun will start, before it starts a process
    (an elastic job's trainers check each world size the rendezvous forms)."""
    world = fixed_world_size(args)
    if not (args.module and args.training_script == "hlat" and args.training_script_args[:1] == ["train"] and world):
        return
    train_config(args.training_script_args[1:]).resolved_parallel(world)


def held_state(args) -> str:
    """What this node holds of an `hlat train` job's state, for the line of a lost rendezvous host: the newest memory
    snapshot whose every rank's files are here, verified, and the newest checkpoint of the run directory."""
    from hlat.checkpoint.memory_restore import holdings, newest_complete
    from hlat.paths import TOKEN_FILE, checkpoint_root, latest_checkpoint, snapshot_root, step_name

    if not (args.module and args.training_script == "hlat" and args.training_script_args[:1] == ["train"]):
        return "what this node holds is the training script's to say"
    try:
        settings = train_config(args.training_script_args[1:]).train
    except HlatError as e:  # the job's config no longer reads here: the line still names the lost host
        return f"what this node holds is unknown (its config: {e})"
    try:
        token = (checkpoint_root(settings.run_dir) / TOKEN_FILE).read_text().strip()
    except OSError:
        token = None
    root = snapshot_root(settings.snapshot_dir, settings.run_dir)
    step = newest_complete([holdings(root, token)]) if token and settings.snapshot_every else None
    snapshot = f"the snapshot of step {step} ({root / step_name(step)})" if step is not None else "no whole snapshot"
    return f"this node holds {snapshot} whole; newest checkpoint: {latest_checkpoint(settings.run_dir) or 'none'}"


def train_config(argv: list[str]):
    """The config `hlat train ARGV` would run (its `--config` files and `--section.key` overrides)."""
    from hlat.config.job import load_config

    parser = argparse.ArgumentParser(prog="hlat train", add_help=False)
    add_train_arguments(parser)
    args, overrides = parser.parse_known_args(argv)
    return load_config(args.config, overrides)


def register_service(commands) -> None:
    p = commands.add_parser(
        "service",
        help="host a multi-node job's store and rendezvous on a host that trains nothing "
        "(training hosts run hlat torchrun --rdzv-backend=hlat --rdzv-endpoint=HOST:PORT)",
    )
    p.add_argument("--port", type=int, default=SERVICE_PORT, help=f"the port to listen on (default: {SERVICE_PORT})")
    p.set_defaults(func=run_service, overrides=False)


def run_service(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.jobs.service import serve

    return serve(args.port)


def run_launch(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.config.job import load_config
    from hlat.jobs.launch import render
    from hlat.planner.advice import WATCHDOG_STEPS, config_advice, watchdog

    if args.cpu and args.hardware:
        raise HlatError(f"--cpu: plain CPU nodes have no hardware profile; leave out --hardware {args.hardware}")
    cluster = cluster_overrides(args) + (["--cluster.hardware", "", "--cluster.accelerator", "cpu"] if args.cpu else [])
    cfg = load_config(args.config, cluster + overrides)
    notes = [config_advice(cfg, cfg.cluster.nodes, cfg.cluster.nproc_per_node)]
    off = cfg.train.hang_timeout_s == 0 and not any(o.startswith("--train.hang_timeout_s") for o in overrides)
    if off and (found := watchdog(cfg)):  # a frozen rank named in minutes, not in 10 + 15 (docs/fault-tolerance.md)
        overrides = [*overrides, "--train.hang_timeout_s", f"{found[0]:g}"]
        notes.append(
            f"train.hang_timeout_s = {found[0]:g} s in the job: {WATCHDOG_STEPS} x the planner's predicted "
            f"{found[1]:.3g} s step on {cfg.cluster.nodes} x {cfg.cluster.hardware}, rounded up to whole minutes "
            "(the config leaves the hang watchdog off; set train.hang_timeout_s to choose another, 0 to keep it off)"
        )
    text = render(args.config, args.target, cluster + overrides, args.image)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    for line in filter(None, notes):
        print(f"hlat launch: {line}", file=sys.stderr)  # the job file stays whole on stdout
    return 0


def run_train(args: argparse.Namespace, overrides: list[str]) -> int:
    if args.max_restarts:  # the supervisor only starts processes: no torch in it
        return run_supervised(args, overrides)
    from hlat.config.job import load_config
    from hlat.console import make_console
    from hlat.jobs.torchrun import mark_finished
    from hlat.jobs.writer import writing_run_dir
    from hlat.train.loop import train

    if args.nproc_per_node != 1:
        raise HlatError("--nproc-per-node goes with --max-restarts (otherwise launch with torchrun)")
    if args.resume is not None:
        overrides = overrides + ["--train.resume", args.resume]
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(cfg.to_toml(), end="")
        return 0
    cfg = cfg.for_replica_group()
    console = make_console()
    if (rank := os.environ.get("RANK", "0")) == "0" and (line := seen_cluster_advice(cfg)):
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    # before anything is written there: one job per run directory
    with writing_run_dir(cfg.train.run_dir, fenced=cfg.train.lease_s > 0), lost_peer_in_one_line(rank):
        s = train(cfg, console)
    mark_finished()
    if rank == "0":  # under torchrun, rank 0 speaks for the job
        print_summary(console, s)
    return 0


# what a collective says when a peer is gone: gloo's transport (a plain RuntimeError from its work's wait), NCCL's
# abort, torch's own distributed errors
_PEER_GONE = ("gloo/transport", "Connection reset by peer", "Connection closed by peer", "communicator was aborted")


@contextlib.contextmanager
def lost_peer_in_one_line(rank: str):
    """A collective that failed (a peer killed, its host lost) ends this rank in one line, not a traceback of torch's
    internals, with exit code 1: a failure the job's restart resumes from (its moment is recorded for goodput)."""
    from torch.distributed import DistError

    try:
        yield
    except (DistError, RuntimeError) as e:
        if not isinstance(e, DistError) and not any(sign in str(e) for sign in _PEER_GONE):
            raise
        cause = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        print(
            f"hlat: error: rank {rank}: a collective failed ({cause[:200]}): a peer is lost or unreachable; the "
            "job resumes from its newest snapshot or checkpoint when it restarts",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None


def print_summary(console, s) -> None:
    """The run summary's table (`hlat.train.loop.Summary`)."""
    from rich.table import Table

    table = Table(title="run summary", show_header=False)
    for name, value in (
        ("run directory", s.run_dir),
        ("steps", f"{s.steps:,}"),
        ("tokens seen", f"{s.tokens_seen:,}"),
        ("tokens/s", f"{s.tokens_per_s:,.0f}"),
        ("first loss", f"{s.first_loss:.4f}"),
        ("last loss", f"{s.last_loss:.4f}"),
        ("checkpoint", s.checkpoint),
        ("bad steps skipped", f"{s.bad_steps:,}"),
        ("goodput (ETTR)", f"{s.ettr:.1%} of the wall time since the run began (goodput.json)"),
        ("failures", failures_text(s.recovery)),
        ("memory tier", snapshots_text(s.snapshots)),
    ):
        table.add_row(name, value)
    console.print(table)


def failures_text(total: dict | None) -> str:
    """The run's failures in one cell: how many, and their parts in total (hlat.train.recovery)."""
    if not total or not total["failures"]:
        return "none"
    unseen = total["not_observed"]
    split = f"detection {total['detection_s']:.1f} s + restart {total['restart_s']:.1f} s" + (
        f" where observed ({unseen} not)" if unseen else ""
    )
    return (
        f"{total['failures']}: downtime {total['downtime_s']:.1f} s ({split}), state load {total['load_s']:.1f} s, "
        f"{total['recomputed_steps']} steps recomputed ({total['recomputed_s']:.1f} s)"
    )


def snapshots_text(figures: dict | None) -> str:
    """The memory tier in one cell: its interval and what its newest snapshot cost (hlat.checkpoint.cadence)."""
    if figures is None:
        return "off"
    every = f"a snapshot every {figures['snapshot_every']} step{'s' * (figures['snapshot_every'] != 1)}"
    if "snapshot_cost_s" not in figures:
        return every
    return (
        f"{every}; the last cost {figures['snapshot_cost_s'] * 1e3:.0f} ms (stall "
        f"{figures['snapshot_stall_s'] * 1e3:.0f} + slowdown {figures['snapshot_slowdown_s'] * 1e3:.0f} + settle "
        f"{figures['snapshot_settle_s'] * 1e3:.0f}), {figures['snapshot_share']:.1%} of the steps' time"
    )


def seen_cluster_advice(cfg) -> str | None:
    """The planner's line on the layout (a tensor-parallel group across nodes, needlessly slow links:
    hlat.planner.advice) on the cluster torchrun started this job on: WORLD_SIZE processes, LOCAL_WORLD_SIZE of them
    on each node, of the config's cluster.hardware."""
    from hlat.planner.advice import config_advice

    world = int(os.environ.get("WORLD_SIZE", "1"))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return config_advice(cfg, world // per_node, per_node) if world > 1 else None


def run_supervised(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.config.job import load_config
    from hlat.jobs.supervise import supervise

    if args.max_restarts < 0 or args.nproc_per_node < 1:
        raise HlatError(
            f"--max-restarts must be >= 0 and --nproc-per-node >= 1, got {args.max_restarts} and {args.nproc_per_node}"
        )
    if args.resume not in (None, "auto"):
        raise HlatError(f"--resume {args.resume}: a supervised job always resumes with --resume auto")
    cfg = load_config(args.config, overrides)  # a bad config fails here, once, not on every restart
    train_args = [a for config in args.config or [] for a in ("--config", config)] + overrides
    return supervise(train_args, Path(cfg.train.run_dir), args.max_restarts, args.nproc_per_node)


def run_snapshots(args: argparse.Namespace, overrides: list[str]) -> int:
    """List (and with --clear remove) the memory tier's snapshots on this node, run by run."""
    import shutil

    from hlat.checkpoint.memory import kept_snapshots

    wanted = {str(Path(r).resolve()) for r in args.runs}
    kept = [k for k in kept_snapshots(args.snapshot_dir) if not wanted or k.run_dir in wanted]
    if wanted - {k.run_dir for k in kept}:
        raise HlatError(
            f"no snapshots in {args.snapshot_dir} of {', '.join(sorted(wanted - {k.run_dir for k in kept}))}"
        )
    for k in kept:
        cleared = args.clear and k.holder is None
        if cleared:
            shutil.rmtree(k.root, ignore_errors=True)
        print(f"{'cleared ' if cleared else ''}{k.text()}")
    if not kept:
        print(f"no snapshots in {args.snapshot_dir}")
    return 0
