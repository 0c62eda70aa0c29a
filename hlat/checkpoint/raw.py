"""The memory tier's snapshot format: DCP's metadata (`.metadata`, so that a snapshot loads through DCP into any
layout, resharded like any checkpoint), with each rank's tensors in its `__R_0.distcp` file as their raw bytes,
one after another, then its objects (the trainer state, the optimizer's settings: on the first rank only, as DCP
plans them) as DCP serializes them, after an index of their lengths: the objects' count and each one's length,
8-byte little-endian integers. A raw file is the staging buffer as the trainer copied it
(`hlat.checkpoint.background`): written with no serialization, and no per-tensor framing to build. Where each piece
lies is a `RawChunk`, DCP's storage data of the item: a tensor's offset and length; an object's place in its file's
index, its bytes found from the lengths there. The objects' sizes change from snapshot to snapshot (the step, the
data position) while the tensors' places do not, so the metadata, which every rank shares, stays the same from one
snapshot of a layout to the next (only the name of the checkpoint in it changes), and a rank writes its file
without learning the others' sizes. `Reader` is DCP's file reader that also reads these: every reader of a
checkpoint or a snapshot uses it.
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

INDEX_ENTRY = 8  # bytes of each integer of a raw file's index of objects


@dataclass(frozen=True)
class RawChunk:
    """Where an item of a raw file lies: its file and offset; a tensor's length, dtype (its name in torch) and
    shape; an object's place (`slot`) in the index of the file's objects that starts at `offset`."""

    relative_path: str
    offset: int
    length: int = 0
    dtype: str | None = None
    shape: tuple[int, ...] = ()
    slot: int | None = None

    def tensor(self, data: bytearray) -> torch.Tensor:
        dtype = getattr(torch, self.dtype)
        return torch.frombuffer(data, dtype=dtype).view(self.shape) if data else torch.empty(self.shape, dtype=dtype)


def objects_tail(objects: list[bytes]) -> bytes:
    """The objects' part of a raw file: the index of their lengths, then their bytes one after another."""
    index = [len(objects), *map(len, objects)]
    return b"".join(n.to_bytes(INDEX_ENTRY, "little") for n in index) + b"".join(objects)


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
        indexes: dict[tuple[str, int], list[tuple[int, int]]] = {}
        places = {item: self.place(chunks[item], indexes) for item in raw}
        for item in sorted(raw, key=lambda item: (chunks[item].relative_path, places[item])):
            chunk = chunks[item]
            data = self.read(chunk.relative_path, *places[item])
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

    def place(self, chunk: RawChunk, indexes: dict) -> tuple[int, int]:
        """Where an item's bytes lie in its file: (offset, length); an object's from its file's index of objects
        (read once per file into `indexes`: {(file, offset): [(offset, length)] of each object})."""
        if chunk.slot is None:
            return chunk.offset, chunk.length
        key = (chunk.relative_path, chunk.offset)
        if key not in indexes:
            count = int.from_bytes(self.read(chunk.relative_path, chunk.offset, INDEX_ENTRY), "little")
            entries = self.read(chunk.relative_path, chunk.offset + INDEX_ENTRY, count * INDEX_ENTRY)
            at, places = chunk.offset + (count + 1) * INDEX_ENTRY, []
            for i in range(count):
                length = int.from_bytes(entries[i * INDEX_ENTRY : (i + 1) * INDEX_ENTRY], "little")
                places.append((at, length))
                at += length
            indexes[key] = places
        if chunk.slot >= len(indexes[key]):
            raise OSError(f"{chunk.relative_path}: holds {len(indexes[key])} objects, not object {chunk.slot}")
        return indexes[key][chunk.slot]

    def read(self, relative_path: str, offset: int, length: int) -> bytearray:
        data = bytearray(length)
        with open(self.fs.concat_path(self.path, relative_path), "rb") as f:
            f.seek(offset)
            if f.readinto(data) != length:
                raise OSError(f"{relative_path}: ends before the {length} bytes at {offset}")
        return data
