"""What `hlat preflight` reports: the `Report` and its rows (their fields are the `--json` keys), the hardware
profile `--out` writes from it, and the tables it prints."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import torch
from rich.table import Table

from hlat.console import make_console
from hlat.profiles import HardwareProfile, Measured, load_profile


@dataclass
class ComputeRow:
    what: str
    shape: str
    seconds: float
    rate: str = ""  # with its unit; empty where the time is the figure


@dataclass
class CollectiveRow:
    op: str
    bytes: int  # per device
    seconds: float
    algbw_gbs: float
    busbw_gbs: float  # as nccl-tests report it


@dataclass
class LinkRow:
    src: int
    dst: int
    hosts: str
    bytes: int
    seconds: float  # the sender's
    gbs: float


@dataclass
class StragglerRow:
    rank: int
    host: str
    compute_s: float
    wait_s: float
    score: float  # how much the rank slows the job: 1 = the median rank


@dataclass
class Report:
    ranks: int
    hosts: list[str]
    device: str
    compute: list[ComputeRow] = field(default_factory=list)  # rank 0's measurements
    collectives: list[CollectiveRow] = field(default_factory=list)
    links: list[LinkRow] = field(default_factory=list)
    overlap: float = -1.0
    memory: dict = field(default_factory=dict)
    stragglers: list[StragglerRow] = field(default_factory=list)
    mismatched: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    measured: Measured = field(default_factory=Measured)
    fp8: str = ""  # one line: which FP8 recipes were measured, or why none was


def rounded(measured: Measured) -> Measured:
    """Four significant digits: more than any measurement here resolves, and a readable profile."""
    return Measured(**{name: _four_digits(value) for name, value in asdict(measured).items()})


def _four_digits(value):
    if isinstance(value, list):
        return [_four_digits(v) for v in value]
    return float(f"{value:.4g}") if isinstance(value, float) else value


def base_profile(name: str | None, device: torch.device) -> HardwareProfile:
    """The profile whose public figures `--out` starts from: `name`, else the closest known one to this device."""
    return load_profile(name or local_profile(device))


def local_profile(device: torch.device) -> str:
    """The shipped hardware profile closest to the device this process runs on."""
    if device.type != "cuda":
        return "cpu"
    gpu = torch.cuda.get_device_name(device)
    return "p5e.48xlarge" if "H200" in gpu else "p5.48xlarge" if "H100" in gpu else "p4d.24xlarge"


def measured_profile(report: Report, base: HardwareProfile, local_ranks: int) -> HardwareProfile:
    """`base` (public figures) with the measurements, for `hlat plan --hardware measured.toml`. On a CPU host
    each process is a device: a node holds the ranks preflight ran there."""
    per_node = local_ranks if report.device.startswith("cpu") else base.devices_per_node
    return replace(
        base,
        name=f"{base.name}-measured",
        measured=report.measured,
        devices_per_node=per_node,
        description=f"{base.description}; measured by hlat preflight",
    )


def report_json(report: Report) -> str:
    return json.dumps(asdict(report), indent=2, default=str)


def show(report: Report) -> None:
    """The report as tables, and a line each for stragglers, numerics and memory."""
    console = make_console()
    console.width = max(console.width, 120)
    console.print(compute_table(report))
    if report.collectives:
        console.print(collectives_table(report.collectives))
        console.print(links_table(report))
    console.print(
        "stragglers (slowdown against the median rank): "
        + ", ".join(f"rank {s.rank} {s.score:.2f}" for s in report.stragglers)
    )
    numerics = f"differ on ranks {report.mismatched}" if report.mismatched else "identical on every rank"
    console.print(f"numerics: {numerics}; memory: {report.memory}")
    console.print(report.fp8)


def compute_table(report: Report) -> Table:
    table = Table(title=f"hlat preflight: {report.ranks} rank(s), {report.device}")
    for column in ("measurement", "shape", "ms", "rate"):
        table.add_column(column, justify="left" if column in ("measurement", "shape") else "right")
    for row in report.compute:
        table.add_row(row.what, row.shape, f"{row.seconds * 1e3:.3g}", row.rate)
    return table


def collectives_table(collectives: list[CollectiveRow]) -> Table:
    table = Table(title="collectives (bus bandwidth as nccl-tests reports it)")
    for column in ("op", "bytes", "ms", "algbw GB/s", "busbw GB/s"):
        table.add_column(column, justify="right")
    for row in collectives:
        table.add_row(
            row.op, f"{row.bytes:,}", f"{row.seconds * 1e3:.3g}", f"{row.algbw_gbs:.3g}", f"{row.busbw_gbs:.3g}"
        )
    return table


def links_table(report: Report) -> Table:
    table = Table(title=f"links (send/recv); overlap of an all-reduce with compute: {report.overlap:.0%}")
    for column in ("pair", "hosts", "bytes", "GB/s"):
        table.add_column(column, justify="right")
    for row in report.links:
        table.add_row(f"{row.src} -> {row.dst}", row.hosts, f"{row.bytes:,}", f"{row.gbs:.3g}")
    return table
