"""Checkpoints, in one place: the train state as one object (`state.py`), the durable tier's files and their
atomic commit (`layout.py`, `store.py`), the best checkpoint (`best.py`), the checks before a resume (`resume.py`),
the memory tier's snapshots in node-local memory (`memory.py`), where a run starts, agreed by every rank across
both tiers (`start.py`), and the run's checkpoints as the trainer sees them (`run.py`: when to save, what to
restore)."""
