"""examples/imagenet/main.py, in process: its flags, model, sharded validation and digest.

The torchrun runs of the script are in ``test_example_torchrun.py``.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Any
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn

import torchvision  # noqa: E402,F401  (a test dependency: a missing one must fail, not skip)

from elastic_kit.testing import spawn_multi_process  # noqa: E402

MAIN = Path(__file__).resolve().parents[2] / "examples" / "imagenet" / "main.py"


def load_main() -> ModuleType:
    """Import examples/imagenet/main.py as a module (it is a script, not a package)."""
    name = "elastic_kit_example_imagenet_main"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, MAIN)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_parser_accepts_the_pytorch_elastic_flags_and_ours() -> None:
    args = load_main().build_parser().parse_args([
        "/data", "-a", "resnet18", "-j", "0", "--epochs", "3", "-b", "8", "--lr", "0.01",
        "--momentum", "0.8", "--wd", "0.001", "-p", "5", "--dist-backend", "gloo",
        "--checkpoint-file", "/tmp/x/checkpoint.pth.tar", "--checkpoint-dir", "s3://b/run",
        "--checkpoint-every", "7", "--global-batch-size", "64", "--batch-policy", "linear_lr",
        "--node-local-checkpoints", "--seed", "3", "--max-steps", "9", "--dummy",
        "--image-size", "32", "--summary-json", "/tmp/s.json"])
    assert (args.arch, args.workers, args.batch_size) == ("resnet18", 0, 8)
    assert args.weight_decay == 0.001
    assert (args.checkpoint_every, args.global_batch_size, args.max_steps) == (7, 64, 9)
    assert args.batch_policy == "linear_lr" and args.node_local_checkpoints and args.dummy
    with pytest.raises(SystemExit):
        load_main().build_parser().parse_args(["/data", "-a", "no_such_model"])


@pytest.mark.parametrize("flag,value,expected", [
    ("-b", "0", ">= 1"), ("--batch-size", "x", ">= 1"), ("--epochs", "-1", ">= 0"),
    ("-j", "-1", ">= 0"), ("-p", "-3", ">= 0"), ("--global-batch-size", "0", ">= 1"),
    ("--max-steps", "-1", ">= 0"), ("--dummy-size", "0", ">= 1"), ("--image-size", "2", ">= 4"),
])
def test_a_bad_count_is_a_usage_error_naming_it_before_any_process_group(
        flag: str, value: str, expected: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        load_main().build_parser().parse_args(["/data", flag, value])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert f"'{value}': expected an integer {expected}" in err
    assert flag in err


def test_checkpoint_file_maps_to_a_store_of_its_own() -> None:
    """Two file names in one directory are two experiments (and /tmp/x.pth.tar does
    not make /tmp the store)."""
    m = load_main()
    p = m.build_parser()
    a = m.checkpoint_url(p.parse_args(["d", "--checkpoint-file", "/ck/a.pth.tar"]), "r")
    b = m.checkpoint_url(p.parse_args(["d", "--checkpoint-file", "/ck/b.pth.tar"]), "r")
    assert (a, b) == ("/ck/a.pth.tar.d", "/ck/b.pth.tar.d")
    url = m.checkpoint_url(p.parse_args(["d", "--checkpoint-dir", "memory://x"]), "r")
    assert url == "memory://x"
    assert m.checkpoint_url(p.parse_args(["d"]), "run7").endswith("/run7")


def test_the_default_store_is_in_this_users_cache_not_in_tmp(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Any) -> None:
    """/tmp is shared: another user could make the run's directory first and plant a
    checkpoint the next run resumes from."""
    m = load_main()
    p = m.build_parser()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert m.checkpoint_url(p.parse_args(["d"]), "run7") == str(
        tmp_path / "cache" / "elastic_kit" / "imagenet" / "run7")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert m.checkpoint_url(p.parse_args(["d"]), "r").startswith(str(tmp_path / "home"))


def test_tinycnn_and_torchvision_models_build_for_small_images() -> None:
    m = load_main()
    x = torch.randn(2, 3, 32, 32)
    assert m.build_model("tinycnn", 10)(x).shape == (2, 10)
    assert m.build_model("resnet18", 7)(x).shape == (2, 7)
    assert not any(isinstance(mod, nn.modules.batchnorm._BatchNorm)
                   for mod in m.build_model("tinycnn", 10).modules())


def test_param_sha256_covers_parameters_and_buffers_in_order() -> None:
    m = load_main()
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    b = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    b.load_state_dict(a.state_dict())
    assert m.param_sha256(a) == m.param_sha256(b)
    assert len(m.param_sha256(a)) == 64 and int(m.param_sha256(a), 16) >= 0
    b[1].running_mean.add_(1e-3)  # a buffer, not a parameter
    assert m.param_sha256(a) != m.param_sha256(b)


class _Oracle(nn.Module):
    """Predicts class ``x[0, 0, 0]`` first, then classes in descending index order."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.classes = classes
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        prior = torch.arange(self.classes, dtype=torch.float32) / self.classes
        first = nn.functional.one_hot(x[:, 0, 0, 0].long(), self.classes).float() * 10
        return first + prior + self.w


