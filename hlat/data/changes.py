"""What changed in the data settings between a checkpoint and this run, said in words: the files added, removed or
resized rather than two hashes.

A data state's fingerprint holds, per source, a hash of its split listing (`[file, start, size]` of every split)
and, beside the hashes, each source's files and their sizes (`fingerprint["listing"]`: what the splits add up to,
a fraction of their size, in every checkpoint). Only the hashes and settings are compared; the listings say what
a changed hash means. A checkpoint from before listings were kept still resumes, and a change to its files is
reported as the hashes it has.
"""

from __future__ import annotations

LISTING = "listing"  # the fingerprint's key of the split listings, by source name
SHOWN = 5  # files named per kind of change; the rest are counted


def split_listing(splits) -> list[list]:
    """A source's splits as `[file, start, size]` rows: what its fingerprint hashes."""
    return [[str(s.file), s.start, s.size] for s in splits]


def file_sizes(splits) -> dict[str, int]:
    """A source's files and their bytes (the sum of their splits'): what a diff reads."""
    sizes: dict[str, int] = {}
    for s in splits:
        sizes[str(s.file)] = sizes.get(str(s.file), 0) + s.size
    return sizes


def fingerprint_changes(old: dict, new: dict) -> list[str]:
    """One phrase per setting or source that differs between fingerprints `old` (the checkpoint's) and `new`."""
    old_listing, new_listing = old.get(LISTING, {}), new.get(LISTING, {})
    before, after = _flatten(old), _flatten(new)
    out = []
    for key in sorted(before.keys() | after.keys()):
        if before.get(key) == after.get(key):
            continue
        source = key.removeprefix("sources.").removesuffix(".files")
        if key.endswith(".files") and source in old_listing and source in new_listing:
            out.append(f"the files of source {source!r}: {listing_changes(old_listing[source], new_listing[source])}")
        elif key.endswith(".files") and key in before and key in after:
            out.append(
                f"the files of source {source!r} (listing hash {before[key]!r} -> {after[key]!r}; the "
                "checkpoint predates file listings, so which files changed is unknown)"
            )
        else:
            out.append(f"{key} {before.get(key)!r} -> {after.get(key)!r}")
    return out


def listing_changes(before: dict[str, int], after: dict[str, int]) -> str:
    """The files added, removed and resized between two listings (`file_sizes`), e.g. 'added b.jsonl (2,048
    bytes); resized a.jsonl 1,000 -> 1,200 bytes'."""
    added = [f"{f} ({size:,} bytes)" for f, size in after.items() if f not in before]
    removed = [f"{f} ({size:,} bytes)" for f, size in before.items() if f not in after]
    resized = [f"{f} {before[f]:,} -> {size:,} bytes" for f, size in after.items() if f in before and before[f] != size]
    kinds = [
        f"{verb} {_some(items)}"
        for verb, items in (("added", added), ("removed", removed), ("resized", resized))
        if items
    ]
    return "; ".join(kinds) or "the same files and sizes, split differently (another hlat version)"


def _some(items: list[str]) -> str:
    shown = ", ".join(items[:SHOWN])
    return f"{shown} and {len(items) - SHOWN} more" if len(items) > SHOWN else shown


def _flatten(d: dict, prefix: str = "") -> dict:
    """{'a.b': value} for nested dicts, leaving out the listings (they explain a changed hash; they are not one)."""
    out = {}
    for k, v in d.items():
        if k == LISTING and not prefix:
            continue
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out
