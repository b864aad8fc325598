"""A load on an object store while another process commits a step and its retention
deletes the one before.

There, a step's objects do not appear or vanish at once (payload first, manifest last;
retention removes the manifest first): a reader that walks newest first can find the
new step not yet committed and then the old one already uncommitted. It must read the
store again and load the new step, not report "no checkpoint" (a resuming job would
start from step 0) nor count either step as damaged.
"""

from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

from elastic_kit.store import MANIFEST_NAME, CheckpointStore, step_dir_name
from elastic_kit.testing import FaultFileSystem


@pytest.mark.parametrize("where", ["before_the_older", "between_two_reads_of_the_new"])
def test_a_step_committed_while_the_older_one_is_deleted_is_loaded(where: str) -> None:
    fs = fsspec.filesystem("memory")
    root = f"/ek-test-{uuid.uuid4().hex}"
    try:
        writer = CheckpointStore(root, filesystem=FaultFileSystem(fs), keep_last=None)
        writer.save({"w": torch.ones(4), "v": 1}, step=1)
        writer.save({"w": torch.full((4,), 2.0), "v": 2}, step=2)
        writer.close()
        new = f"{root}/{step_dir_name(2)}/{MANIFEST_NAME}"
        old = f"{root}/{step_dir_name(1)}/{MANIFEST_NAME}"
        manifest = fs.cat_file(new)
        fs.rm_file(new)  # step 2: payload uploaded, manifest not yet

        def commit_and_retire(_: str) -> None:
            fs.pipe_file(new, manifest)  # the writer commits step 2 ...
            fs.rm_file(old)              # ... and its retention uncommits step 1

        reading = FaultFileSystem(fs)
        if where == "before_the_older":
            # after the reader found step 2 without a manifest, before it reads step 1's
            reading.add("info", match=old, before=commit_and_retire)
        else:
            # right after the reader found step 2 without a manifest, before anything
            # else it reads of step 2 (a second look at its manifest said "corrupt")
            reading.add("info", match=new, skip=1, before=commit_and_retire)
        reader = CheckpointStore(root, filesystem=reading)
        loaded = reader.load()
        assert reading.fired("info") == 1
        assert loaded is not None and loaded.step == 2
        assert loaded.state["v"] == 2 and loaded.state["w"].tolist() == [2.0] * 4
        # neither step was damaged: a later retention of this store counts step 2
        assert reader._layout.found_corrupt == set()
    finally:
        if fs.exists(root):
            fs.rm(root, recursive=True)
