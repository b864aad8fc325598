"""``python -m elastic_kit`` / ``elastic-kit``: inspect and tidy a checkpoint store.

Subcommands::

    elastic-kit ls URL                 committed checkpoints: step, size, time, status
    elastic-kit verify URL [--step N]  recompute every checksum
    elastic-kit prune URL --keep K     delete checkpoints older than the newest K that verify
    elastic-kit snapshots [--remove]   this user's in-memory snapshot runs on this host

Nothing here needs a process group: the tools run on a laptop against the same URL
the job writes to (``--storage-options '{"profile": "x"}'`` for credentials).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import errno
import json
import logging
import os
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
  1  verify found at least one corrupt or incomplete checkpoint (each is listed with
     its reason; load() skips it)
  2  usage error, unknown URL protocol, bad storage option, missing filesystem extra,
     unreachable store, missing bucket or local directory, a URL that is a file

examples:
  python -m elastic_kit ls /shared/ckpt
  python -m elastic_kit verify s3://bucket/run1 --storage-options '{"profile": "train"}'
  python -m elastic_kit prune /shared/ckpt --keep 2
  python -m elastic_kit snapshots --remove --idle-minutes 120
"""


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser (exposed for docs and tests)."""
    p = argparse.ArgumentParser(
        prog="elastic-kit", description="Inspect elastic_kit checkpoint stores.",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True,
                           metavar="{ls,verify,prune,snapshots}")

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
    pr = sub.add_parser(
        "prune", help="delete checkpoints older than the newest K that verify",
        epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Reads and checksums the newest checkpoints, walking back until K verify,\n"
                    "and deletes the checkpoints older than those K. A corrupt checkpoint is\n"
                    "not counted: one newer than the oldest kept stays (load skips it; verify\n"
                    "lists it), and with fewer than K that verify none is deleted. Also\n"
                    "removes stale leftovers of interrupted saves.")
    common(pr)
    pr.add_argument("--keep", type=int, required=True, metavar="K",
                    help="checkpoints that verify to keep (>= 1)")
    pr.add_argument("--dry-run", action="store_true", help="print what would be deleted")
    sn = sub.add_parser(
        "snapshots", help="this user's in-memory snapshot runs on this host; --remove "
        "deletes those left behind", epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="A run's snapshots stay in shared memory while it may restart; a run "
                    "abandoned for good leaves them. Lists this user's runs under the "
                    "snapshot root, and with --remove deletes those that no live "
                    "snapshot writer or agent (a node's torchrun agent waiting for its "
                    "next round) uses and where nothing was written for "
                    "--idle-minutes.")
    sn.add_argument("--root", default=None,
                    help="the snapshot root (default: $ELASTIC_KIT_SNAPSHOT_DIR, else /dev/shm)")
    sn.add_argument("--remove", action="store_true", help="delete the idle runs")
    sn.add_argument("--idle-minutes", type=float, default=60.0, metavar="M",
                    help="a run is idle after M minutes without a write (default 60)")
    sn.add_argument("--json", action="store_true", help="one JSON object per line")
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
    try:
        return _dt.datetime.fromtimestamp(t, tz=_dt.timezone.utc).strftime(
            "%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, ValueError, OSError):  # a time no calendar date has
        return f"{t:g}"


def _say(line: str) -> None:
    """Print ``line``; once the reader went away (``| head``), print nothing more and
    go on: what a command does (a prune's deletions) and its exit status do not
    depend on who reads its output."""
    try:
        print(line, flush=True)
    except BrokenPipeError:
        # further writes, and the interpreter's flush at exit, go nowhere
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


def _is_local(store: Any) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(store.fs, LocalFileSystem)


def _open_store(args: argparse.Namespace) -> Any:
    from elastic_kit.store import CheckpointStore
    from elastic_kit.distributed import DistInfo

    opts = None
    if args.storage_options:
        try:
            opts = json.loads(args.storage_options)
        except ValueError as e:
            raise ValueError(f"--storage-options={args.storage_options!r} is not JSON: {e}") from e
        if not isinstance(opts, dict):
            raise ValueError(f"--storage-options={args.storage_options!r} must be a JSON object")
    # A lone process: never join or wait for a process group. A few quick read
    # attempts: a tool should report an unreachable store, not wait on it.
    store = CheckpointStore(args.url, storage_options=opts, keep_last=None, info=DistInfo(),
                            read_attempts=2, io_timeout=10.0)
    if _is_local(store) and not os.path.isdir(store.root):
        # a mistyped path, not an empty store (an object store has no directories)
        if os.path.lexists(store.root):
            raise NotADirectoryError(errno.ENOTDIR, "not a directory (a store is one)",
                                     store.root)
        raise FileNotFoundError(errno.ENOENT, "the directory does not exist (no checkpoint "
                                "was ever saved there)", store.root)
    return store


def _printed_as_json_or_none(rows: list[dict[str, Any]], as_json: bool, none: str) -> bool:
    """Print ``rows`` one JSON object a line (``as_json``), or ``none`` when there are
    none; whether that was all there is to print (else the caller prints a table)."""
    if as_json:
        for r in rows:
            _say(json.dumps(r))
        return True
    if not rows:
        _say(none)
        return True
    return False


def _url_of(store: Any, path: str) -> str:
    """``path`` (inside the store's filesystem) as a URL the tool takes back: with its
    scheme on an object store (``s3://bucket/run/step-...``), as is on a local disk."""
    return path if _is_local(store) else store.fs.unstrip_protocol(path)


def _without_path(problem: str, path: str) -> str:
    """``problem`` without the step's path it starts with (``<path>: ...`` or
    ``<path>/<file>: ...``), which the row shows already. Cut after the path, not at
    the first ``": "``: a store's path may hold one."""
    if not problem.startswith(path):
        return problem
    rest = problem[len(path):]
    if rest.startswith("/"):
        rest = rest.partition(": ")[2] or rest
    return rest[2:] if rest.startswith(": ") else rest


def _cmd_ls(store: Any, args: argparse.Namespace) -> int:
    infos = {i.step: i for i in store.list()}
    rows = []
    for step, path, problem in store.verify(deep=False):
        i = infos.get(step)
        rows.append({"step": step, "path": _url_of(store, path),
                     "size_bytes": i.size_bytes if i else None,
                     "time": i.time if i else None, "epoch": i.epoch if i else None,
                     "status": "ok" if problem is None else
                     "INVALID: " + _without_path(problem, path)})
    if _printed_as_json_or_none(rows, args.json, f"no checkpoints in {store.url}"):
        return EXIT_OK
    _say(f"{'STEP':>12}  {'SIZE':>10}  {'EPOCH':>5}  {'TIME':<23}  STATUS")
    for r in rows:
        size = _fmt_size(r["size_bytes"]) if r["size_bytes"] is not None else "-"
        epoch = str(r["epoch"]) if r["epoch"] is not None else "-"
        _say(f"{r['step']:>12}  {size:>10}  {epoch:>5}  {_fmt_time(r['time']):<23}  {r['status']}")
    return EXIT_OK


def _cmd_verify(store: Any, args: argparse.Namespace) -> int:
    results = store.verify(deep=True, step=args.step)  # only that step's files read
    if args.step is not None:
        if not results:
            print(f"error: no checkpoint step {args.step} in {store.url}", file=sys.stderr)
            return EXIT_USAGE
    bad = 0
    for step, path, problem in results:
        if problem is None:
            _say(f"OK       step {step}  {_url_of(store, path)}")
        else:
            bad += 1
            _say(f"CORRUPT  step {step}  {problem}")
    _say(f"{len(results) - bad} ok, {bad} corrupt or incomplete (skipped by load)")
    return EXIT_CORRUPT if bad else EXIT_OK


def _cmd_prune(store: Any, args: argparse.Namespace) -> int:
    if args.keep < 1:
        print(f"error: --keep={args.keep} must be >= 1", file=sys.stderr)
        return EXIT_USAGE
    listed = len(store.list()) if args.dry_run else 0

    def told(path: str, step: int | None, leftover: bool) -> None:
        # said before each deletion: a prune that fails part way has said what it did
        what = ("leftover of an interrupted save" if step is None else
                f"leftover of an interrupted save of step {step}" if leftover else
                f"step {step}")
        verb = ("would remove" if leftover else "would delete") if args.dry_run else (
            "removing" if leftover else "deleting")
        _say(f"{verb} {what}  {_url_of(store, path)}")

    doomed = store.prune(args.keep, dry_run=args.dry_run, on_delete=told)
    if args.dry_run:
        _say(f"would keep {listed - len(doomed)} checkpoint(s)")
    else:
        _say(f"kept {len(store.list())} checkpoint(s)")
    return EXIT_OK


def _cmd_snapshots(args: argparse.Namespace) -> int:
    from elastic_kit.snapshot import default_root, remove_idle_runs, snapshot_runs

    if args.idle_minutes < 0:
        print(f"error: --idle-minutes={args.idle_minutes} must be >= 0", file=sys.stderr)
        return EXIT_USAGE
    root = args.root or default_root()
    found = snapshot_runs(root)
    idle = {r.path for r in remove_idle_runs(root, idle_s=args.idle_minutes * 60.0,
                                             dry_run=not args.remove)}
    rows = []
    for r in found:
        status = (("removed" if args.remove else "idle") if r.path in idle else
                  f"in use (writer pid {', '.join(map(str, r.writers))})" if r.writers else
                  f"in use (agent pid {', '.join(map(str, r.agents))})" if r.agents else
                  "recent")
        rows.append({"path": r.path, "size_bytes": r.size_bytes, "time": r.newest,
                     "status": status})
    if _printed_as_json_or_none(rows, args.json, f"no snapshot runs of this user under {root}"):
        return EXIT_OK
    _say(f"{'SIZE':>10}  {'LAST WRITE':<23}  {'STATUS':<24}  PATH")
    for row in rows:
        _say(f"{_fmt_size(row['size_bytes']):>10}  {_fmt_time(row['time']):<23}  "
              f"{row['status']:<24}  {row['path']}")
    if not args.remove and any(row["status"] == "idle" for row in rows):
        _say("idle runs are removed with --remove")
    if any(row["status"] == "recent" for row in rows):
        # a run abandoned a moment ago looks like one between two writes: say why it
        # stays, and how to remove one known to be abandoned
        _say(f"recent runs (written within --idle-minutes {args.idle_minutes:g}) are kept; "
              "one abandoned for good is removed with --remove --idle-minutes 0")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``elastic-kit`` and ``python -m elastic_kit``; returns the exit code.

    Every failure is one ``error:`` line on stderr and an exit code (never a
    traceback): 1 only when ``verify`` found a corrupt checkpoint, 2 for anything
    that kept the tool from looking (usage, URL, options, an unreachable store).
    """
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with 2 on usage errors
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from elastic_kit.errors import CheckpointError

    if args.command == "snapshots":
        try:
            return _cmd_snapshots(args)
        except (OSError, ValueError) as e:  # PermissionError: an untrusted tree
            print(f"error: snapshots: {e}", file=sys.stderr)
            return EXIT_USAGE
        except Exception as e:  # a tool reports, it does not dump a traceback
            log.debug("unexpected failure", exc_info=True)
            print(f"error: snapshots failed: {type(e).__name__}: {e}", file=sys.stderr)
            return EXIT_USAGE
    try:
        store = _open_store(args)
        return {"ls": _cmd_ls, "verify": _cmd_verify, "prune": _cmd_prune}[args.command](store, args)
    except (ValueError, TypeError, ImportError) as e:
        if args.storage_options and isinstance(e, TypeError) and \
                "unexpected keyword argument" in str(e):
            # the filesystem's client refused an option: name where it came from
            print(f"error: --storage-options={args.storage_options!r}: the filesystem of "
                  f"{args.url!r} does not take it: {e}", file=sys.stderr)
        else:
            print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except CheckpointError as e:
        print(f"error: cannot read {args.url!r}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:
        print(f"error: cannot access {args.url!r}: {e}", file=sys.stderr)
        return EXIT_USAGE
    except Exception as e:  # a tool reports, it does not dump a traceback
        log.debug("unexpected failure", exc_info=True)
        print(f"error: {args.command} {args.url!r} failed: {type(e).__name__}: {e}",
              file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
