"""An object store's listing must stay inside the store's root: a filesystem that
normalizes a path to another one (s3fs lists ``b//run`` as ``b/run``) would otherwise
have the store read another store's steps as its own, and delete them as leftovers."""

from __future__ import annotations

import uuid
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from elastic_kit.errors import CheckpointError
from elastic_kit.store import CheckpointStore


class _LowerListing(MemoryFileSystem):
    """A memory filesystem that lists a path under its lower-case spelling (as a
    case-insensitive store would), while reading and writing it as written."""

    protocol = "ek-lower-listing"

    def ls(self, path: str, detail: bool = True, **kwargs: Any) -> Any:
        return super().ls(self._strip_protocol(path).lower(), detail=detail, **kwargs)


def test_a_listing_that_names_another_path_fails_before_anything_is_read_or_deleted(
        caplog: pytest.LogCaptureFixture) -> None:
    fs = _LowerListing()
    name = f"ek-lower-{uuid.uuid4().hex}"
    other = CheckpointStore(f"memory://{name}/run", keep_last=None)
    other.save({"w": torch.ones(2)}, step=5)
    other.save({"w": torch.ones(2)}, step=6)
    mixed = CheckpointStore(f"memory://{name}/RUN", filesystem=fs, stale_after_s=0)
    with pytest.raises(CheckpointError, match=r"RUN.*returned '[^']*/run/step-\d+'.*outside"):
        mixed.latest_step()
    mixed.save({"w": torch.zeros(2)}, step=7)  # its retention and cleanup fail, logged
    mixed.wait()
    assert any("outside" in r.getMessage() for r in caplog.records)
    assert [i.step for i in other.list()] == [5, 6]  # nothing of the other store went


def test_a_listing_inside_the_root_is_read_as_before() -> None:
    name = f"ek-lower-{uuid.uuid4().hex}"
    store = CheckpointStore(f"memory://{name}/run", filesystem=_LowerListing(), keep_last=1)
    store.save({"w": torch.ones(2)}, step=1)
    store.save({"w": torch.full((2,), 2.0)}, step=2)
    loaded = store.load()
    assert loaded is not None and loaded.step == 2
    assert torch.equal(loaded.state["w"], torch.full((2,), 2.0))
    assert [i.step for i in store.list()] == [2]
    assert fsspec.filesystem("memory").exists(f"/{name}/run/step-000000000002")


def test_the_empty_path_component_check_reads_the_path_not_a_urls_scheme() -> None:
    """http's paths are whole URLs: its ``//`` after the scheme is no empty component,
    and a real one's suggested spelling keeps the scheme."""
    store = CheckpointStore("http://127.0.0.1:9/run")  # made, nothing read yet
    assert store.url == "http://127.0.0.1:9/run"
    with pytest.raises(ValueError, match=r"expected the path without it "
                                         r"\('http://127.0.0.1:9/run'\)"):
        CheckpointStore("http://127.0.0.1:9//run")
    with pytest.raises(ValueError, match=r"expected the path without it \('b/run'\)"):
        CheckpointStore("memory://b//run")
