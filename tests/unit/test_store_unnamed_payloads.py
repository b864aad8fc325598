"""A save of a committed step that died between its payload and its manifest (a
SIGKILL, a manifest write that failed) left its payload beside the committed one under
a fresh name; the step's next commit named neither it nor anything else of it, so it
stayed for good (a checkpoint's size per crash, which ``ls`` did not show). A commit
now removes the payloads its manifest does not name once they are stale."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import fsspec
import pytest
import torch

from elastic_kit.store import CheckpointStore


@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_commit_removes_stale_payloads_its_manifest_does_not_name(
        tmp_path: Path, kind: str) -> None:
    if kind == "local":
        url = str(tmp_path / "ck")
        step_dir = Path(url) / "step-000000000003"

        def write(name: str, data: bytes, age: float = 0.0) -> None:
            (step_dir / name).write_bytes(data)
            if age:
                t = time.time() - age
                os.utime(step_dir / name, (t, t))

        def names() -> set[str]:
            return {p.name for p in step_dir.iterdir()}
    else:
        url = f"memory://ek-unnamed-{uuid.uuid4().hex}"
        fs = fsspec.filesystem("memory")
        root = url[len("memory://"):]

        def write(name: str, data: bytes, age: float = 0.0) -> None:
            fs.pipe(f"{root}/step-000000000003/{name}", data)
            if age:  # the memory filesystem's entries carry their creation time
                from datetime import datetime, timezone
                fs.store[f"/{root}/step-000000000003/{name}"].created = \
                    datetime.fromtimestamp(time.time() - age, tz=timezone.utc)

        def names() -> set[str]:
            return {p.rsplit("/", 1)[-1] for p in fs.ls(f"{root}/step-000000000003",
                                                          detail=False)}

    store = CheckpointStore(url, keep_last=None, stale_after_s=60)
    store.save({"w": torch.ones(4)}, step=3)
    write("state.0123456789ab.pt", b"a dead save's payload", age=3600)   # stale: removed
    write("shards-00001.0123456789ab.bin", b"a dead save's shards", age=3600)
    write("state.ba9876543210.pt", b"another writer's, being written")   # fresh: kept
    write("notes.txt", b"not a file of ours", age=3600)                    # kept
    store.save({"w": torch.full((4,), 2.0)}, step=3)                       # a re-save
    left = names()
    assert "state.0123456789ab.pt" not in left and "shards-00001.0123456789ab.bin" not in left
    assert {"state.ba9876543210.pt", "notes.txt", "manifest.json"} <= left
    loaded = CheckpointStore(url).load()
    assert loaded is not None and torch.equal(loaded.state["w"], torch.full((4,), 2.0))
