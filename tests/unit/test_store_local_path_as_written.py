"""A local checkpoint path is used as written: "::" in a run's name (fsspec's URL
chaining for remote URLs) names a directory, so two runs never share a store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from elastic_kit.store import CheckpointStore


@pytest.mark.parametrize("scheme", ["", "file://"])
def test_a_double_colon_in_a_local_path_names_its_own_directory(tmp_path: Path,
                                                                  scheme: str) -> None:
    a = CheckpointStore(f"{scheme}{tmp_path}/exp::lr=0.1")
    a.save({"w": torch.ones(2)}, step=100)
    assert a.root == f"{tmp_path}/exp::lr=0.1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp::lr=0.1"]
    b = CheckpointStore(f"{scheme}{tmp_path}/exp::lr=0.2")
    assert b.load() is None and b.list() == []
    assert CheckpointStore(f"{tmp_path}/exp::lr=0.1").load().step == 100
    for s in (a, b):
        s.close()


def test_home_and_relative_paths_still_resolve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                               ) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert CheckpointStore("~/ck").root == f"{tmp_path}/home/ck"
    assert CheckpointStore("rel/ck").root == f"{tmp_path}/rel/ck"
    assert CheckpointStore("file://rel/ck").root == f"{tmp_path}/rel/ck"


@pytest.mark.parametrize("scheme", ["FILE://", "File://"])
def test_a_scheme_in_capitals_names_the_same_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    scheme: str) -> None:
    # URL schemes are case-insensitive: "FILE:///x" wrote into ./FILE:/x, relative to
    # whatever the working directory was
    monkeypatch.chdir(tmp_path)
    store = CheckpointStore(f"{scheme}{tmp_path}/ck")
    assert store.root == f"{tmp_path}/ck"
    store.save({"w": torch.ones(2)}, step=3)
    store.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]
    assert CheckpointStore(f"{tmp_path}/ck").load().step == 3
    assert CheckpointStore(f"MEMORY://ek-caps-{tmp_path.name}").root == (
        CheckpointStore(f"memory://ek-caps-{tmp_path.name}").root)


def test_the_root_of_a_memory_filesystem_is_a_store_and_messages_quote_the_url_as_given(
        tmp_path: Path) -> None:
    store = CheckpointStore("memory://")
    store.save({"w": torch.ones(2)}, step=5)
    assert CheckpointStore("memory:///").load().step == 5
    store.close()
    for gone in store.list():
        store.fs.rm(gone.path, recursive=True)
    with pytest.raises(ValueError, match=r"url='" + str(tmp_path) + r"/My://Dir'"):
        CheckpointStore(f"{tmp_path}/My://Dir")
