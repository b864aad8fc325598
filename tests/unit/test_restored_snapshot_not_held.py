"""Nothing of a snapshot file stays mapped after ``Checkpointer.restore()``: a tensor
the state keeps as given (a plain tensor in ``extras``, a second optimizer's state
there) held the whole file's pages, one state's size of shared memory, for the rest
of the run."""

from __future__ import annotations

from pathlib import Path

import torch

import elastic_kit as ek


def _run(root: Path, seed: int) -> tuple[ek.TrainState, ek.Checkpointer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ema = torch.nn.Parameter(torch.zeros(64))
    second = torch.optim.SGD([ema], lr=0.1, momentum=0.9)
    state = ek.TrainState(model, opt, extras={"ema_norm": torch.zeros(256), "opt2": second,
                                              "ema": ema})
    return state, ek.Checkpointer(state, str(root), handle_signals=False, snapshot_every=1,
                                  info=ek.DistInfo())


def _train(state: ek.TrainState, ckpt: ek.Checkpointer, steps: int) -> None:
    for _ in range(steps):
        state.model(torch.randn(4, 64)).square().mean().backward()
        state.extras["ema"].grad = torch.ones(64)
        state.optimizer.step()
        state.extras["opt2"].step()
        state.optimizer.zero_grad()
        state.extras["ema_norm"] += 1
        ckpt.step(4)


def _momentum(state: ek.TrainState) -> torch.Tensor:
    opt2 = state.extras["opt2"]
    return opt2.state[opt2.param_groups[0]["params"][0]]["momentum_buffer"]


def _mapped_snapshot_files() -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.split(None, 5)[-1].strip() for line in f if "tensors.bin" in line]


def test_nothing_of_the_restored_snapshot_file_stays_mapped(shm: str, tmp_path: Path) -> None:
    state, ckpt = _run(tmp_path / "ck", seed=0)
    ckpt.restore()
    _train(state, ckpt, 3)
    assert ckpt.snapshots is not None and ckpt.snapshots.wait(timeout=60)
    momentum = _momentum(state).clone()
    ckpt.abandon()  # as a failing worker ends: its snapshots stay

    state, ckpt = _run(tmp_path / "ck", seed=1)
    try:
        ckpt.restore()
        assert (ckpt.restored_from, ckpt.restored_step) == ("memory", 3)
        assert _mapped_snapshot_files() == []
        assert torch.equal(state.extras["ema_norm"], torch.full((256,), 3.0))
        assert torch.equal(_momentum(state), momentum)
    finally:
        ckpt.close()


def test_a_module_in_extras_is_not_copied_twice() -> None:
    """A module in extras (an EMA) copies the restored tensors into its own, as the
    model does: copying them out of the file first cost its size in peak memory."""
    from elastic_kit.checkpointer._restore import own_kept_state

    ema = torch.nn.Linear(4, 4)
    model = torch.nn.Linear(4, 4)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1),
                          extras={"ema": ema, "norm": torch.zeros(3)})
    sd = state.state_dict()
    ema_weight, norm = sd["extras"]["ema"]["weight"], sd["extras"]["norm"]
    own_kept_state(state, sd)
    assert sd["extras"]["ema"]["weight"] is ema_weight  # left for the module to copy
    assert sd["extras"]["norm"] is not norm and torch.equal(sd["extras"]["norm"], norm)
