"""SIGKILL trials: a writer killed at random moments never costs a committed checkpoint.

Claim measured: whatever moment a process is SIGKILLed while it saves (new steps) or
re-saves the same step, the store afterwards loads a whole checkpoint (0 partial
loads) and still holds every step the writer had reported committed (0 committed
steps lost), on a local disk and on an S3-compatible server (moto, on 127.0.0.1).

Each trial starts a writer process that saves in a loop and reports "start" and
"done" (committed) for each save over a pipe; the parent waits for one or two
"start" messages, sleeps a random time in ``[0, 1.5 x one save]`` and SIGKILLs it,
then opens a fresh store and checks:

- ``partial_loads``: ``load()`` returned a state whose content is not exactly the
  state of its step and version (or raised, or returned None with steps committed);
- ``committed_lost``: a step (new-step trials) or the re-saved step's newest version
  (re-save trials) that the writer had reported committed is no longer committed,
  or no longer verifies, or loads an older version.

Baseline, measured in the same run with the same kills: ``naive`` re-saves the same
step the way the store did before commit became monotonic (and the way most
object-store checkpointers do): remove the old manifest (un-commit), upload the new
payload, write the new manifest. ``ratio_lost_per_trial_ours_vs_naive`` divides the
store's committed-step losses per trial by the naive writer's (0 means none lost by
the store; the naive figure says how often a kill hit the window).

Usage::

    .venv/bin/python benchmarks/bench_store_crash.py             # 50 trials per case
    .venv/bin/python benchmarks/bench_store_crash.py --smoke     # 3 trials, seconds
    .venv/bin/python benchmarks/bench_store_crash.py --trials 100 --results \\
        benchmarks/results/store_crash_cpu2_202611.md
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
import zlib
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

N = 1 << 20  # float32 elements: a 4 MB payload
STEP = 7  # the step re-save trials save again and again


def _state(step: int, version: int, n: int) -> dict[str, Any]:
    import torch

    return {"w": torch.full((n,), float(version)), "step": step, "version": version}


def _consistent(state: dict[str, Any], step: int, n: int) -> bool:
    w = state.get("w")
    return (state.get("step") == step and w is not None and tuple(w.shape) == (n,)
            and bool((w == float(state.get("version", -1))).all()))


def _naive_resave(fs: Any, root: str, state: dict[str, Any], step: int) -> None:
    """The baseline: un-commit, upload, commit (the old object-store re-save)."""
    import io

    import torch

    from elastic_kit.store._manifest import Manifest, FileEntry
    from elastic_kit.store._serialize import new_hasher

    d = f"{root}/step-{step:012d}"
    if fs.exists(f"{d}/manifest.json"):
        fs.rm_file(f"{d}/manifest.json")
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getvalue()
    h = new_hasher("xxh3_128")
    h.update(data)
    fs.makedirs(d, exist_ok=True)
    fs.pipe_file(f"{d}/state.pt", data)
    m = Manifest(step=step, files={"state.pt": FileEntry(len(data), h.hexdigest())},
                 checksum="xxh3_128", metadata={"version": state["version"]})
    fs.pipe_file(f"{d}/manifest.json", m.to_json().encode())


def _writer(url: str, opts: dict[str, Any] | None, kind: str, first: int, n: int,
            conn: Any) -> None:
    """Save forever (killed by the parent); report each save's start and commit."""
    import torch

    torch.set_num_threads(1)
    from elastic_kit.store import CheckpointStore

    store = CheckpointStore(url, storage_options=opts, keep_last=None)
    version = first
    while True:
        step = version if kind == "save" else STEP
        state = _state(step, version, n)
        conn.send(("start", step, version))
        if kind == "naive":
            _naive_resave(store.fs, store.root, state, step)
        else:
            store.save(state, step=step, metadata={"version": version})
        conn.send(("done", step, version))
        version += 1


def _check(url: str, opts: dict[str, Any] | None, kind: str, committed: dict[int, int],
           n: int) -> tuple[int, int]:
    """(partial load?, committed steps lost) after a kill."""
    from elastic_kit.store import CheckpointStore

    store = CheckpointStore(url, storage_options=opts, keep_last=None)
    partial = lost = 0
    try:
        loaded = store.load()
    except Exception as e:  # counted: a load must not fail after a crash
        print(f"load raised: {e!r}", file=sys.stderr)
        loaded, partial = None, 1
    if loaded is None and committed:
        partial = 1
    elif loaded is not None and not _consistent(loaded.state, loaded.step, n):
        partial = 1
    ok = {s for s, _, p in store.verify(deep=False) if p is None}
    for step, version in committed.items():
        if step not in ok:
            lost += 1
        elif kind != "save" and loaded is not None and loaded.step == step and \
                loaded.state.get("version", -1) < version:
            lost += 1  # the re-saved step went back to an older version
    return partial, lost


def _trial(ctx: Any, url: str, opts: dict[str, Any] | None, kind: str, first: int,
           save_s: float, rng: random.Random, n: int,
           committed: dict[int, int]) -> tuple[bool, int, int]:
    recv, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_writer, args=(url, opts, kind, first, n, send), daemon=True)
    child.start()
    send.close()
    starts = 2 if rng.random() < 0.5 else 1
    last = None
    while starts:
        if not recv.poll(120):
            child.kill()
            raise RuntimeError(f"writer ({kind}) did not start a save within 120 s")
        last = recv.recv()
        if last[0] == "start":
            starts -= 1
        else:
            committed[last[1]] = last[2]
    time.sleep(rng.uniform(0.0, 1.5 * save_s))
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    while recv.poll(0):
        try:
            last = recv.recv()
        except EOFError:
            break
        if last[0] == "done":
            committed[last[1]] = last[2]
    interrupted = last is not None and last[0] == "start"
    partial, lost = _check(url, opts, kind, committed, n)
    return interrupted, partial, lost


