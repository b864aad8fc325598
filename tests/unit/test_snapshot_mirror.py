"""The device's mirror of a snapshot file: the runs it copies to the file, every
byte it fills landing where the file has it (and no other byte touched), and the
limits on its memory.

The CPU stands in for the device (the same views, multi-tensor copies and runs,
done at once); ``tests/gpu`` runs the streams."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from elastic_kit.snapshot._mirror import DeviceMirror, mirror_runs
from elastic_kit.store import plan_flat, split_state, tensor_views


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "model": {"w": torch.randn(33, 7, generator=g), "n": torch.arange(5),
                  "half": torch.rand(9, generator=g).to(torch.bfloat16)},
        "rng": torch.randint(0, 256, (40,), dtype=torch.uint8, generator=g),
        "empty": torch.empty(0, 3),
        "optim": {"m": torch.randn(8, 8, generator=g).t(),       # not contiguous
                  "flag": torch.rand(13, generator=g) > 0.5,
                  "step": torch.tensor(3.0)},
    }


def _file(state: dict[str, Any]) -> tuple[list[tuple[str, torch.Tensor]], Any, torch.Tensor,
                                         list[torch.Tensor]]:
    """``state``'s tensors, their plan, a mapping of it filled with 7s and its views."""
    _, items = split_state(state)
    plan = plan_flat(items)
    mapped = torch.full((plan.size,), 7, dtype=torch.uint8)
    return items, plan, mapped, tensor_views(mapped, plan)


def test_runs_join_neighbours_over_padding_and_end_at_a_tensor_not_mirrored() -> None:
    _, items = split_state(_state())
    plan = plan_flat(items)
    keys = list(plan.keys)
    on = {"['model']['w']", "['model']['n']", "['model']['half']", "['optim']['m']",
          "['optim']['flag']", "['optim']['step']"}
    mirrored = [k in on for k in keys]
    runs = mirror_runs(plan, mirrored)
    i = {k: n for n, k in enumerate(keys)}

    def end(k: str) -> int:
        t = items[i[k]][1]
        return plan.offsets[i[k]] + t.numel() * t.element_size()

    # the rng (not mirrored) ends the first run; the empty tensor does not matter
    assert runs == [(plan.offsets[0], end("['model']['half']")),
                    (plan.offsets[i["['optim']['m']"]], end("['optim']['step']"))]
    assert mirror_runs(plan, [False] * len(keys)) == []
    assert mirror_runs(plan, [True] * len(keys)) == [(0, end("['optim']['step']"))]


@pytest.mark.parametrize("skip", [(), ("['rng']",), ("['model']['n']", "['optim']['flag']")])
def test_every_mirrored_byte_lands_and_no_other_is_touched(skip: tuple[str, ...]) -> None:
    state = _state()
    items, plan, mapped, views = _file(state)
    mirror = DeviceMirror()
    assert mirror.views(plan, torch.device("cpu")) is not None
    assert mirror.nbytes == plan.size
    pairs = [(n, t) for n, (k, t) in enumerate(items) if k not in skip and t.numel()]
    for _ in range(2):                               # the second reuses buffer and runs
        mapped.fill_(7)
        done = mirror.copy(plan, mapped, pairs)
        assert done.seconds() is None                # no device events on the CPU
        for (key, t), view in zip(items, views):
            if key in skip:
                assert bool((view.reshape(-1).view(torch.uint8) == 7).all()), key
            else:
                assert torch.equal(view, t), key
    # padding inside a run is the mirror's zeros; outside every run it is untouched
    covered = torch.zeros(plan.size, dtype=torch.bool)
    for a, b in mirror_runs(plan, [k not in skip for k, _ in items]):
        covered[a:b] = True
    tensor_bytes = torch.zeros(plan.size, dtype=torch.bool)
    for (_, t), off in zip(items, plan.offsets):
        tensor_bytes[off:off + t.numel() * t.element_size()] = True
    padding = ~tensor_bytes
    assert bool((mapped[padding & covered] == 0).all())
    assert bool((mapped[padding & ~covered] == 7).all())


