"""The CheckpointStore contract: one test class run against every storage backend.

:class:`StoreContract` (fsspec ``abstract`` tests style) holds the tests; each
``Test<Backend>`` subclass, in the tier that fits its backend, only says where the
store lives (fixture ``target``): local paths and ``memory://`` in
``tests/unit/test_checkpoint_store.py``, ``s3://`` on a real moto server in
``tests/multiprocess/test_store_s3.py``.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Callable

import pytest
import torch

from elastic_kit.store import MANIFEST_NAME, CheckpointStore, step_dir_name
from elastic_kit.store._manifest import PAYLOAD_NAME

LOG = "elastic_kit.store"


def make_state(step: int, n: int = 1000) -> dict[str, Any]:
    """A small TrainState-like nested state whose every value depends on ``step``."""
    return {
        "model": {"w": torch.full((n,), float(step)), "b": torch.arange(4) + step},
        "optimizer": {"state": {0: {"exp_avg": torch.ones(3) * step}},
                      "param_groups": [{"lr": 0.1 * step, "params": [0]}]},
        "sampler": {"epoch": step // 10, "consumed": step * 32, "seed": 0},
        "rng": {"torch": torch.get_rng_state(), "python": (3, (1, 2), None)},
        "flags": [True, None, "x", 2.5, b"raw"],
        "half": torch.ones(2, dtype=torch.bfloat16) * step,
    }


def assert_state_is(state: dict[str, Any], step: int, n: int = 1000) -> None:
    assert torch.equal(state["model"]["w"], torch.full((n,), float(step)))
    assert state["model"]["b"].tolist() == [step, step + 1, step + 2, step + 3]
    assert state["optimizer"]["param_groups"][0]["lr"] == pytest.approx(0.1 * step)
    assert state["sampler"] == {"epoch": step // 10, "consumed": step * 32, "seed": 0}
    assert state["rng"]["python"] == (3, (1, 2), None)
    assert state["flags"] == [True, None, "x", 2.5, b"raw"]
    assert state["half"].dtype == torch.bfloat16


def _truncate(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _flip(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0xFF
    return bytes(b)


def _damage_newest(store: CheckpointStore, damage: str) -> None:
    """Damage the newest checkpoint of ``store`` one way (a name of the parameters)."""
    info = store.list()[-1]
    newest = info.path
    fs, manifest = store.fs, f"{newest}/{MANIFEST_NAME}"
    payload = f"{newest}/{info.manifest.payload}"  # fresh per save on an object store
    if damage == "truncate":
        fs.pipe_file(payload, _truncate(fs.cat_file(payload)))
    elif damage == "flip":
        fs.pipe_file(payload, _flip(fs.cat_file(payload)))
    elif damage == "no_manifest":
        fs.rm(manifest)
    elif damage == "no_payload":
        fs.rm(payload)
    elif damage == "bad_manifest":
        fs.pipe_file(manifest, b'{"format": "elastic_kit.checkpoint/1", "step": ')
    elif damage == "newer_format":
        fs.pipe_file(manifest, json.dumps({"format": "elastic_kit.checkpoint/99",
                                           "step": info.step}).encode())
    else:  # pragma: no cover - a test's typo
        raise ValueError(damage)


class StoreContract:
    """The behaviour every backend must show. Subclasses provide the ``target`` fixture."""

    @pytest.fixture
    def target(self) -> tuple[str, dict[str, Any] | None]:  # pragma: no cover - overridden
        raise NotImplementedError

    @pytest.fixture
    def make(self, target: tuple[str, dict[str, Any] | None]) -> Callable[..., CheckpointStore]:
        url, opts = target
        return lambda **kw: CheckpointStore(url, storage_options=opts, **kw)

    # ---------------------------------------------------------------- basics
    def test_empty_store_loads_none_and_lists_nothing(self, make):
        store = make()
        assert store.load() is None
        assert store.list() == []
        assert store.latest_step() is None

    def test_roundtrip_keeps_nested_state_and_metadata(self, make):
        store = make()
        store.save(make_state(7), step=7, metadata={"epoch": 3, "world_size": 2})
        loaded = make().load()  # a fresh store object sees the commit
        assert loaded is not None and loaded.step == 7
        assert_state_is(loaded.state, 7)
        assert loaded.metadata == {"epoch": 3, "world_size": 2}
        assert loaded.path.rstrip("/").endswith(step_dir_name(7))
        (info,) = store.list()
        assert (info.step, info.epoch, info.metadata["world_size"]) == (7, 3, 2)
        assert info.size_bytes > 4000 and info.time > 0

    def test_retention_keeps_newest_k_oldest_first(self, make):
        store = make(keep_last=2)
        for step in (1, 5, 9, 12):
            store.save(make_state(step, n=10), step=step)
        assert [i.step for i in store.list()] == [9, 12]
        assert store.latest_step() == 12
        assert_state_is(store.load().state, 12, n=10)

    @pytest.mark.parametrize("name,sibling", [("run[1]", "run1"), ("ru?2", "run2"),
                                              ("r*", "rx")])
    def test_retention_in_a_root_named_with_glob_characters_deletes_only_its_own(
            self, target, name, sibling):
        """fsspec's ``rm`` expands ``[``, ``*`` and ``?``: a store's retention must not
        delete another run's steps that its name matches as a pattern, nor leave its
        own old payload behind."""
        url, opts = target
        other = CheckpointStore(f"{url}/{sibling}", storage_options=opts, keep_last=None)
        other.save(make_state(100, n=10), step=1)
        mine = CheckpointStore(f"{url}/{name}", storage_options=opts, keep_last=1)
        mine.save(make_state(1, n=10), step=1)
        mine.save(make_state(2, n=10), step=2)  # retention removes mine's step 1
        mine.prune(1)
        assert [i.step for i in mine.list()] == [2]
        assert [i.step for i in other.list()] == [1]
        assert_state_is(other.load().state, 100, n=10)
        left = [p for p in mine.fs.find(mine.root) if step_dir_name(1) in p]
        assert left == []

    def test_never_deletes_the_checkpoint_just_written(self, make):
        store = make(keep_last=1)
        store.save(make_state(20, n=10), step=20)
        store.save(make_state(3, n=10), step=3)  # an older step, e.g. after a rollback
        # kept, and so is the newer one: retention counts from the newest step, and
        # no save deletes a step newer than its own
        assert [i.step for i in store.list()] == [3, 20]
        assert store.load().step == 20

    def test_resaving_a_step_replaces_it(self, make):
        store = make()
        store.save(make_state(4, n=10), step=4)
        store.save(make_state(5, n=10), step=4)
        assert [i.step for i in store.list()] == [4]
        assert store.load().state["model"]["b"].tolist() == [5, 6, 7, 8]

    def test_nonblocking_save_writes_the_state_as_it_was_at_save_time(self, make):
        store = make()
        state = make_state(1)
        store.save(state, step=1, blocking=False)
        state["model"]["w"].fill_(-1.0)  # training goes on and mutates the tensors
        state["model"]["b"].zero_()
        store.wait()
        assert_state_is(store.load().state, 1)
        store.save(make_state(2, n=10), step=2, blocking=False)
        store.close()
        assert [i.step for i in store.list()] == [1, 2]

    def test_copy_later_tensors_are_copied_in_the_background_before_wait_staged(
            self, make, monkeypatch):
        from elastic_kit.store import _store as store_mod

        gate = threading.Event()
        real_copy = store_mod.copy_deferred

        def gated_copy(pairs, after=None):  # the copy starts only when the test allows it
            assert gate.wait(30)
            real_copy(pairs, after)

        monkeypatch.setattr(store_mod, "copy_deferred", gated_copy)
        store = make()
        state = make_state(1)
        w = state["model"]["w"]
        store.save(state, step=1, blocking=False, copy_later=[w])
        # Not in copy_later: staged inside save(), so it may change at once.
        state["model"]["b"].zero_()
        staged = threading.Thread(target=store.wait_staged)
        staged.start()
        staged.join(0.2)
        assert staged.is_alive()  # wait_staged blocks until the deferred copy ran
        gate.set()
        staged.join(30)
        assert not staged.is_alive()
        w.fill_(-1.0)  # allowed once wait_staged() returned
        store.wait()
        assert_state_is(store.load().state, 1)

    def test_wait_staged_without_a_deferred_copy_returns_at_once(self, make):
        store = make()
        store.wait_staged()  # nothing in flight
        store.save(make_state(1), step=1, blocking=False)
        store.wait_staged()  # everything was copied inside save()
        store.close()
        assert_state_is(store.load().state, 1)

    # ---------------------------------------------------------------- damage
    @pytest.mark.parametrize("damage, reason", [
        ("truncate", "truncated"),
        ("flip", "corrupt payload"),
        ("no_manifest", "manifest.json is missing"),
        ("no_payload", "does not exist"),
        ("bad_manifest", "manifest does not parse"),
    ])
    def test_damaged_newest_falls_back_to_previous_with_a_logged_reason(
            self, make, caplog, damage, reason):
        store = make(keep_last=5)
        store.save(make_state(1), step=1)
        store.save(make_state(2), step=2)
        _damage_newest(store, damage)
        with caplog.at_level(logging.WARNING, logger=LOG):
            loaded = make().load()
        assert loaded is not None and loaded.step == 1
        assert_state_is(loaded.state, 1)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert any(step_dir_name(2) in m and reason in m for m in warned), warned
        problems = {step: p for step, _, p in store.verify()}
        assert problems[1] is None and reason in problems[2]

    @pytest.mark.parametrize("damage", ["truncate", "flip", "no_manifest", "no_payload",
                                        "bad_manifest", "newer_format"])
    def test_a_damaged_step_is_replaced_by_the_next_save_of_that_step(self, make, damage):
        """A job that resumed from the step before a damaged one reaches that step again
        and saves it: the save replaces the damage (a manifest that does not validate
        is no other writer's commit)."""
        store = make(keep_last=5)
        store.save(make_state(1), step=1)
        store.save(make_state(0), step=2)
        _damage_newest(store, damage)
        resumed = make(keep_last=5)
        assert resumed.load().step == 1
        resumed.save(make_state(2), step=2)
        resumed.wait()
        loaded = make().load()
        assert loaded is not None and loaded.step == 2
        assert_state_is(loaded.state, 2)
        assert {step: p for step, _, p in make().verify()} == {1: None, 2: None}

    def test_retention_does_not_count_a_step_a_load_found_corrupt(self, make):
        """keep_last=2 after a load skipped a damaged step 2: the good step 1 stays
        beside the new step 3 (the damaged one is not counted, and stays while newer
        than the oldest kept step); once two newer steps load, both old ones go."""
        store = make(keep_last=2)
        store.save(make_state(1), step=1)
        store.save(make_state(2), step=2)
        _damage_newest(store, "truncate")
        resumed = make(keep_last=2)
        assert resumed.load().step == 1
        resumed.save(make_state(3), step=3)
        resumed.wait()
        assert {step: p is None for step, _, p in make().verify()} == {
            1: True, 2: False, 3: True}
        resumed.save(make_state(4), step=4)
        resumed.wait()
        assert [(step, p) for step, _, p in make().verify()] == [(3, None), (4, None)]

    def test_unfinished_save_is_invisible_and_cleaned_by_the_next_save(self, make):
        store = make(keep_last=5, stale_after_s=0)  # leftovers older than 0 s are stale
        store.save(make_state(1, n=10), step=1)
        # what an object-store save killed before its manifest leaves behind
        partial = f"{store.root}/{step_dir_name(2)}"
        store.fs.makedirs(partial, exist_ok=True)
        store.fs.pipe_file(f"{partial}/{PAYLOAD_NAME}", b"partial")
        assert store.load().step == 1
        assert [i.step for i in store.list()] == [1]
        store.save(make_state(3, n=10), step=3)
        store.wait()  # retention and cleaning run beside training after a blocking save
        steps = [d for d in store.fs.ls(store.root, detail=False) if "step-" in d]
        assert not any(step_dir_name(2) in d for d in steps), steps
