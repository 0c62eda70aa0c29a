"""The data path (docs/data.md): sources resolved into files (`sources`), what a data file is (`formats`), the files
split among ranks (`splits`), their records read (`readers`), bad records logged and documents held out
(`records`), rounds of documents tokenized and packed in worker processes (`rounds`, `tokenizer`, `workers`), each
source's rows (`source_stream`), rows cut, mixed and batched in the training process (`packing`), and what the
ranks of the global stream send each other (`exchange`).

Only the torch-free config is imported here, so `hlat.data.config` stays cheap for the planner.
"""

from hlat.data.config import DataConfig

__all__ = ["DataConfig"]
