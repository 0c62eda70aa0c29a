"""The writer process of a rank's background writers (`hlat.checkpoint.background`): one long-lived process, at the
lowest CPU priority, that writes what its trainer copied into shared memory (each writer's staging buffer), so
that neither the files' writes, their checksums nor the copy to a buddy take the trainer's GIL, and they take
its cores only where the trainer leaves them idle (or, at the end of a step that waits for them, at once).

It imports no torch, so that it starts in a fraction of a second: the memory tier's files are the staged bytes as
they are (`WriteFile`). A durable checkpoint, in DCP's own file format, is written by a request that imports torch
there when it first comes (`hlat.checkpoint.background.WriteCheckpointFiles`). Every file is checksummed (CRC-32)
from the bytes as they are written, and overwritten in place where it exists (a tmpfs keeps its pages).

Started by `main(control, parent)`, it serves the rank's background writers, each over a channel of its own (a
socket pair and its staging buffer, passed over the control socket; the memory tier's and, with
train.async_checkpoint, the durable tier's), each in a thread, so that a durable checkpoint's long write never holds
a snapshot back: one request at a time per channel, answered with `(True, result)` or `(False, the error it raised)`.
It ends when the trainer closes the control socket, or is gone (kill -9 included), whatever it was doing.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import pickle
import signal
import socket
import threading
import time
import zlib
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

CHUNK = 1 << 22  # written and checksummed piece by piece, so that the checksum reads bytes still in the cache


SPARE = ".spare"  # beside a run's snapshots in the memory tier: the files of the one dropped last, for the next


def from_spare(path: Path) -> Path:
    """`path`, a file of a snapshot about to be written, made of the spare file of its name where there is one:
    overwritten in place, it keeps its pages (a tmpfs allocates none). Each rank's writer takes its own files, so no
    rank waits for another, and the node never holds more than the two snapshots it keeps."""
    with contextlib.suppress(FileNotFoundError):
        os.rename(path.parent.parent / SPARE / path.name, path)
    return path


class Checksummed:
    """A file written through this stream: its size and CRC-32 from the bytes written, computed as they pass.
    An existing file is overwritten in place and cut to what was written; `sync` forces it to storage at close."""

    def __init__(self, path: Path, sync: bool = False):
        self.path, self.sync = path, sync
        self.file = open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o644), "wb", buffering=0)
        self.size = self.crc = 0

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        for start in range(0, len(view), CHUNK):
            piece = view[start : start + CHUNK]
            while piece:  # a raw write may take less than it is given
                piece = piece[self.file.write(piece) :]
            self.crc = zlib.crc32(view[start : start + CHUNK], self.crc)
        self.size += len(view)
        return len(view)

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self.file.fileno()

    def close(self) -> None:
        if not self.file.closed:
            self.file.truncate(self.size)
            if self.sync:
                os.fsync(self.file.fileno())
            self.file.close()

    def __enter__(self) -> Checksummed:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def digest(self) -> list[int]:
        return [self.size, self.crc]


class Writer:
    """The process's state: the staging buffer, the newest file written from it, and (on several nodes) the
    connections that carry that file to this rank's buddy and its ward's file here."""

    def __init__(self, staging_fd: int):
        self.fd, self.staging = staging_fd, memoryview(b"")
        self.last: tuple[Path, list, list[int]] | None = None  # (file, its pieces, its digest)
        self.listener: socket.socket | None = None
        self.buddy: tuple[str, int] | None = None
        self.timeout_s = 600.0
        self.to_buddy: socket.socket | None = None
        self.from_ward: socket.socket | None = None

    def mapped(self) -> memoryview:
        """The staging buffer, mapped again where the trainer grew it (between writes)."""
        size = os.fstat(self.fd).st_size
        if len(self.staging) != size:
            self.staging = memoryview(mmap.mmap(self.fd, size))
        return self.staging

    def pieces(self, ranges, tail: bytes) -> list:
        staging = self.mapped()
        return [staging[start : start + size] for start, size in ranges] + [tail]

    def exchange(self, target: Path, step: int) -> dict:
        """Send the newest file written to the buddy and keep the ward's, at once (every rank sends and receives:
        sent first, the copies would wait for each other); returns the received file's {name: [size, crc]}."""
        path, pieces, digest = self.last
        header = json.dumps({"step": step, "name": path.name, "digest": digest}).encode()
        failure: list[BaseException] = []
        sending = threading.Thread(target=self._send, args=([len(header).to_bytes(8, "big"), header, *pieces], failure))
        sending.start()
        received = self._receive(target, step)
        sending.join()
        if failure:
            raise failure[0]
        return received

    def _send(self, pieces: list, failure: list) -> None:
        try:
            if self.to_buddy is None:
                self.to_buddy = socket.create_connection(self.buddy, timeout=self.timeout_s)
            for piece in pieces:
                self.to_buddy.sendall(piece)
        except BaseException as e:
            failure.append(e)

    def _receive(self, target: Path, step: int) -> dict:
        if self.from_ward is None:
            self.listener.settimeout(self.timeout_s)
            self.from_ward, _ = self.listener.accept()
            self.from_ward.settimeout(self.timeout_s)
        header = json.loads(received(self.from_ward, int.from_bytes(received(self.from_ward, 8), "big")))
        if header["step"] != step:
            raise RuntimeError(f"the ward's copy is of step {header['step']}, not {step}")
        size, crc = header["digest"]
        buffer = memoryview(bytearray(min(CHUNK, size) or 1))
        with Checksummed(from_spare(target / header["name"])) as out:
            while out.size < size:
                n = self.from_ward.recv_into(buffer, min(len(buffer), size - out.size))
                if not n:
                    raise ConnectionError("the ward's writer closed its connection")
                out.write(buffer[:n])
        if out.digest != [size, crc]:
            raise RuntimeError(f"the ward's copy of {header['name']} does not match its sender's checksum")
        return {header["name"]: out.digest}


