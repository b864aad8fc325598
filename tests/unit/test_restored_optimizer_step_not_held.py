"""A restore from a snapshot with the parameters off the CPU (on a GPU): torch's
``Optimizer.load_state_dict`` copies the optimizer state to the parameters' device,
except what it keeps as given, a non-fused Adam's ``step`` (on the CPU whatever the
parameters' device) and tensors in the param groups (a tensor ``lr``). Those must
not stay views of the snapshot's mapped file, which they would hold for the rest of
the run (one state's size of shared memory). The meta device stands in for CUDA: any
device other than the CPU takes the same path."""

from __future__ import annotations

import types

import torch

from elastic_kit.checkpointer._restore import own_kept_state


def test_adams_step_and_a_tensor_lr_get_memory_of_their_own() -> None:
    mapped = torch.zeros(1 << 16, dtype=torch.uint8)  # the snapshot file's pages
    p = torch.nn.Parameter(torch.zeros(4, device="meta"))
    opt = torch.optim.Adam([p], lr=torch.tensor(0.01))
    step = mapped[0:4].view(torch.float32).view(())
    lr = mapped[8:12].view(torch.float32).view(())
    avg = mapped[4096:4112].view(torch.float32)
    group = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    sd = {"model": {}, "optimizer": {
        "state": {0: {"step": step, "exp_avg": avg, "exp_avg_sq": avg}},
        "param_groups": [{**group, "lr": lr, "params": [0]}]}}
    own_kept_state(types.SimpleNamespace(optimizer=opt, extras={}), sd)
    base = mapped.untyped_storage().data_ptr()
    kept = sd["optimizer"]
    assert kept["state"][0]["step"].untyped_storage().data_ptr() != base
    assert kept["param_groups"][0]["lr"].untyped_storage().data_ptr() != base
    assert kept["state"][0]["step"].item() == 0.0 and kept["param_groups"][0]["lr"].item() == 0.0
    # what torch copies to the parameters' device anyway is not copied here first
    assert kept["state"][0]["exp_avg"] is avg
