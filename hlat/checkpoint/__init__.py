"""A run's saved state, in one place: the state as one object (`state.py`: `TrainState`); the one background writer
of both tiers (`background.py`, whose files the rank's writer process writes: `writer_process.py`; the snapshots'
raw files and the one reader of both formats: `raw.py`); the durable tier's checkpoints, written, verified and
committed atomically (`durable.py`), and its best one (`best.py`); the memory tier's snapshots in node-local memory,
written (`memory.py`, at the cadence of `cadence.py`) and found again (`memory_restore.py`); where a run starts,
decided once for every rank across both tiers (`start.py`), after the checks of `resume.py`; the room both need,
checked once (`room.py`); and both tiers as the trainer asks for them (`tiers.py`: `Tiers`). Where their files are
is `hlat.paths`'s."""
