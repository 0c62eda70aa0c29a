"""The memory tier's snapshot format: DCP's metadata (`.metadata`, so that a snapshot loads through DCP into any
layout, resharded like any checkpoint), with each rank's tensors in its `__R_0.distcp` file as their raw bytes,
one after another, then its small objects (the trainer state, the optimizer's settings) as DCP serializes them.
A raw file is the staging buffer as the trainer copied it (`hlat.checkpoint.background`): written with no
serialization, and no per-tensor framing to build. Where each piece lies is a `RawChunk`, DCP's storage data of
the item. `Reader` is DCP's file reader that also reads these: every reader of a checkpoint or a snapshot uses it.
"""

from __future__ import annotations

import dataclasses
import io
from dataclasses import dataclass

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

from hlat.torch_private import storage_data


@dataclass(frozen=True)
class RawChunk:
    """Where an item of a raw file lies: its file, offset and length; a tensor's dtype (its name in torch) and
    shape (an object's: None and ())."""

    relative_path: str
    offset: int
    length: int
    dtype: str | None = None
    shape: tuple[int, ...] = ()

    def tensor(self, data: bytearray) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        return torch.frombuffer(data, dtype=dtype).view(self.shape) if data else torch.empty(self.shape, dtype=dtype)


class Reader(FileSystemReader):
    """DCP's file reader, which also reads the items of raw files (`RawChunk`s)."""

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.chunks = storage_data(metadata)

    def read_data(self, plan, planner) -> Future:
        chunks = {item: self.chunks[item.storage_index] for item in plan.items}
        raw = [item for item in plan.items if isinstance(chunks[item], RawChunk)]
        if len(raw) < len(plan.items):
            rest = [item for item in plan.items if not isinstance(chunks[item], RawChunk)]
            super().read_data(dataclasses.replace(plan, items=rest), planner).wait()
        for item in sorted(raw, key=lambda item: (chunks[item].relative_path, chunks[item].offset)):
            chunk = chunks[item]
            data = bytearray(chunk.length)
            with open(self.fs.concat_path(self.path, chunk.relative_path), "rb") as f:
                f.seek(chunk.offset)
                if f.readinto(data) != chunk.length:
                    raise OSError(f"{chunk.relative_path}: ends before the {chunk.length} bytes at {chunk.offset}")
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(data))
                continue
            tensor = chunk.tensor(data)
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                tensor = tensor.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(tensor)
            planner.commit_tensor(item, target)
        done: Future = Future()
        done.set_result(None)
        return done
