"""The run identity a store holds: which run of this store a snapshot belongs to.

In-memory snapshots outlive the worker processes and are found again by name (the
torchrun run id, the store's URL), and both names repeat: a reused ``--rdzv-id``, a
container's deterministic agent pid, a store deleted to start over at the same URL.
So the durable store holds one more thing: a random identity, created when a run
first starts on a store that has none, kept as long as the store exists. The snapshot
tier records it in every snapshot and replica and uses one only when it carries the
identity the store holds now; deleting or replacing the store therefore starts fresh.

Created with create-if-absent semantics, so two writers racing on an empty store end
up with one identity: locally the file is written under a temporary name and linked
into place (``link`` fails if the name exists); on object stores it is one PUT with
``If-None-Match: *`` (fsspec's ``mode="create"``), and where a backend does not know
that mode, a plain PUT read back (two first writers racing within one round trip may
then briefly disagree; a second job on the same URL is reported as a conflict at its
first save anyway). Both procedures are the backends' ``create_once``.
"""

from __future__ import annotations

import errno
import re
import uuid

from elastic_kit.store._fs import join
from elastic_kit.store._layout import Layout
from elastic_kit.errors import CheckpointCorruptError

__all__ = ["IDENTITY_NAME", "read_identity", "ensure_identity"]

#: The file, at a store's root, holding its run identity.
IDENTITY_NAME = "run-identity"
_IDENTITY_RE = re.compile(r"[0-9a-f]{32}", re.ASCII)
_MAX_BYTES = 256


def _parse(raw: bytes, path: str) -> str:
    text = raw.decode("ascii", errors="replace").strip()
    if not _IDENTITY_RE.fullmatch(text):
        raise CheckpointCorruptError(f"{path} holds {text[:64]!r}, expected a run identity "
                                     f"of 32 lowercase hex digits (remove the file to "
                                     f"start a new run on this store)")
    return text


def read_identity(layout: Layout) -> str | None:
    """The identity ``layout``'s store holds, or None when it has none yet.

    Raises:
        CheckpointCorruptError: the file is not an identity (or not a regular file).
        CheckpointError: the store could not be read (after retries).
    """
    path = join(layout.root, IDENTITY_NAME)

    def read() -> bytes:
        return layout.backend.read_small(path, _MAX_BYTES)

    try:
        return _parse(layout._read(read, path), path)
    except FileNotFoundError:
        return None


def ensure_identity(layout: Layout, *, adopt: str | None = None,
                    replace: bool = False) -> str:
    """The identity ``layout``'s store holds, created first when it has none (a new
    random one, or ``adopt``: one that another node's directory of a node-local
    store holds). ``replace``: ``adopt`` replaces another identity the store holds
    (a node's directory that held another run's: the run goes on from a newer step
    of another node's directory)."""
    if adopt is not None:
        _parse(adopt.encode(), "the identity to adopt")
    found = read_identity(layout)
    if found is not None and (found == adopt or not (replace and adopt is not None)):
        return found
    if found is not None:  # replaced: removed first, then created as when absent
        try:
            layout.backend.remove_file(join(layout.root, IDENTITY_NAME))
        except FileNotFoundError:
            pass  # another process replacing it too (a directory shared by accident)
    layout.check_root()
    path = join(layout.root, IDENTITY_NAME)
    data = ((adopt or uuid.uuid4().hex) + "\n").encode()
    layout.backend.create_once(path, data)
    found = read_identity(layout)
    if found is None and adopt is not None and replace:
        found = adopt  # another process replacing it too removed ours: theirs is the same
    if found is None:
        raise FileNotFoundError(errno.ENOENT, f"the run identity written to {path} cannot be "
                                "read back", path)
    return found
