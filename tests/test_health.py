"""Health while training: a rank slowed by `health.debug_delay` in a 4-rank CPU job is named, with its host, in
the log and in metrics.jsonl while training goes on; when a rank counts as slow."""

import json
import os
import socket

from rich.console import Console

from hlat.config.job import HealthConfig, build_config
from hlat.train.health import SlowRanks

CORPUS = os.path.join(os.path.dirname(json.__file__), "*.py")
TINY = {"preset": "tiny", "dim": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_dim": 128, "vocab_size": 512}
DELAY_S = 0.2


def test_a_slowed_rank_is_named_while_training_goes_on(tmp_path, warm_torchrun):
    """Rank 2's forward takes 200 ms longer each step (one micro-batch per rank); the other ranks wait for it in
    FSDP's gathers, which their own compute leaves out, so it stands out by far more than the margin (2x). The
    healthy ranks' forwards take about a millisecond, so on a loaded machine a descheduled one may be named too
    (it was slow): what holds whatever the load, up to scheduling delays as long as the debug delay, is that rank
    2 is named and stays the slowest."""
    cfg = build_config(
        {
            "model": TINY,
            "data": {"paths": [CORPUS]},
            "train": {
                "steps": 6,
                "global_batch": 4,
                "micro_batch": 1,
                "seq_len": 32,
                "log_every": 1,
                "run_dir": str(tmp_path / "run"),
            },
            "health": {"debug_delay": f"2:{DELAY_S * 1e3:g}", "slow_intervals": 2, "slow_margin": 1.0},
        }
    )
    config = tmp_path / "c.toml"
    config.write_text(cfg.to_toml())
    done = warm_torchrun.run(4, ["train", "--config", str(config)])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    host = socket.gethostname()
    assert f"health: rank 2 ({host}) is slow: its forward takes " in done.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]  # training went on to the end
    assert all(r["slowest_rank"] == 2 and r["rank_compute_max_s"] >= DELAY_S for r in records)
    assert "slow_ranks" not in records[0]  # one interval is not yet persistent
    for r in records[1:]:
        (named,) = [n for n in r["slow_ranks"] if n["rank"] == 2]
        assert (named["rank"], named["host"]) == (2, host) and named["ratio"] > 2
        assert named["compute_s"] >= DELAY_S and r["rank_compute_s"] < named["compute_s"] / 2


def test_a_rank_is_named_when_slow_for_the_set_intervals_in_a_row():
    console = Console(record=True, width=300)
    slow = SlowRanks(HealthConfig(slow_margin=0.5, slow_intervals=2), ["a", "b", "c", "d"], console)
    stage0, wait = [0, 0, 0, 0], [0.1, 0.2, 0.0, 0.3]
    lagging, even = [1.0, 1.0, 2.0, 1.0], [1.0, 1.1, 0.9, 1.0]
    first = slow.update(lagging, wait, stage0)
    assert "slow_ranks" not in first and (first["slowest_rank"], first["slowest_rank_ratio"]) == (2, 2.0)
    assert first["rank_compute_s"] == 1.0 and first["collective_wait_max_s"] == 0.3
    assert "slow_ranks" not in slow.update(even, wait, stage0)  # not in a row: counted afresh
    slow.update(lagging, wait, stage0)
    named = slow.update(lagging, wait, stage0)["slow_ranks"]
    assert named == [{"rank": 2, "host": "c", "ratio": 2.0, "compute_s": 2.0, "wait_s": 0.0}]
    assert "slow_ranks" not in slow.update(even, wait, stage0)
    log = console.export_text()
    assert "health: rank 2 (c) is slow: its forward takes 2 s per step, 2.00x the median of its peers" in log
    assert "health: rank 2 (c) is back within 50% of its peers" in log
    # pipeline stages do different work: each rank is compared with its own stage's ranks only
    staged = SlowRanks(HealthConfig(slow_margin=0.5, slow_intervals=1), ["a", "b", "c", "d"], console)
    assert "slow_ranks" not in staged.update([1.0, 1.0, 3.0, 3.0], wait, [0, 0, 1, 1])
    assert staged.update([1.0, 1.0, 3.0, 6.0], wait, [0, 0, 1, 1])["slow_ranks"][0]["rank"] == 3
