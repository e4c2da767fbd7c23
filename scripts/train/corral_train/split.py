"""The held-out split: a document is held out by a hash of its source and name, so the
split is the same on every build and no training step sees a held-out document."""

from __future__ import annotations

import hashlib

#: Held-out documents per thousand.
HELD_OUT_PER_MILLE = 20


def held_out(source: str, name: str, per_mille: int = HELD_OUT_PER_MILLE) -> bool:
    """Whether the document `name` of `source` belongs to the held-out split."""
    digest = hashlib.sha256(f"{source}/{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little") % 1000 < per_mille