def test_the_mirror_is_made_only_within_its_limits_and_once_per_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import elastic_kit.snapshot._mirror as mirror_module

    _, items = split_state(_state())
    plan = plan_flat(items)
    cpu = torch.device("cpu")
    assert DeviceMirror(max_bytes=0).views(plan, cpu) is None
    assert DeviceMirror(max_bytes=plan.size - 1).views(plan, cpu) is None
    assert DeviceMirror(max_bytes=plan.size).views(plan, cpu) is not None

    asked: list[int] = []
    reserve = mirror_module.RESERVE_MIN_BYTES

    def memory(device: torch.device) -> tuple[int, int]:
        asked.append(1)
        return reserve + plan.size - 1, 1 << 40       # one byte short beside the reserve
    monkeypatch.setattr(mirror_module, "device_memory", memory)
    short = DeviceMirror()
    assert short.views(plan, cpu) is None and short.views(plan, cpu) is None
    assert len(asked) == 1                            # a refused layout is not asked again
    assert DeviceMirror(max_fraction=plan.size / (1 << 40) / 2).views(plan, cpu) is None

    def roomy(device: torch.device) -> tuple[int, int]:
        asked.append(1)
        return 1 << 40, 1 << 41
    monkeypatch.setattr(mirror_module, "device_memory", roomy)
    asked.clear()
    mirror = DeviceMirror()
    first = mirror.views(plan, cpu)
    assert first is not None and mirror.views(plan, cpu) is first and len(asked) == 1
    alike = plan_flat(items)                          # the other file's plan: equal, not it
    assert alike is not plan and mirror.views(alike, cpu) is first and len(asked) == 1
    mirror.copy(alike, torch.zeros(plan.size, dtype=torch.uint8), [(0, items[0][1])])
    other = plan_flat(items[:-1])
    assert mirror.views(other, cpu) is not None and mirror.nbytes == other.size
    mirror.close()
    assert mirror.nbytes == 0


def test_staging_sends_the_device_tensors_through_the_mirror_and_the_rest_straight(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Staging into a registered file with a mirror: the tensors on the device (here
    the floating-point ones, the CPU standing in) go through the mirror, the others
    (a generator's state, integer counters) straight into the file; every tensor of
    the file then holds the state as it was staged, nothing is left for later, and
    the file's other bytes are the mirror's zeros or untouched."""
    import elastic_kit.snapshot._staging as staging
    from elastic_kit.snapshot._staging import FileTarget, StagingBuffers, storage_keys

    monkeypatch.setattr(staging, "_mirrorable", lambda t: t.is_floating_point())
    state = _state()
    items, plan, mapped, views = _file(state)
    mirror = DeviceMirror()
    want = [t.clone() for _, t in items]
    # parameters and moments: through the mirror, they are not left for later either
    later = storage_keys([state["model"]["w"], state["optim"]["m"]])
    for _ in range(2):
        mapped.fill_(7)
        staged = StagingBuffers().stage(state, later=later, into=FileTarget(
            plan, views, mapped, pinned=True), mirror=mirror)
        assert staged.into_file and staged.mirrored is not None
        assert staged.staged.is_set() and not staged.deferred
        for (key, _), view, w in zip(items, views, want):
            assert torch.equal(view, w), key
        for (_, t) in items:
            if t.is_floating_point():
                t.add_(1)                              # the next step: not in this one
        assert all(torch.equal(v, w) for v, w in zip(views, want))
        want = [t.clone() for _, t in items]
    assert mirror.nbytes == plan.size
    unpinned = StagingBuffers().stage(state, into=FileTarget(plan, views, mapped), mirror=mirror)
    assert unpinned.into_file and unpinned.mirrored is None   # an unregistered file: as before


def test_a_dtype_the_multi_tensor_copy_lacks_is_copied_on_its_own(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA torch's multi-tensor copy is compiled for some dtypes only ("not
    implemented" for uint16, uint32, uint64, complex32, ...): their tensors are copied
    one by one. The CPU's multi-tensor copy, which takes every dtype, is made as
    strict as CUDA's here."""
    from elastic_kit.snapshot import _mirror

    foreach = torch._foreach_copy_

    def cuda_like(dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        if srcs[0].dtype not in _mirror.FOREACH_DTYPES:
            raise NotImplementedError(f"_foreach_copy_ not implemented for {srcs[0].dtype}")
        foreach(dsts, srcs)

    monkeypatch.setattr(torch, "_foreach_copy_", cuda_like)
    state = _state()
    state["ids"] = torch.arange(11, dtype=torch.int32).to(torch.uint16)
    state["u32"] = torch.arange(6, dtype=torch.int64).to(torch.uint32)
    items, plan, mapped, views = _file(state)
    mirror = DeviceMirror()
    assert mirror.views(plan, torch.device("cpu")) is not None
    mirror.copy(plan, mapped, [(n, t) for n, (_, t) in enumerate(items) if t.numel()])
    for (key, t), view in zip(items, views):
        assert view.dtype == t.dtype and torch.equal(view, t), key
