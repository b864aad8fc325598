"""Where ``ek.wrap_ddp`` spends a new worker's start: one rank (NCCL on CUDA, gloo on
the CPU), the snapshot benchmark's model (``--layers`` x ``Linear(d, d)`` + GELU).

Measured in one fresh process, in order: the process group's start and first
all-reduce, the model's move to the device, ``ek.wrap_ddp`` of it, cold (its own work
is the move and the wrap: the rest is DDP's constructor and what it imports), then a
second wrap of another model of the same size (everything imported, the group warm).
The cold wrap and the plain DDP constructor are profiled by function (cumulative
seconds, the top entries).

The baseline is the plain ``DistributedDataParallel(model, device_ids=[i])`` of the
same model, constructed after it in the same process: ``ratio_wrap_vs_plain_ddp``.

Usage::

    python benchmarks/bench_wrap_ddp.py --device cuda          # 24 x 4096: 403 M parameters
    python benchmarks/bench_wrap_ddp.py                        # CPU: 4 x 1024
    python benchmarks/bench_wrap_ddp.py --smoke                # seconds, for the test suite
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys
import time
from pathlib import Path

t_start = time.perf_counter()
import torch  # noqa: E402

t_torch = time.perf_counter() - t_start

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _common  # noqa: E402

import elastic_kit as ek  # noqa: E402
from elastic_kit.testing import free_port, torchrun_env  # noqa: E402


def _model(d: int, layers: int) -> torch.nn.Module:
    blocks: list[torch.nn.Module] = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(d, d), torch.nn.GELU()]
    return torch.nn.Sequential(*blocks)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _print_profile(title: str, prof: cProfile.Profile, n: int) -> None:
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(n)
    print(f"--- {title}, by cumulative time\n{out.getvalue()}")


def main() -> None:
    ap = _common.parser(__doc__)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--layers", type=int, default=None, help="default 24 on CUDA, 4 on CPU")
    ap.add_argument("--d", type=int, default=None, help="default 4096 on CUDA, 1024 on CPU")
    args = ap.parse_args()
    load0 = _common.load_avg()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        ap.error("--device cuda: torch.cuda.is_available() is False")
    layers = args.layers or (1 if args.smoke else 24 if cuda else 4)
    d = args.d or (64 if args.smoke else 4096 if cuda else 1024)
    os.environ.update(torchrun_env(0, 1, free_port()))
    if not cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    phases: dict[str, float] = {"import_torch": t_torch}

    t0 = time.perf_counter()
    info = ek.init_distributed()
    t = torch.ones(1, device=info.device)
    torch.distributed.all_reduce(t)
    _sync(info.device)
    phases["init_and_first_all_reduce"] = time.perf_counter() - t0

    dynamo_before = "torch._dynamo" in sys.modules
    t0 = time.perf_counter()
    model = _model(d, layers)
    phases["model_cpu_init"] = time.perf_counter() - t0
    nparams = sum(p.numel() for p in model.parameters())

    t0 = time.perf_counter()
    model = model.to(info.device)
    _sync(info.device)
    phases["to_device"] = time.perf_counter() - t0

    cold = cProfile.Profile()
    t0 = time.perf_counter()
    cold.enable()
    wrapped = ek.wrap_ddp(model, info=info)
    _sync(info.device)
    cold.disable()
    phases["wrap_ddp_first"] = time.perf_counter() - t0
    del wrapped
    _print_profile("the first wrap_ddp (cold)", cold, 25)

    # warm: a second model, wrapped by us, then plain DDP (the baseline), profiled
    other = _model(d, layers).to(info.device)
    _sync(info.device)
    t0 = time.perf_counter()
    wrapped = ek.wrap_ddp(other, info=info)
    _sync(info.device)
    phases["wrap_ddp_warm"] = time.perf_counter() - t0
    del wrapped
    kw = {"device_ids": [info.device.index]} if cuda else {}
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    plain = torch.nn.parallel.DistributedDataParallel(other, **kw)
    _sync(info.device)
    prof.disable()
    phases["plain_ddp_warm"] = time.perf_counter() - t0
    del plain
    _print_profile("plain DDP (warm)", prof, 12)
    torch.distributed.destroy_process_group()

    res = {
        "claim": "wrap_ddp_start_cost",
        "baseline": "plain DistributedDataParallel of the same model, warm, same process",
        "device": args.device,
        "parameters": nparams,
        "torch_dynamo_imported_before_wrap": dynamo_before,
        "phases_s": {k: round(v, 4) for k, v in phases.items()},
        "ratio_wrap_vs_plain_ddp": round(phases["wrap_ddp_warm"] / phases["plain_ddp_warm"], 3),
        "load_avg_1m_start": load0,
        "machine": _common.machine(),
    }
    _common.emit(res, args.results)


if __name__ == "__main__":
    main()
