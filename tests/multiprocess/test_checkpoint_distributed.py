"""The store on real gloo ranks: node-local broadcast, shared storage, save barriers.

Each rank is its own "node" (``local_world_size=1``) with its own directory
``<root>/node-<node_rank>``, standing in for one local disk per machine.
"""

from __future__ import annotations

import os

import torch

from elastic_kit.store import CheckpointStore
from elastic_kit.distributed import DistInfo, init_distributed
from elastic_kit.testing import spawn_multi_process


def _state(step: int) -> dict:
    return {
        "model": {"w": torch.arange(6.0).reshape(2, 3) * step, "idx": torch.arange(4) + step},
        "mask": torch.tensor([True, False, True]),
        "half": torch.ones(3, dtype=torch.bfloat16) * step,
        "scalar": torch.tensor(float(step)),
        "empty": torch.zeros(0),
        "sampler": {"epoch": 2, "consumed": step * 10},
        "rng": (torch.get_rng_state()[:8], 42),
    }


def _summary(state: dict) -> dict:
    return {
        "w": state["model"]["w"].tolist(), "idx": state["model"]["idx"].tolist(),
        "mask": state["mask"].tolist(), "half": state["half"].float().tolist(),
        "half_dtype": str(state["half"].dtype), "scalar": state["scalar"].item(),
        "empty": tuple(state["empty"].shape), "sampler": state["sampler"],
        "rng": (state["rng"][0].tolist(), state["rng"][1]),
    }


def _job(root: str) -> dict:
    info = init_distributed()
    store = CheckpointStore(root + "/node-{node_rank}", node_local=True, keep_last=3)
    loaded = store.load()
    assert loaded.lacked_locally == (info.rank in (0, 2))
    assert (7 in [i.step for i in store.list()]) == (info.rank == 1)  # load() only reads ...
    assert store.keep_copy(loaded) == (info.rank in (0, 2))  # ... a copy is explicit
    out = {"rank": info.rank, "step": loaded.step, "state": _summary(loaded.state),
           "metadata": loaded.metadata, "path": loaded.path}
    # node-local save: every node's local rank 0 writes its own directory
    store.save(loaded.state, step=8, metadata={"epoch": 3})
    out["after_save"] = [i.step for i in store.list()]
    # shared storage: only rank 0 writes, non-blocking; load broadcasts from rank 0
    shared = CheckpointStore(root + "/shared")
    shared.save({"x": torch.arange(3) + 100 * info.rank}, step=1, blocking=False)
    shared.wait()
    out["shared"] = shared.load().state["x"].tolist()
    shared.close()
    return out


def test_node_local_newest_step_is_broadcast_and_copied_to_nodes_that_lacked_it(tmp_path):
    root = str(tmp_path)
    solo = DistInfo()

    def node(n: int) -> CheckpointStore:
        return CheckpointStore(f"{root}/node-{n}", keep_last=3, info=solo)

    node(0).save(_state(5), step=5, metadata={"epoch": 1})
    node(1).save(_state(5), step=5, metadata={"epoch": 1})
    node(1).save(_state(7), step=7, metadata={"epoch": 2})
    # node 2 holds only a corrupt step 9: it must not win the "newest" vote
    node(2).save(_state(9), step=9)
    payload = os.path.join(node(2).list()[0].path, "state.pt")
    with open(payload, "r+b") as f:
        f.seek(100)
        f.write(b"\x00garbage\x00")

    results = spawn_multi_process(3, _job, root, local_world_size=1, timeout=150)

    expected = _summary(_state(7))
    for r in results:
        assert r["step"] == 7, r
        assert r["state"] == expected
        assert r["metadata"] == {"epoch": 2}
        assert r["path"].startswith(f"{root}/node-{r['rank']}/")
        assert r["shared"] == [0, 1, 2]  # rank 0's state, on every rank
    assert results[0]["state"]["half_dtype"] == "torch.bfloat16"
    # nodes 0 and 2 lacked step 7 and now hold a verified copy; every node saved step 8
    for n in range(3):
        problems = {s: p for s, _, p in node(n).verify()}
        assert problems[7] is None and problems[8] is None, (n, problems)
        assert node(n).load().step == 8
    assert results[0]["after_save"] == [5, 7, 8]
    assert results[2]["after_save"] == [7, 8, 9]  # the corrupt 9 is committed, kept, skipped
    copy = node(2).list()[0]
    assert copy.step == 7 and copy.metadata == {"epoch": 2}
    assert [i.step for i in CheckpointStore(f"{root}/shared", info=solo).list()] == [1]


def _load_to_an_absent_device(root: str) -> tuple[str, str]:
    init_distributed()
    try:
        CheckpointStore(root).load(map_location="cuda:0")  # no rank sees a GPU here
    except Exception as e:
        return type(e).__name__, str(e)
    return "loaded", ""


def test_a_source_ranks_failure_reaches_every_rank_as_what_it_was(tmp_path):
    """The source rank's failure is not a pickled object in the checkpoint: no rank
    may report it as one (UnsafeCheckpointError says "refusing to load")."""
    root = str(tmp_path / "ck")
    CheckpointStore(root, info=DistInfo()).save({"w": torch.ones(2)}, step=3)

    (src_type, _), (peer_type, peer_msg) = spawn_multi_process(
        2, _load_to_an_absent_device, root, local_world_size=1, timeout=120)

    assert src_type == "RuntimeError"
    assert peer_type == "CheckpointError"
    assert "rank 0 could not load checkpoint step 3: RuntimeError" in peer_msg


def _load_views(url: str) -> dict:
    import elastic_kit as ek

    ek.init_distributed()
    state = ek.load_checkpoint(None, url).state
    return {k: v.resolve_conj().resolve_neg().tolist() for k, v in state.items()}


def test_conjugate_and_negative_views_load_on_every_rank(tmp_path):
    """``torch.save`` keeps a complex tensor's conjugate bit (a blocking save writes
    it so): every multi-rank load of such a checkpoint failed in the broadcast
    ("view_as_real doesn't work on unresolved conjugated tensors"), naming no key."""
    import elastic_kit as ek

    z = torch.polar(torch.ones(4), torch.arange(4.0))
    state = {"freqs": z.conj(), "neg": torch.arange(3.0)._neg_view(), "plain": z.clone()}
    url = str(tmp_path / "ck")
    ek.save_checkpoint(state, url, step=1)
    assert ek.load_checkpoint(None, url).state["freqs"].is_conj()  # kept by the file
    want = {k: v.resolve_conj().resolve_neg().tolist() for k, v in state.items()}
    assert spawn_multi_process(2, _load_views, url, timeout=120) == [want, want]
