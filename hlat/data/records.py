"""What becomes of a record that is not trained on (torch-free): a bad one (not a document) counted by reason and
warned of, and a document held out for validation (eval.holdout).
"""

from __future__ import annotations

import hashlib
import logging
from collections import Counter
from typing import NamedTuple

log = logging.getLogger(__name__)


class Bad(NamedTuple):
    """A record that is not a document; `reason` is counted, `detail` only shown."""

    reason: str
    detail: str = ""


class BadLog:
    """Counts bad records by reason and logs a warning naming the place at the 1st, 10th, 100th... of each
    (unless `warn` is off: where another process warns of the same records)."""

    def __init__(self, name: str = "", warn: bool = True):
        self.counts: Counter[str] = Counter()
        self.prefix = f"data source {name!r}: " if name else ""
        self.warn = warn

    def add(self, bad: Bad, place: str) -> None:
        self.counts[bad.reason] += 1
        n = self.counts[bad.reason]
        if self.warn and str(n).rstrip("0") == "1":
            detail = f" ({bad.detail})" if bad.detail else ""
            log.warning(
                "%sskipped a bad record (%s%s) at %s; %d skipped for this reason so far",
                self.prefix,
                bad.reason,
                detail,
                place,
                n,
            )


# Bad records met by iter_documents since the process started (tokenizer sampling, `hlat data inspect`).
skipped = BadLog()


def held_out(doc, fraction: float) -> bool:
    """Whether a document (text, or a token file's ids) belongs to the validation split (eval.holdout): decided by
    a hash of its content alone, so the split is the same on every rank, in every run and whatever the file
    order."""
    data = doc.encode("utf-8", "surrogatepass") if isinstance(doc, str) else doc.tobytes()  # or token ids
    digest = hashlib.blake2b(data, digest_size=8).digest()
    return int.from_bytes(digest, "big") < fraction * 2**64
