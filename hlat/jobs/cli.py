"""`hlat torchrun` (torchrun, with hlat's exit code after a stop) and `hlat launch` (a multi-node job file)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(commands) -> None:
    commands.add_parser(
        "torchrun",
        help="torchrun (same arguments), exiting 0 when a stop signal found every "
        "trainer checkpointed (torchrun itself exits 1)",
        add_help=False,
    )

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
    p.add_argument("--nodes", type=int, help="number of nodes (default: cluster.nodes)")
    p.add_argument("--nproc-per-node", type=int, help="processes (devices) per node (default: cluster.nproc_per_node)")
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


def run_launch(args: argparse.Namespace, overrides: list[str]) -> int:
    from hlat.config.job import load_config
    from hlat.jobs.launch import render
    from hlat.planner.advice import config_advice

    cluster = [
        *(["--cluster.nodes", str(args.nodes)] if args.nodes is not None else []),
        *(["--cluster.nproc_per_node", str(args.nproc_per_node)] if args.nproc_per_node is not None else []),
        *(["--cluster.hardware", "", "--cluster.accelerator", "cpu"] if args.cpu else []),
    ]
    text = render(args.config, args.target, cluster + overrides, args.image)
    if args.out:
        Path(args.out).write_text(text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    cfg = load_config(args.config, cluster + overrides)
    if line := config_advice(cfg, cfg.cluster.nodes, cfg.cluster.nproc_per_node):
        print(f"hlat launch: {line}", file=sys.stderr)  # the job file stays whole on stdout
    return 0