def received(conn: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        piece = conn.recv(size - len(data))
        if not piece:
            raise ConnectionError("the ward's writer closed its connection")
        data += piece
    return bytes(data)


class Request:
    """What the trainer asks of the process; `run` is called there, and its result sent back."""

    def run(self, writer: Writer):
        raise NotImplementedError


@dataclass(frozen=True)
class WriteFile(Request):
    """Write `ranges` [(start, size)] of the staging buffer, then `tail`, into the file `path`: its [size, CRC-32]."""

    path: str
    ranges: tuple[tuple[int, int], ...]
    tail: bytes

    def run(self, writer: Writer) -> list[int]:
        pieces = writer.pieces(self.ranges, self.tail)
        with Checksummed(from_spare(Path(self.path))) as out:
            for piece in pieces:
                out.write(piece)
        writer.last = (Path(self.path), pieces, out.digest)
        return out.digest


@dataclass(frozen=True)
class Listen(Request):
    """Listen for this rank's ward (on several nodes): the port."""

    def run(self, writer: Writer) -> int:
        family = socket.AF_INET6 if socket.has_dualstack_ipv6() else socket.AF_INET
        writer.listener = socket.create_server(("", 0), family=family, dualstack_ipv6=family == socket.AF_INET6)
        return writer.listener.getsockname()[1]


@dataclass(frozen=True)
class Meet(Request):
    """Where this rank's buddy listens, and how long a copy to it or from the ward may take."""

    buddy: tuple[str, int]
    timeout_s: float

    def run(self, writer: Writer) -> None:
        writer.buddy, writer.timeout_s = self.buddy, self.timeout_s


@dataclass(frozen=True)
class SealSnapshot(Request):
    """The memory tier's work after this rank wrote its file of a snapshot into `target`: the copy to its buddy and
    of its ward's (`exchange`), the node's `extra` files (DCP's .metadata and the config, on a node's first rank),
    then this rank's record (`rank_R.json`: every file it wrote there, with its size and CRC-32, the saving world
    and the run's token), written last. Returns the names of the files recorded."""

    target: str
    step: int
    rank: int
    world: int
    token: str
    extra: dict
    exchange: bool

    def run(self, writer: Writer) -> list[str]:
        target, (path, _, digest) = Path(self.target), writer.last
        if path.parent != target:
            raise RuntimeError(f"{target}: this rank's file of the snapshot was not written")
        files = {path.name: digest}
        if self.exchange:
            files |= writer.exchange(target, self.step)
        for name, data in self.extra.items():
            with Checksummed(from_spare(target / name)) as out:
                out.write(data)
            files[name] = out.digest
        record = {"step": self.step, "world": self.world, "token": self.token, "files": files}
        tmp = target / f".rank_{self.rank}.json.tmp"
        tmp.write_text(json.dumps(record))
        tmp.rename(target / f"rank_{self.rank}.json")
        return sorted(files)


def portable(e: BaseException) -> BaseException:
    """The error as the trainer can receive it (its first line where it does not pickle)."""
    try:
        pickle.dumps(e)
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")


def exit_with_parent(parent: int) -> None:
    """End the process as soon as the trainer is gone, however it died: a write it no longer waits for is not
    finished (and, unrecorded, never loaded)."""
    while os.getppid() == parent:
        time.sleep(0.2)
    os._exit(0)


def main(control_fd: int, parent: int) -> None:
    """Serve each channel the trainer opens (its background writers': their end of a socket pair and their staging
    buffer, passed over the control socket) in a thread of its own, until the trainer closes the control socket."""
    # Ctrl-C and a scheduler's SIGTERM are for the trainer: it finishes its step, its writes, and then ends this one
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.nice(19)
    threading.Thread(target=exit_with_parent, args=(parent,), daemon=True).start()
    control = socket.socket(fileno=control_fd)
    while True:
        try:
            _, fds, _, _ = socket.recv_fds(control, 1, 2)
        except OSError:
            return
        if len(fds) != 2:  # the trainer closed the control socket
            return
        threading.Thread(target=serve, args=(Connection(fds[0]), Writer(fds[1])), daemon=True).start()


def serve(conn: Connection, writer: Writer) -> None:
    """Answer one channel's requests in turn, until its background writer closes it."""
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        except BaseException as e:  # a request that does not unpickle here
            conn.send((False, portable(e)))
            continue
        try:
            reply = (True, request.run(writer))
        except BaseException as e:
            reply = (False, portable(e))
        conn.send(reply)
