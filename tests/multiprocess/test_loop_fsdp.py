"""ElasticLoop with an FSDP2 model (``fully_shard``, gloo, two ranks): FSDP2 averages
the gradients itself, so the loop says nothing of DDP (it warned "gradients are not
averaged over ranks (use wrap_ddp)" on every such run), and its training with
gradient accumulation matches one rank's to float tolerance."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from elastic_kit.testing import spawn_multi_process
from tests.log_lines import LogLines

pytestmark = pytest.mark.timeout(180)

N = 24


def _run() -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    import elastic_kit as ek

    said = LogLines(logging.WARNING)
    logging.getLogger("elastic_kit").addHandler(said)
    info = ek.init_distributed()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    if info.world_size > 1:
        fully_shard(model)
    g = torch.Generator().manual_seed(1)
    xs, ys = torch.randn(N, 4, generator=g), torch.randn(N, 1, generator=g)
    data = torch.utils.data.TensorDataset(xs, ys)
    state = ek.TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))

    def loss_fn(m: nn.Module, batch: Any) -> torch.Tensor:
        x, y = batch
        return (m(x) - y).square().squeeze(1)

    loop = ek.ElasticLoop(state, data, loss_fn=loss_fn, config=ek.LoopConfig(
        epochs=2, global_batch_size=8, micro_batch_size=2, seed=3))
    loop.run()
    # numpy: a tensor would be shared by descriptor with the exiting process
    params = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().numpy().copy()
              for k, v in model.state_dict().items()}
    return {"params": params, "said": said.lines}


def test_fsdp2_under_the_loop_is_not_warned_about_and_matches_one_rank() -> None:
    (one,) = spawn_multi_process(1, _run)
    two = spawn_multi_process(2, _run)
    for r in two:
        assert not [s for s in r["said"] if "not DistributedDataParallel" in s], r["said"]
        for k, v in one["params"].items():
            np.testing.assert_allclose(r["params"][k], v, rtol=1e-5, atol=1e-6, err_msg=k)
