"""The relay's plan and budget: the last bytes of a snapshot's side-stream copies go
through a device buffer, every byte still lands where it belongs, and the budget
grows by what the device was measured to wait for.

The CPU stands in for the device (the plan is the same; ``tests/gpu`` runs the
streams)."""

from __future__ import annotations

import pytest
import torch

from elastic_kit.snapshot._relay import MAX_BYTES_ENV, DeviceRelay, max_bytes_from_env


def _pairs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    srcs = [torch.randn(10, 10, generator=g), torch.arange(50, dtype=torch.int64),
            torch.randn(8, 8, generator=g).t(),          # not contiguous: always direct
            torch.rand(30, generator=g).to(torch.bfloat16), torch.empty(0)]
    return [(s, torch.zeros_like(s)) for s in srcs]


def _run(plan) -> None:  # the side stream's order, synchronously
    for src, piece in plan.to_relay:
        piece.copy_(src)
    for src, dst in plan.direct:
        dst.copy_(src)
    for piece, dst in plan.from_relay:
        dst.copy_(piece)


@pytest.mark.parametrize("budget", [0, 1, 60, 460, 10_000])
def test_every_byte_lands_whatever_the_budget(budget: int) -> None:
    pairs = _pairs()
    relay = DeviceRelay()
    relay.budget = budget
    plan = relay.plan(pairs)
    _run(plan)
    for src, dst in pairs:
        assert torch.equal(dst.view(torch.uint8) if dst.is_contiguous() else dst,
                           src.view(torch.uint8) if src.is_contiguous() else src)
    relayed = sum(p.numel() for p, _ in plan.from_relay)
    contiguous = 400 + 400 + 60  # the float32, int64 and bfloat16 tensors
    assert relayed == min(budget, contiguous)
    assert plan.direct_bytes == 400 + 400 + 256 + 60 - relayed
    assert relay.nbytes >= relayed


def test_the_last_bytes_are_relayed_and_a_tensor_may_be_cut() -> None:
    pairs = _pairs()
    relay = DeviceRelay()
    relay.budget = 100  # the bfloat16 tensor's 60 bytes and the int64 one's last 40
    plan = relay.plan(pairs)
    assert [p.numel() for p, _ in plan.from_relay] == [40, 60]
    ints = pairs[1][0].view(torch.uint8)
    assert torch.equal(plan.to_relay[0][0], ints[360:])
    # the int64 tensor's first 360 bytes stay direct, in copy order
    assert [s.numel() * s.element_size() for s, _ in plan.direct] == [400, 360, 256, 0]


def test_the_budget_grows_by_the_measured_wait_with_a_margin_and_never_shrinks() -> None:
    relay = DeviceRelay()
    relay.learn(stall_s=0.010, direct_bytes=1_000_000_000, copy_s=0.100)  # 100 MB short
    assert relay.budget == 128 << 20          # 125 MB, rounded up to 64 MiB grains
    relay.learn(stall_s=0.0, direct_bytes=1_000_000_000, copy_s=0.100)
    relay.learn(stall_s=0.0001, direct_bytes=1_000_000_000, copy_s=0.100)  # noise
    assert relay.budget == 128 << 20
    relay.learn(stall_s=0.004, direct_bytes=870_000_000, copy_s=0.087)    # 50 MB more
    assert relay.budget == 192 << 20


def test_a_cap_bounds_the_budget_and_zero_turns_the_relay_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    capped = DeviceRelay(max_bytes=100 << 20)
    capped.learn(stall_s=0.1, direct_bytes=1_000_000_000, copy_s=0.1)
    assert capped.budget == 100 << 20
    off = DeviceRelay(max_bytes=0)
    off.learn(stall_s=0.1, direct_bytes=1_000_000_000, copy_s=0.1)
    assert off.budget == 0 and off.plan(_pairs()).from_relay == []
    monkeypatch.setenv(MAX_BYTES_ENV, "0")
    assert max_bytes_from_env() == 0
    monkeypatch.setenv(MAX_BYTES_ENV, "1G")
    with pytest.raises(ValueError, match=f"{MAX_BYTES_ENV}='1G' must be a whole number"):
        max_bytes_from_env()
    monkeypatch.setenv(MAX_BYTES_ENV, "-1")
    with pytest.raises(ValueError, match=">= 0"):
        max_bytes_from_env()
    monkeypatch.delenv(MAX_BYTES_ENV)
    assert max_bytes_from_env() is None


def test_the_budget_never_exceeds_the_copies_it_relays() -> None:
    relay = DeviceRelay()
    relay.budget = 10 << 30
    plan = relay.plan(_pairs())
    assert relay.budget == 64 << 20          # 860 bytes, rounded up to one grain
    assert sum(p.numel() for p, _ in plan.from_relay) == 860