def _val_data(n: int, classes: int) -> tuple[torch.utils.data.TensorDataset, float, float]:
    """n images whose predicted class is known, and the exact top-1/top-5 (%)."""
    g = torch.Generator().manual_seed(1)
    target = torch.randint(0, classes, (n,), generator=g)
    pred = torch.randint(0, classes, (n,), generator=g)
    pred[::3] = target[::3]  # some right, some wrong
    x = pred.float().view(n, 1, 1, 1).expand(n, 3, 2, 2).contiguous()
    top1 = top5 = 0
    for p, t in zip(pred.tolist(), target.tolist()):
        ranked = [p] + [c for c in range(classes - 1, -1, -1) if c != p]
        top1 += t == ranked[0]
        top5 += t in ranked[:5]
    return torch.utils.data.TensorDataset(x, target), 100 * top1 / n, 100 * top5 / n


def _validate_on_rank(n: int, classes: int, batch_size: int) -> tuple[float, float]:
    import elastic_kit as ek

    info = ek.init_distributed()
    ds, _, _ = _val_data(n, classes)
    return load_main().validate(_Oracle(classes), ds, batch_size=batch_size, workers=0,
                                device=info.device)


def test_sharded_validation_counts_each_image_once_when_world_size_does_not_divide() -> None:
    n, classes = 11, 8  # 11 images on 2 ranks: rank 1's share is padded with a repeat
    _, top1, top5 = _val_data(n, classes)
    results = spawn_multi_process(2, _validate_on_rank, n, classes, 2)
    for r1, r5 in results:
        assert r1 == pytest.approx(top1) and r5 == pytest.approx(top5)
    assert 0 < top1 < 100 and top1 < top5 <= 100


