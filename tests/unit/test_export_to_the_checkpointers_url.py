"""``if rank == 0: ek.save_checkpoint(state, url, step=step)`` beside a Checkpointer of
the same URL (a ported script's own export, pointed at the checkpoint directory): the
two saves of one step, in one process, are a re-save of that step. The second one to
commit failed with "committed by another writer ... (two jobs, or a stale process of
an earlier restart)", or with a raw ENOTEMPTY from the rename, and crashed training at
every epoch's end."""

from __future__ import annotations

import threading
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import elastic_kit as ek


def test_an_export_to_the_checkpointers_url_resaves_the_step(tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ds = TensorDataset(torch.randn(64, 64), torch.randint(10, (64,)))
    sampler = ek.ElasticDistributedSampler(ds, num_replicas=1, rank=0)
    loader = DataLoader(ds, batch_size=16, sampler=sampler)
    state = ek.TrainState(model, opt, sampler=sampler)
    with ek.Checkpointer(state, url, handle_signals=False, heartbeat_timeout=0) as ckpt:
        for epoch in range(ckpt.restore(), 3):
            sampler.set_epoch(epoch)
            for x, y in loader:
                loss = nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
                ckpt.step(len(x))
            ckpt.end_epoch()                 # a non-blocking save of the epoch's end
            ek.save_checkpoint(state, url, step=state.step)   # the script's own export
    steps = [i.step for i in ek.CheckpointStore(url).list()]
    assert steps == [4, 8, 12]
    loaded = ek.load_checkpoint(None, url)
    assert loaded.step == 12
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state["model"][k], v), k


def test_two_stores_of_one_process_committing_one_step_at_once_both_succeed(
        tmp_path: Path) -> None:
    url = str(tmp_path / "ck")
    errors: list[BaseException] = []
    go = threading.Barrier(4)

    def save(v: float) -> None:
        try:
            go.wait()
            ek.CheckpointStore(url).save({"w": torch.full((1 << 16,), v)}, step=5)
        except BaseException as e:
            errors.append(e)

    for _ in range(5):
        threads = [threading.Thread(target=save, args=(float(i),)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        w = ek.CheckpointStore(url).load().state["w"]
        assert w.unique().numel() == 1 and float(w[0]) in (0.0, 1.0, 2.0, 3.0)
    assert [i.step for i in ek.CheckpointStore(url).list()] == [5]
    assert [p for p in Path(url).iterdir() if p.name.startswith(".tmp")] == []


def test_a_step_committed_by_another_process_just_before_the_rename_is_the_conflict(
        tmp_path: Path, monkeypatch) -> None:
    """Between the check for a leftover and the rename into place, another process (a
    second job on the URL) commits the step: the save fails naming the conflict, and
    that commit is kept. The rename's raw ENOTEMPTY escaped."""
    import shutil

    from elastic_kit.errors import CheckpointConflictError
    from elastic_kit.store._backend_local import LocalBackend

    other = tmp_path / "other"
    ek.CheckpointStore(str(other)).save({"w": torch.full((4,), 7.0)}, step=3)
    url = tmp_path / "ck"
    move = LocalBackend._move_leftover

    def then_the_other_process_commits(self, directory: str):
        moved = move(self, directory)
        if not Path(directory).exists():
            shutil.copytree(other / "step-000000000003", directory)
        return moved

    monkeypatch.setattr(LocalBackend, "_move_leftover", then_the_other_process_commits)
    store = ek.CheckpointStore(str(url))
    try:
        store.save({"w": torch.zeros(4)}, step=3)
    except CheckpointConflictError as e:
        assert "step-000000000003 was committed by another writer" in str(e)
    else:
        raise AssertionError("the save did not fail")
    monkeypatch.undo()
    assert torch.equal(ek.CheckpointStore(str(url)).load().state["w"], torch.full((4,), 7.0))
    assert [p.name for p in url.iterdir() if p.name.startswith(".tmp")] == []


def test_a_commit_never_waits_for_another_step_directorys(tmp_path: Path) -> None:
    """The commit lock is one per step directory: a save of another step (a second
    store of the process: a node-local copy, an export) goes on while a commit is held
    up in its write (a slow upload). Striped locks (64) made one such pair in 64 wait
    for the whole write; the directories here are chosen to share a stripe."""
    import zlib

    import fsspec

    from elastic_kit.testing import FaultFileSystem

    url = str(tmp_path / "ck")
    slow = ek.CheckpointStore(url)
    root = slow._layout.dir_of(1).path[: -len("step-000000000001")]

    def stripe(step: int) -> int:
        return zlib.crc32(f"{root}step-{step:012d}".encode()) % 64

    other = next(s for s in range(2, 10_000) if stripe(s) == stripe(1))
    held, release = threading.Event(), threading.Event()
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("open", match="step-000000000001", mode="wb",
            before=lambda _: (held.set(), release.wait(60)))
    slow = ek.CheckpointStore(url, filesystem=ffs)
    first = threading.Thread(target=slow.save, args=({"w": torch.ones(8)},),
                             kwargs={"step": 1})
    first.start()
    try:
        assert held.wait(30)
        second = threading.Thread(target=ek.CheckpointStore(url).save,
                                  args=({"w": torch.zeros(8)},), kwargs={"step": other})
        second.start()
        second.join(30)
        assert not second.is_alive(), "the other step's commit waited for the held one"
    finally:
        release.set()
        first.join(60)
    assert [i.step for i in ek.CheckpointStore(url).list()] == [1, other]


def test_an_export_to_the_checkpointers_url_deletes_none_of_its_checkpoints(
        tmp_path: Path) -> None:
    """The export's temporary store kept the store's default three and deleted the
    checkpointer's others at every export (a checkpointer that keeps them all, or six,
    kept three). A function-form save deletes nothing unless given ``keep_last``."""
    url = str(tmp_path / "ck")
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = ek.TrainState(model, opt)
    with ek.Checkpointer(state, url, every_steps=1, keep_last=None, snapshot_every=0,
                         handle_signals=False, heartbeat_timeout=0) as ckpt:
        ckpt.restore()
        for _ in range(2):
            for _ in range(4):
                model(torch.randn(3, 4)).sum().backward()
                opt.step()
                opt.zero_grad()
                ckpt.step(3)
            ckpt.end_epoch()
            ek.save_checkpoint(state, url, step=state.step)
    assert [i.step for i in ek.CheckpointStore(url).list()] == list(range(1, 9))
    # asked to, it prunes as a store does
    ek.save_checkpoint({"w": torch.zeros(2)}, url, step=9, keep_last=2)
    assert [i.step for i in ek.CheckpointStore(url).list()] == [8, 9]