def _start_moto() -> tuple[subprocess.Popen[bytes], str]:
    from elastic_kit.testing import reserve_port

    held = reserve_port()  # held while moto starts; moto then listens there
    port = held.port
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            held.close()
            return proc, endpoint
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                held.close()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)


def _s3_target(endpoint: str) -> tuple[str, dict[str, Any]]:
    import boto3

    bucket = f"crash-{uuid.uuid4().hex[:10]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing"
                 ).create_bucket(Bucket=bucket)
    opts = {"key": "testing", "secret": "testing", "use_listings_cache": False,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}
    return f"s3://{bucket}/run", opts


def _save_seconds(url: str, opts: dict[str, Any] | None, n: int) -> float:
    """One save's duration on this backend (the kills are spread over it)."""
    from elastic_kit.store import CheckpointStore

    store = CheckpointStore(url + "-probe", storage_options=opts, keep_last=1)
    t = []
    for v in range(3):
        t0 = time.perf_counter()
        store.save(_state(0, v, n), step=0)
        t.append(time.perf_counter() - t0)
    return max(_common.median(t), 0.02)


def run_case(ctx: Any, url: str, opts: dict[str, Any] | None, kind: str, trials: int,
             seed: int, n: int) -> dict[str, Any]:
    rng = random.Random(seed)
    save_s = _save_seconds(url, opts, n)
    committed: dict[int, int] = {}
    interrupted = partial = lost = 0
    first = 1
    t0 = time.perf_counter()
    for _ in range(trials):
        # committed maps step -> newest version reported committed, across trials:
        # a re-saved step must never go back to an older version either
        hit, p, lo = _trial(ctx, url, opts, kind, first, save_s, rng, n, committed)
        if kind != "save" and committed:
            # a later trial must not go back past what this one committed
            first = max(committed.values()) + 1
        elif committed:
            first = max(committed) + 1
        first += 1  # a killed in-flight save's number is never reused either
        interrupted += hit
        partial += p
        lost += lo
    return {"trials": trials, "kills_during_a_save": interrupted, "partial_loads": partial,
            "committed_lost": lost, "save_s": round(save_s, 4),
            "wall_s": round(time.perf_counter() - t0, 1)}


def main() -> None:
    p = _common.parser(__doc__)
    p.add_argument("--trials", type=int, default=50, help="kills per case (default 50)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--no-s3", action="store_true", help="skip the moto S3 cases")
    args = p.parse_args()
    trials = 3 if args.smoke else (15 if args.quick else args.trials)
    n = (1 << 14) if args.smoke else N
    load_start = _common.load_avg()
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "elastic_kit"])
    tmp = tempfile.mkdtemp(prefix="ek-crash-")
    moto = None
    cases: dict[str, dict[str, Any]] = {}
    try:
        backends: list[tuple[str, str, dict[str, Any] | None]] = [
            ("local", os.path.join(tmp, "ck"), None)]
        if not args.no_s3:
            moto, endpoint = _start_moto()
            backends.append(("s3", "", {"endpoint": endpoint}))
        for name, url, opts in backends:
            for kind in ("save", "resave", "naive"):
                if name == "s3":
                    url, opts = _s3_target(endpoint)
                else:
                    url = os.path.join(tmp, f"ck-{kind}")
                seed = args.seed + zlib.crc32(f"{name}-{kind}".encode()) % 1000
                cases[f"{name}_{kind}"] = run_case(ctx, url, opts, kind, trials, seed, n)
                print(f"{name}_{kind}: {cases[f'{name}_{kind}']}", file=sys.stderr, flush=True)
    finally:
        if moto is not None:
            moto.terminate()
            moto.wait(10)
        shutil.rmtree(tmp, ignore_errors=True)
    ours = [c for k, c in cases.items() if not k.endswith("naive")]
    naive = [c for k, c in cases.items() if k.endswith("naive")]
    ours_rate = sum(c["committed_lost"] for c in ours) / max(sum(c["trials"] for c in ours), 1)
    naive_rate = sum(c["committed_lost"] for c in naive) / max(sum(c["trials"] for c in naive), 1)
    result = {
        "claim": "SIGKILL during a save or a re-save of the same step: 0 partial loads, "
                 "0 committed steps lost (local disk and S3)",
        "baseline": "naive re-save (remove the manifest, upload, write the manifest), same kills",
        "trials_per_case": trials,
        "payload_mb": round(n * 4 / 1e6, 2),
        "partial_loads": sum(c["partial_loads"] for c in ours),
        "committed_lost": sum(c["committed_lost"] for c in ours),
        "kills_during_a_save": sum(c["kills_during_a_save"] for c in ours),
        "naive_committed_lost": sum(c["committed_lost"] for c in naive),
        "naive_partial_loads": sum(c["partial_loads"] for c in naive),
        "lost_per_trial_ours": round(ours_rate, 4),
        "lost_per_trial_naive": round(naive_rate, 4),
        "ratio_lost_per_trial_ours_vs_naive": round(ours_rate / naive_rate, 4) if naive_rate
        else 0.0,
        "cases": cases,
        "load_avg_1m_start": load_start,
        "machine": _common.machine(),
        "smoke": bool(args.smoke),
    }
    _common.emit(result, args.results)


if __name__ == "__main__":
    main()
