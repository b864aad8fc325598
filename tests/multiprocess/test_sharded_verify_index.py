"""``verify`` (and so ``prune``) checks a sharded checkpoint's index as a load does.

A manifest whose sharded index was damaged while the JSON stays valid (a chunk's
checksum, where a chunk lies in its file, a tensor's digest, a chunk's shape or place
in its tensor) leaves every shard file's own checksum intact: a load of it fails, so
verify must report it and prune must not count it as one of the steps it keeps (else
``prune --keep 1`` deletes the older good steps and nothing loads any more).

Two gloo ranks save steps 1 and 2 of a (4, 2) DTensor sharded over dim 0 and a (3, 5)
one sharded over dim 1 (uneven: 3 and 2 columns, so each chunk is several runs of its
tensor); the damage is done to step 2's manifest, and checked without a process group.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from elastic_kit.testing import spawn_multi_process

pytestmark = pytest.mark.timeout(120)


def _state(mesh: Any, step: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    w = torch.arange(8.0).reshape(4, 2) + 100 * step
    v = torch.arange(15.0).reshape(3, 5) - 100 * step
    return {"w": distribute_tensor(w, mesh, [Shard(0)]),
            "v": distribute_tensor(v, mesh, [Shard(1)]), "step": step}


def _save_steps(root: str) -> list[int]:
    from torch.distributed.device_mesh import init_device_mesh

    import elastic_kit as ek

    ek.init_distributed()
    mesh = init_device_mesh("cpu", (2,))
    store = ek.CheckpointStore(root, keep_last=None)
    for step in (1, 2):
        store.save(_state(mesh, step), step=step)
    store.close()
    return [i.step for i in store.list()]


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sharded") / "ck"
    assert spawn_multi_process(2, _save_steps, str(root))[0] == [1, 2]
    return root


def _copy(saved: Path, tmp_path: Path) -> Path:
    root = tmp_path / "ck"
    shutil.copytree(saved, root)
    return root


def _chunk(m: dict[str, Any], path: str, offsets: list[int]) -> dict[str, Any]:
    i = next(i for i, t in enumerate(m["sharded"]["tensors"]) if t["path"] == f"[{path!r}]")
    return next(c for c in m["sharded"]["chunks"] if c["tensor"] == i and c["offsets"] == offsets)


def _flip(hexdigits: str) -> str:
    return ("0" if hexdigits[0] != "0" else "1") + hexdigits[1:]


def _chunk_checksum(m: dict[str, Any]) -> None:
    e = _chunk(m, "v", [0, 3])["entry"]
    e["checksum"] = _flip(e["checksum"])


def _chunk_offset_onto_another(m: dict[str, Any]) -> None:
    w, v = _chunk(m, "w", [2, 0]), _chunk(m, "v", [0, 3])
    assert w["file"] == v["file"] and w["entry"]["offset"] != v["entry"]["offset"]
    w["entry"]["offset"] = v["entry"]["offset"]


def _chunk_offsets_swapped(m: dict[str, Any]) -> None:
    # each chunk's own bytes and checksum still match; the file's chunks do not overlap
    w, v = _chunk(m, "w", [2, 0]), _chunk(m, "v", [0, 3])
    w["entry"]["offset"], v["entry"]["offset"] = v["entry"]["offset"], w["entry"]["offset"]


def _tensor_digest(m: dict[str, Any]) -> None:
    t = next(t for t in m["sharded"]["tensors"] if t["path"] == "['w']")
    t["digest"] = _flip(t["digest"])


def _chunks_swapped_in_their_tensor(m: dict[str, Any]) -> None:
    # rows 0-1 and 2-3 of w trade places: every byte and checksum is intact, the
    # tensor assembled from them is not the saved one
    a, b = _chunk(m, "w", [0, 0]), _chunk(m, "w", [2, 0])
    a["offsets"], b["offsets"] = [2, 0], [0, 0]


def _chunk_shape_overlapping(m: dict[str, Any]) -> None:
    # [2, 2] at [0, 0] read as [4, 1]: inside the tensor, as many elements, but it
    # overlaps the chunk at [2, 0] and leaves column 1 of rows 0-1 uncovered
    _chunk(m, "w", [0, 0])["entry"]["shape"] = [4, 1]


def _chunk_shapes_reshaped(m: dict[str, Any]) -> None:
    # both chunks of w read as columns: they cover the tensor once, in the wrong place
    a, b = _chunk(m, "w", [0, 0]), _chunk(m, "w", [2, 0])
    a["entry"]["shape"], b["entry"]["shape"] = [4, 1], [4, 1]
    b["offsets"] = [0, 1]


def _tensor_path(m: dict[str, Any]) -> None:
    # the payload's placeholder of w no longer names a tensor of the index at its path
    next(t for t in m["sharded"]["tensors"] if t["path"] == "['w']")["path"] = "['x']"


DAMAGE: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "chunk checksum": (_chunk_checksum, r"bytes of '.*' .*have xxh3_128 [0-9a-f]+ but the "
                                        r"manifest says"),
    "chunk offset onto another": (_chunk_offset_onto_another, r"overlaps another"),
    "chunk offsets swapped": (_chunk_offsets_swapped, r"have xxh3_128 [0-9a-f]+ but the "
                                                      r"manifest says"),
    "tensor digest": (_tensor_digest, r"sharded tensor \['w'\] does not match its saved digest"),
    "chunks swapped in their tensor": (_chunks_swapped_in_their_tensor,
                                       r"sharded tensor \['w'\] does not match its saved digest"),
    "chunk shape overlapping": (_chunk_shape_overlapping, r"chunks of \['w'\] .*overlap"),
    "chunk shapes reshaped": (_chunk_shapes_reshaped,
                              r"sharded tensor \['w'\] does not match its saved digest"),
    "tensor path": (_tensor_path, r"payload placeholder at \['w'\] names sharded tensor 0"),
}


def _damage(root: Path, change: Callable[[dict[str, Any]], None]) -> None:
    path = root / "step-000000000002" / "manifest.json"
    m = json.loads(path.read_text())
    change(m)
    path.write_text(json.dumps(m))


def _store(root: Path) -> Any:
    from elastic_kit.distributed import DistInfo
    from elastic_kit.store import CheckpointStore

    return CheckpointStore(str(root), keep_last=None, info=DistInfo())


def test_an_undamaged_sharded_checkpoint_verifies_and_prune_keeps_the_newest(
        saved: Path, tmp_path: Path) -> None:
    root = _copy(saved, tmp_path)
    store = _store(root)
    assert [(step, problem) for step, _, problem in store.verify()] == [(1, None), (2, None)]
    assert [i.step for i in store.prune(1)] == [1]
    assert [i.step for i in store.list()] == [2]
    loaded = store.load()
    assert loaded is not None and loaded.step == 2
    assert torch.equal(loaded.state["w"], torch.arange(8.0).reshape(4, 2) + 200)
    assert torch.equal(loaded.state["v"], torch.arange(15.0).reshape(3, 5) - 200)


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_a_damaged_index_fails_verify_and_prune_keeps_the_good_step(
        saved: Path, tmp_path: Path, kind: str) -> None:
    change, reason = DAMAGE[kind]
    root = _copy(saved, tmp_path)
    _damage(root, change)
    store = _store(root)
    got = {step: problem for step, _, problem in store.verify()}
    assert got[1] is None
    assert got[2] is not None, f"{kind}: step 2 verified"
    assert "step-000000000002" in got[2]
    assert re.search(reason, got[2]), got[2]
    # a load agrees: it skips step 2 for step 1
    loaded = store.load()
    assert loaded is not None and loaded.step == 1
    assert torch.equal(loaded.state["w"], torch.arange(8.0).reshape(4, 2) + 100)
    # step 2 is not counted: step 1 is the newest that verifies and stays (and step 2
    # stays for inspection; with a manifest that does not even validate, it is not
    # listed as a checkpoint)
    assert store.prune(1) == []
    assert _steps(root) == ["step-000000000001", "step-000000000002"]
    assert [i.step for i in store.list()][:1] == [1]


def test_the_cli_names_the_damaged_step_and_why(saved: Path, tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    from elastic_kit.cli import EXIT_CORRUPT, EXIT_OK, main

    root = _copy(saved, tmp_path)
    _damage(root, _chunk_checksum)
    assert main(["verify", str(root)]) == EXIT_CORRUPT
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("OK       step 1  ")
    assert out[1].startswith("CORRUPT  step 2  ") and "but the manifest says" in out[1]
    assert out[-1] == "1 ok, 1 corrupt or incomplete (skipped by load)"
    assert main(["prune", str(root), "--keep", "1"]) == EXIT_OK
    assert "kept 2 checkpoint(s)" in capsys.readouterr().out
    assert _steps(root) == ["step-000000000001", "step-000000000002"]


def _steps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("step-"))
