"""``python -m elastic_kit`` / ``elastic-kit``: inspect and tidy a checkpoint store.

Subcommands::

    elastic-kit ls URL                 committed checkpoints: step, size, time, status
    elastic-kit verify URL [--step N]  recompute every checksum
    elastic-kit prune URL --keep K     delete all but the newest K checkpoints

Nothing here needs a process group: the tools run on a laptop against the same URL
the job writes to (``--storage-options '{"profile": "x"}'`` for credentials).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import logging
import sys
from typing import Any, Sequence

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_CORRUPT", "EXIT_USAGE"]

log = logging.getLogger(__name__)

EXIT_OK = 0
EXIT_CORRUPT = 1
EXIT_USAGE = 2

_EPILOG = """\
exit codes:
  0  success (verify: every checkpoint checked is intact)
  1  verify found at least one corrupt or incomplete checkpoint
  2  usage error, unknown URL protocol, missing filesystem extra, unreachable store

examples:
  python -m elastic_kit ls /shared/ckpt
  python -m elastic_kit verify s3://bucket/run1 --storage-options '{"profile": "train"}'
  python -m elastic_kit prune /shared/ckpt --keep 2
"""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser (exposed for docs and tests)."""
    p = argparse.ArgumentParser(
        prog="elastic-kit", description="Inspect elastic_kit checkpoint stores.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{ls,verify,prune}")

    def common(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("url", help="store path or fsspec URL (file://, s3://, gs://, az://...)")
        sp.add_argument("--storage-options", default=None, metavar="JSON",
                        help="fsspec storage options as a JSON object")

    ls = sub.add_parser("ls", help="list checkpoints with size, time and status",
                        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(ls)
    ls.add_argument("--json", action="store_true", help="one JSON object per line")
    ve = sub.add_parser("verify", help="recompute checksums of every checkpoint",
                        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(ve)
    ve.add_argument("--step", type=int, default=None, help="verify only this step")
    pr = sub.add_parser("prune", help="delete all but the newest K checkpoints",
                        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    common(pr)
    pr.add_argument("--keep", type=int, required=True, metavar="K", help="checkpoints to keep (>= 1)")
    pr.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    return p


def _fmt_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)  # pragma: no cover


def _fmt_time(t: float | None) -> str:
    if t is None:
        return "-"
    return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _open_store(args: argparse.Namespace) -> Any:
    from elastic_kit.checkpoint import CheckpointStore
    from elastic_kit.distributed import DistInfo

    opts = None
    if args.storage_options:
        opts = json.loads(args.storage_options)
        if not isinstance(opts, dict):
            raise ValueError(f"--storage-options={args.storage_options!r} must be a JSON object")
    # A lone process: never join or wait for a process group.
    return CheckpointStore(args.url, storage_options=opts, keep_last=None, info=DistInfo())


def _cmd_ls(store: Any, args: argparse.Namespace) -> int:
    from elastic_kit.checkpoint.writer import read_manifest, scan, verify
    from elastic_kit.errors import CheckpointCorruptError

    rows = []
    for d in scan(store.fs, store.root):
        row: dict[str, Any] = {"step": d.step, "path": d.path, "size_bytes": None,
                               "time": None, "epoch": None, "status": "ok"}
        try:
            m = read_manifest(store.fs, d)
            row.update(size_bytes=m.size_bytes, time=m.time, epoch=m.epoch)
            verify(store.fs, d, deep=False)
        except CheckpointCorruptError as e:
            row["status"] = "INVALID: " + str(e).split(": ", 1)[-1]
        rows.append(row)
    if args.json:
        for r in rows:
            print(json.dumps(r))
        return EXIT_OK
    if not rows:
        print(f"no checkpoints in {store.url}")
        return EXIT_OK
    print(f"{'STEP':>12}  {'SIZE':>10}  {'EPOCH':>5}  {'TIME':<23}  STATUS")
    for r in rows:
        size = _fmt_size(r["size_bytes"]) if r["size_bytes"] is not None else "-"
        epoch = str(r["epoch"]) if r["epoch"] is not None else "-"
        print(f"{r['step']:>12}  {size:>10}  {epoch:>5}  {_fmt_time(r['time']):<23}  {r['status']}")
    return EXIT_OK


def _cmd_verify(store: Any, args: argparse.Namespace) -> int:
    results = store.verify(deep=True)
    if args.step is not None:
        results = [r for r in results if r[0] == args.step]
        if not results:
            print(f"error: no checkpoint step {args.step} in {store.url}", file=sys.stderr)
            return EXIT_USAGE
    bad = 0
    for step, path, problem in results:
        if problem is None:
            print(f"OK       step {step}  {path}")
        else:
            bad += 1
            print(f"CORRUPT  step {step}  {problem}")
    print(f"{len(results) - bad} ok, {bad} corrupt or incomplete")
    return EXIT_CORRUPT if bad else EXIT_OK


def _cmd_prune(store: Any, args: argparse.Namespace) -> int:
    from elastic_kit.checkpoint.writer import StepDir, clean_stale, delete_step

    if args.keep < 1:
        print(f"error: --keep={args.keep} must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    infos = store.list()
    doomed = infos[:-args.keep] if len(infos) > args.keep else []
    for i in doomed:
        print(("would delete" if args.dry_run else "deleting") + f" step {i.step}  {i.path}")
        if not args.dry_run:
            delete_step(store.fs, store.root, StepDir(i.step, i.path))
    if not args.dry_run and infos:
        clean_stale(store.fs, store.root, newest_committed=infos[-1].step)
    print(f"kept {len(infos) - len(doomed)} checkpoint(s)")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``elastic-kit`` and ``python -m elastic_kit``; returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with 2 on usage errors
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        store = _open_store(args)
        return {"ls": _cmd_ls, "verify": _cmd_verify, "prune": _cmd_prune}[args.command](store, args)
    except (ValueError, ImportError, PermissionError, ConnectionError) as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"error: cannot access {args.url!r}: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