def _load_demo() -> ModuleType:
    spec = importlib.util.spec_from_file_location("elastic_kit_example_demo",
                                                  MAIN.parent / "demo.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_demo_report_passes_only_when_every_epoch_saw_every_image_once(capsys) -> None:
    demo = _load_demo()
    summary = {
        "steps": 28, "epochs": 2, "arch": "tinycnn", "global_batch_size": 48,
        "dataset_size": 640, "restarts": 1, "restored_steps": [9, 20],
        "world_sizes": [{"world_size": 2, "step": 0, "restart": 0, "restored_step": None},
                        {"world_size": 3, "step": 9, "restart": 0, "restored_step": 9},
                        {"world_size": 2, "step": 20, "restart": 1, "restored_step": 20}],
        "audit": [{"epoch": 0, "count": 640, "expected": 640, "ok": True},
                  {"epoch": 1, "count": 640, "expected": 640, "ok": True}],
        "final_top1": 90.0, "final_top5": 100.0, "best_acc1": 91.0, "param_sha256": "0" * 64,
        "images_per_sec": 150.0,
    }
    assert demo.print_report(summary, [(1.0, "started")], 100.0, 2, True)
    out = capsys.readouterr().out
    assert "from step    9: world size 3" in out and "sample audit: PASSED" in out
    assert "restore points (checkpoint steps): [9, 20]" in out
    repeated = {**summary, "audit": [summary["audit"][0],
                                     {"epoch": 1, "count": 641, "expected": 640, "ok": False}]}
    assert not demo.print_report(repeated, [], 100.0, 2, True)
    assert "sample audit: FAILED" in capsys.readouterr().out
    assert not demo.print_report({**summary, "audit": summary["audit"][:1]}, [], 100.0, 2, True)


def test_dummy_runs_without_a_data_directory(tmp_path: Path) -> None:
    """``--dummy`` needs no DIR (as in pytorch/examples); without either, a usage error."""
    import json
    import subprocess

    summary = tmp_path / "summary.json"
    cmd = [sys.executable, str(MAIN), "--dummy", "--dummy-size", "48", "-a", "tinycnn",
           "--image-size", "16", "--epochs", "1", "-b", "8", "--global-batch-size", "16",
           "-j", "0", "--checkpoint-dir", str(tmp_path / "ck"), "--summary-json", str(summary)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(summary.read_text())
    assert report["steps"] == 3 and report["dataset_size"] == 48
    assert report["audit"] == [{"epoch": 0, "count": 48, "expected": 48, "ok": True}]
    usage = subprocess.run([sys.executable, str(MAIN), "-a", "tinycnn"], capture_output=True,
                           text=True, timeout=120)
    assert usage.returncode == 2 and "DIR is required unless --dummy" in usage.stderr


def test_the_best_model_survives_a_validation_after_the_last_checkpoint(tmp_path: Path) -> None:
    """A run stopped by --max-steps mid-epoch validates after its last checkpoint; the
    best model it kept must not be replaced by a worse one when the run is resumed."""
    import json
    import subprocess

    from elastic_kit import CheckpointStore
    from elastic_kit.testing import make_imagefolder

    data = tmp_path / "data"
    make_imagefolder(str(data), classes=8, per_class=8, val_per_class=4, size=16)
    common = [sys.executable, str(MAIN), str(data), "-a", "tinycnn", "--image-size", "16",
              "--epochs", "4", "-b", "8", "--global-batch-size", "8", "-j", "0",
              "--snapshot-every", "0", "--checkpoint-every", "100", "--lr", "0.3",
              "--checkpoint-dir", str(tmp_path / "ck")]
    kept = []
    for max_steps in (3, 8):
        summary = tmp_path / f"summary-{max_steps}.json"
        done = subprocess.run([*common, "--max-steps", str(max_steps), "--summary-json",
                               str(summary)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        best = CheckpointStore(str(tmp_path / "ck" / "best")).load()
        report = json.loads(summary.read_text())
        kept.append((best.metadata["acc1"], report["best_acc1"], report["final_top1"]))
    (first_kept, first_best, first_final), (kept_now, best_now, final_now) = kept
    assert first_kept == first_best == first_final  # the stop's own validation was kept
    assert kept_now == best_now == max(first_kept, best_now, final_now)
    assert kept_now >= first_kept


def test_the_summary_never_follows_a_link_planted_at_a_temporary_name(tmp_path: Path) -> None:
    """``--summary-json /tmp/...``: another user of a shared directory cannot have the
    write land in a file of their choosing (a link at the temporary name it used to
    take from the pid); the temporary file is made afresh, and the summary replaces
    whatever is at its own path."""
    import json
    import os

    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    planted = tmp_path / f"summary.json.tmp-{os.getpid()}"
    planted.symlink_to(victim)
    out = tmp_path / "summary.json"
    load_main().write_json_atomically(str(out), {"a": 1})
    assert victim.read_text() == "mine"
    assert json.loads(out.read_text()) == {"a": 1} and not out.is_symlink()
    umask = os.umask(0)
    os.umask(umask)
    assert out.stat().st_mode & 0o777 == 0o666 & ~umask  # as open() makes a file
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["victim.txt", planted.name, "summary.json"])
