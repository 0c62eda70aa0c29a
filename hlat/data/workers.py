"""Where a rank's rounds are made (torch-free): in the training process, or by tokenizer worker processes
(`rounds.worker_main` is their side), asked ahead.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import weakref

from hlat import HlatError
from hlat.data.rounds import MakerSetup, Round, worker_main

PREFETCH = 2  # rounds requested ahead per source and worker


class InPlace:
    """Rounds made in the training process (data.workers = 0)."""

    procs: list = []

    def __init__(self, setup: MakerSetup):
        self.makers = setup.makers()

    def get(self, source: int, index: int) -> Round:
        return self.makers[source].make(index)

    def close(self) -> None:
        pass


def _stop_workers(procs) -> None:
    for proc in procs:
        proc.kill()  # they hold nothing to clean up, ignore SIGTERM, and may be busy with rounds nobody will read
    for proc in procs:
        proc.join(timeout=5)


class Workers:
    """Worker processes (spawned: safe after CUDA and threads). This rank makes rounds offset, offset + stride,
    ... of every source; the j-th of them goes to worker j % n, which makes its rounds in order. Each source
    keeps PREFETCH rounds per worker requested ahead."""

    def __init__(self, n: int, setup: MakerSetup, offset: int = 0, stride: int = 1):
        ctx = mp.get_context("spawn")
        self.n, self.offset, self.stride = n, offset, stride
        self.tasks = [ctx.Queue() for _ in range(n)]
        self.results = [ctx.Queue() for _ in range(n)]
        self.procs = [
            ctx.Process(target=worker_main, args=(setup, tasks, results), daemon=True, name=f"hlat-data-{i}")
            for i, (tasks, results) in enumerate(zip(self.tasks, self.results))
        ]
        for proc in self.procs:
            proc.start()
        for tasks in self.tasks:
            tasks.cancel_join_thread()  # never block the process's exit on a dead worker's queue
        # per source, j of the next round to request (this rank's j-th: offset + j * stride)
        self.requested = [max(0, -((offset - index) // stride)) for index, _ in setup.starts]
        self.ready: dict[tuple[int, int], Round] = {}
        self._stop = weakref.finalize(self, _stop_workers, self.procs)  # also run at exit

    def get(self, source: int, index: int) -> Round:
        j = (index - self.offset) // self.stride  # the round is this rank's j-th
        while self.requested[source] < j + PREFETCH * self.n:
            ahead = self.requested[source]
            self.tasks[ahead % self.n].put((source, self.offset + ahead * self.stride))
            self.requested[source] += 1
        worker = j % self.n
        while (source, index) not in self.ready:
            try:
                result = self.results[worker].get(timeout=1.0)
            except queue.Empty:
                if not self.procs[worker].is_alive():
                    raise HlatError(f"data worker {worker} died (exit code {self.procs[worker].exitcode})") from None
                continue
            if isinstance(result, BaseException):
                raise result
            self.ready[result.source, result.index] = result
        return self.ready.pop((source, index))

    def close(self) -> None:
        self._stop()
