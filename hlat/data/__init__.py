"""The data path: files -> documents (`sources`) -> token ids (`tokenizer`) -> packed batches (`packing`).

Only the torch-free config is imported here, so `hlat.data.config` stays cheap for the planner.
"""

from hlat.data.config import DataConfig

__all__ = ["DataConfig"]
