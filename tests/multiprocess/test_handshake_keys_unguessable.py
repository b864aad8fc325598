"""``load()``'s handshake keys in torchrun's key-value store, which has no
authentication (any local user who reaches its port can read and write keys): in a
group made by ``init_distributed`` they are named after the group's random id, so an
outsider cannot find them to decide the load (write its commit first with an error of
their choosing). In a group the script made itself they count the calls only, as
before (no collective may come before the handshake).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from elastic_kit.testing import spawn_multi_process

#: Where the keys of a group's first ``load()`` would be without the group's id.
GUESSABLE = "elastic_kit/checkpoint/load/1/lead"


def _load_and_look(root: str, own_group: bool) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    import elastic_kit as ek

    if own_group:
        dist.init_process_group("gloo")
    else:
        ek.init_distributed(backend="gloo")
    store = ek.CheckpointStore(root)
    loaded = store.load()
    kv = _get_default_store()
    out = {"step": None if loaded is None else loaded.step,
           "w": None if loaded is None else loaded.state["w"].tolist(),
           "guessable": bool(kv.check([GUESSABLE]))}
    store.close()
    return out


def test_load_handshake_keys_carry_the_groups_random_id(tmp_path: Path) -> None:
    import elastic_kit as ek

    root = str(tmp_path / "ck")
    ek.save_checkpoint({"w": torch.full((3,), 4.0)}, root, step=4)
    got = spawn_multi_process(2, _load_and_look, root, False)
    assert got == [{"step": 4, "w": [4.0] * 3, "guessable": False}] * 2


def test_a_scripts_own_group_still_loads_with_counted_keys(tmp_path: Path) -> None:
    import elastic_kit as ek

    root = str(tmp_path / "ck")
    ek.save_checkpoint({"w": torch.full((3,), 4.0)}, root, step=4)
    got = spawn_multi_process(2, _load_and_look, root, True)
    assert got == [{"step": 4, "w": [4.0] * 3, "guessable": True}] * 2
