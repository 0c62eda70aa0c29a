"""The data path (docs/data.md): files and their records (`sources`), rounds of documents tokenized and packed in
worker processes (`rounds`, `tokenizer`), rows cut, mixed and batched in the training process (`packing`), and
what the ranks of the global stream send each other (`exchange`).

Only the torch-free config is imported here, so `hlat.data.config` stays cheap for the planner.
"""

from hlat.data.config import DataConfig

__all__ = ["DataConfig"]
