"""``python -m elastic_kit ls|verify|prune``: output and exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from elastic_kit.store import CheckpointStore
from elastic_kit.store._manifest import PAYLOAD_NAME
from elastic_kit.cli import EXIT_CORRUPT, EXIT_OK, EXIT_USAGE, main


@pytest.fixture
def store_url(tmp_path) -> str:
    url = str(tmp_path / "ck")
    store = CheckpointStore(url, keep_last=None)
    for step in (10, 20, 30):
        store.save({"w": torch.full((1000,), float(step))}, step=step, metadata={"epoch": step // 10})
    store.close()
    return url


def _corrupt(url: str, step: int) -> None:
    path = f"{url}/step-{step:012d}/{PAYLOAD_NAME}"
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def test_ls_lists_steps_sizes_times_and_status(store_url, capsys):
    assert main(["ls", store_url]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["STEP", "SIZE", "EPOCH", "TIME", "STATUS"]
    rows = [line.split() for line in out[1:]]
    assert [r[0] for r in rows] == ["10", "20", "30"]
    assert all(r[-1] == "ok" and r[2] == "KB" and "UTC" in r for r in rows)
    assert [r[3] for r in rows] == ["1", "2", "3"]


def test_ls_json_flags_an_incomplete_checkpoint(store_url, capsys):
    import os

    os.remove(f"{store_url}/step-{20:012d}/manifest.json")
    assert main(["ls", store_url, "--json"]) == EXIT_OK
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    status = {r["step"]: r["status"] for r in rows}
    assert status[10] == "ok" and status[30] == "ok"
    assert status[20].startswith("INVALID") and "manifest.json is missing" in status[20]


@pytest.mark.parametrize("damage", ["no manifest", "short payload"])
def test_ls_status_is_the_problem_alone_when_the_path_holds_a_colon(tmp_path, capsys, damage):
    import os

    url = str(tmp_path / "run: x")
    store = CheckpointStore(url, keep_last=None)
    store.save({"w": torch.ones(1000)}, step=1)
    store.close()
    if damage == "no manifest":
        os.remove(f"{url}/step-{1:012d}/manifest.json")
    else:
        os.truncate(f"{url}/step-{1:012d}/{PAYLOAD_NAME}", 10)
    assert main(["ls", url, "--json"]) == EXIT_OK
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    problem = [p for _, _, p in CheckpointStore(url).verify(deep=False)][0]
    assert problem is not None and row["status"].startswith("INVALID: ")
    assert "x/step-" not in row["status"] and row["status"][9:] in problem
    if damage == "no manifest":
        assert row["status"].startswith("INVALID: manifest.json is missing")


def test_verify_exit_0_when_intact_and_1_when_a_checkpoint_is_corrupt(store_url, capsys):
    assert main(["verify", store_url]) == EXIT_OK
    assert "3 ok, 0 corrupt" in capsys.readouterr().out
    _corrupt(store_url, 20)
    assert main(["verify", store_url]) == EXIT_CORRUPT
    out = capsys.readouterr().out
    assert "CORRUPT  step 20" in out and "xxh3_128" in out and "2 ok, 1 corrupt" in out
    assert main(["verify", store_url, "--step", "30"]) == EXIT_OK
    assert main(["verify", store_url, "--step", "99"]) == EXIT_USAGE


def test_prune_keeps_newest_k(store_url, capsys):
    assert main(["prune", store_url, "--keep", "2", "--dry-run"]) == EXIT_OK
    assert "would delete step 10" in capsys.readouterr().out
    assert [i.step for i in CheckpointStore(store_url).list()] == [10, 20, 30]
    assert main(["prune", store_url, "--keep", "1"]) == EXIT_OK
    assert "kept 1 checkpoint(s)" in capsys.readouterr().out
    assert [i.step for i in CheckpointStore(store_url).list()] == [30]
    assert main(["prune", store_url, "--keep", "0"]) == EXIT_USAGE


def test_prune_counts_only_checkpoints_that_verify(store_url, capsys, caplog):
    _corrupt(store_url, 30)
    assert main(["prune", store_url, "--keep", "1", "--dry-run"]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:3] for line in out[:-1]] == [["would", "delete", "step"]]
    assert out[0].split()[3] == "10" and out[-1] == "would keep 2 checkpoint(s)"
    with caplog.at_level("WARNING", logger="elastic_kit.store"):
        assert main(["prune", store_url, "--keep", "1"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1] == "kept 2 checkpoint(s)"
    assert "step 30 does not verify" in caplog.text and "corrupt payload" in caplog.text
    # the corrupt newest step stays beside the loadable one, which load returns
    assert [i.step for i in CheckpointStore(store_url).list()] == [20, 30]
    loaded = CheckpointStore(store_url).load()
    assert loaded is not None and loaded.step == 20
    assert torch.equal(loaded.state["w"], torch.full((1000,), 20.0))


def test_prune_dry_run_reports_how_many_would_really_stay(store_url, tmp_path, capsys):
    assert main(["prune", store_url, "--keep", "5", "--dry-run"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines() == ["would keep 3 checkpoint(s)"]
    assert main(["prune", store_url, "--keep", "2", "--dry-run"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines()[-1] == "would keep 2 checkpoint(s)"
    empty = str(tmp_path / "empty")
    (tmp_path / "empty").mkdir()
    assert main(["prune", empty, "--keep", "2", "--dry-run"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines() == ["would keep 0 checkpoint(s)"]
    assert main(["prune", empty, "--keep", "2"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines() == ["kept 0 checkpoint(s)"]


def test_snapshots_reports_an_unexpected_error_as_one_line(tmp_path, monkeypatch, capsys):
    import elastic_kit.snapshot

    def broken(root):
        raise RuntimeError(f"cannot scan {root}")

    monkeypatch.setattr(elastic_kit.snapshot, "snapshot_runs", broken)
    assert main(["snapshots", "--root", str(tmp_path)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err == f"error: snapshots failed: RuntimeError: cannot scan {tmp_path}\n"


def test_usage_and_url_errors_exit_2(capsys):
    assert main(["ls", "nope://bucket/run"]) == EXIT_USAGE
    assert "unknown protocol 'nope'" in capsys.readouterr().err
    assert main(["ls", "memory://x", "--storage-options", "[1]"]) == EXIT_USAGE
    capsys.readouterr()
    # an option the filesystem's client refuses is named as coming from the flag
    opts = '{"bogus_opt": 1, "endpoint_url": "http://127.0.0.1:9"}'
    assert main(["ls", "s3://b/run", "--storage-options", opts]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: --storage-options={opts!r}: the filesystem of 's3://b/run' "
                          "does not take it: ") and "bogus_opt" in err, err
    with pytest.raises(SystemExit) as e:
        main(["frobnicate", "x"])
    assert e.value.code == EXIT_USAGE


def test_help_documents_exit_codes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "exit codes:" in out and "1  verify found" in out and "2  usage error" in out


def test_python_m_elastic_kit_exits_1_on_a_corrupt_store(store_url):
    _corrupt(store_url, 30)
    run = subprocess.run([sys.executable, "-m", "elastic_kit", "verify", store_url],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == EXIT_CORRUPT, run.stdout + run.stderr
    assert "CORRUPT  step 30" in run.stdout


@pytest.mark.parametrize("command", ["ls", "verify", "prune"])
def test_a_local_store_that_does_not_exist_exits_2_naming_it(tmp_path, capsys, command):
    """A mistyped path is no empty store: the tool says the directory is missing."""
    missing = str(tmp_path / "no-such-run")
    argv = [command, missing] + (["--keep", "1"] if command == "prune" else [])
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith(f"error: cannot access {missing!r}: ") and "does not exist" in err
    assert not (tmp_path / "no-such-run").exists()  # nothing created by looking
    (tmp_path / "empty").mkdir()
    assert main(["ls", str(tmp_path / "empty")]) == EXIT_OK
    assert "no checkpoints in" in capsys.readouterr().out
    (tmp_path / "a-file").write_text("x")
    assert main([command, str(tmp_path / "a-file")] + argv[2:]) == EXIT_USAGE
    assert "not a directory" in capsys.readouterr().err


def test_paths_on_an_object_store_are_printed_as_urls(capsys):
    url = "memory://ek-cli-urls/run"
    store = CheckpointStore(url, keep_last=None)
    for step in (1, 2):
        store.save({"w": torch.ones(3)}, step=step)
    store.close()
    try:
        assert main(["ls", url, "--json"]) == EXIT_OK
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        shown = "memory:///ek-cli-urls/run"  # the memory filesystem's paths start with /
        assert [r["path"] for r in rows] == [f"{shown}/step-{s:012d}" for s in (1, 2)]
        assert main(["verify", shown]) == EXIT_OK  # taken back as printed
        assert f"OK       step 2  {shown}/step-000000000002" in capsys.readouterr().out
        assert main(["prune", url, "--keep", "1"]) == EXIT_OK
        assert f"deleting step 1  {shown}/step-000000000001" in capsys.readouterr().out
    finally:
        import fsspec

        fsspec.filesystem("memory").rm("/ek-cli-urls", recursive=True)


def test_a_prune_that_fails_part_way_has_said_what_it_deleted(store_url) -> None:
    """Step 20 cannot be removed (another user's files, a read-only mount, S3's
    AccessDenied): step 10's deletion, which went before, was told before the error
    (the command line prints each as it is told)."""
    import fsspec

    from elastic_kit.testing import FaultFileSystem

    store = CheckpointStore(store_url, keep_last=None)
    store.save({"w": torch.zeros(10)}, step=40)
    store.close()
    ffs = FaultFileSystem(fsspec.filesystem("file"))
    ffs.add("rm", match="step-000000000020", error=PermissionError(13, "Access Denied"))
    said: list[str] = []
    store = CheckpointStore(store_url, keep_last=None, filesystem=ffs)
    with pytest.raises(PermissionError):
        store.prune(1, on_delete=lambda path, step, leftover: said.append(
            f"{step} {leftover} {path.rsplit('/', 1)[-1]}"))
    assert said == ["10 False step-000000000010", "20 False step-000000000020"]
    assert [i.step for i in store.list()] == [20, 30, 40]


def test_prune_dry_run_lists_the_leftovers_the_real_run_removes(store_url, capsys) -> None:
    import os

    os.remove(f"{store_url}/step-{20:012d}/manifest.json")  # an interrupted save of step 20
    store = CheckpointStore(store_url, keep_last=None, stale_after_s=0)
    said: list[str] = []
    doomed = store.prune(2, dry_run=True, on_delete=lambda p, s, left: said.append(f"{s} {left}"))
    assert doomed == [] and said == ["20 True"]
    assert os.path.isdir(f"{store_url}/step-{20:012d}")  # a dry run changes nothing
    said.clear()
    assert store.prune(2, on_delete=lambda p, s, left: said.append(f"{s} {left}")) == []
    assert said == ["20 True"] and not os.path.exists(f"{store_url}/step-{20:012d}")
    store.close()


def test_prune_dry_run_on_the_command_line_names_a_leftover(store_url, capsys) -> None:
    import os
    import time

    os.remove(f"{store_url}/step-{20:012d}/manifest.json")
    old = time.time() - 3600  # older than the stale cleanup's 10 minutes
    for p in [f"{store_url}/step-{20:012d}", *(os.path.join(f"{store_url}/step-{20:012d}", n)
                                              for n in os.listdir(f"{store_url}/step-{20:012d}"))]:
        os.utime(p, (old, old))
    assert main(["prune", store_url, "--keep", "2", "--dry-run"]) == EXIT_OK
    out = capsys.readouterr().out.splitlines()
    assert out == [f"would remove leftover of an interrupted save of step 20  "
                   f"{store_url}/step-000000000020", "would keep 2 checkpoint(s)"]
    assert os.path.isdir(f"{store_url}/step-{20:012d}")


def test_verify_step_reads_only_that_step(store_url, capsys) -> None:
    _corrupt(store_url, 10)  # another step's damage is not this one's verdict
    assert main(["verify", store_url, "--step", "20"]) == EXIT_OK
    assert capsys.readouterr().out.splitlines() == [
        f"OK       step 20  {store_url}/step-000000000020", "1 ok, 0 corrupt or incomplete "
                                                             "(skipped by load)"]


def test_ls_shows_a_time_no_date_has_instead_of_failing(store_url, capsys) -> None:
    path = f"{store_url}/step-{30:012d}/manifest.json"
    manifest = json.loads(open(path).read())
    manifest["time"] = 1e20
    open(path, "w").write(json.dumps(manifest))
    assert main(["ls", store_url]) == EXIT_OK
    rows = capsys.readouterr().out.splitlines()[1:]
    assert len(rows) == 3 and "1e+20" in rows[2]


def test_a_reader_that_goes_away_changes_neither_the_work_nor_the_exit_status(
        store_url, tmp_path) -> None:
    """``prune ... | head -1``: every deletion still happens, and ``verify`` still
    exits 1 on a corrupt store, with no 'cannot access' error blaming the store."""
    store = CheckpointStore(store_url, keep_last=None)
    for step in range(40, 240, 10):
        store.save({"w": torch.zeros(10)}, step=step)
    store.close()
    _corrupt(store_url, 30)
    for cmd, code in ((["verify", store_url], EXIT_CORRUPT),
                      (["prune", store_url, "--keep", "1"], EXIT_OK)):
        proc = subprocess.Popen([sys.executable, "-m", "elastic_kit", *cmd],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        assert proc.stdout is not None and proc.stdout.readline()
        proc.stdout.close()  # the reader is gone after one line
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == code, err
        assert b"cannot access" not in err and b"Broken pipe" not in err, err
    assert [i.step for i in CheckpointStore(store_url).list()] == [230]
