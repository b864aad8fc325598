"""The synthetic ImageNet-style data set: deterministic, complete, loadable, learnable."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from elastic_kit.testing import make_imagefolder

import torchvision  # noqa: E402  (a test dependency: a missing one must fail, not skip)


def _digest_tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_same_seed_gives_byte_identical_files_and_cli_matches_api(tmp_path: Path) -> None:
    a = make_imagefolder(tmp_path / "a", classes=3, per_class=5, val_per_class=2, size=16, seed=7)
    subprocess.run(
        [sys.executable, "-m", "elastic_kit.testing.make_imagefolder", str(tmp_path / "b"),
         "--classes", "3", "--per-class", "5", "--val-per-class", "2", "--size", "16",
         "--seed", "7"],
        check=True, capture_output=True,
    )
    c = make_imagefolder(tmp_path / "c", classes=3, per_class=5, val_per_class=2, size=16, seed=8)
    da, db, dc = _digest_tree(a), _digest_tree(tmp_path / "b"), _digest_tree(c)
    assert da == db
    jpgs = [k for k in da if k.endswith(".jpg")]
    assert all(da[k] != dc[k] for k in jpgs)  # another seed: other pixels everywhere


def test_counts_layout_and_imagefolder_loads_it(tmp_path: Path) -> None:
    root = make_imagefolder(tmp_path / "d", classes=4, per_class=6, val_per_class=3, size=20)
    train = torchvision.datasets.ImageFolder(str(root / "train"))
    val = torchvision.datasets.ImageFolder(str(root / "val"))
    assert len(train) == 24 and len(val) == 12
    assert train.classes == val.classes == [f"class_{c:02d}" for c in range(4)]
    assert sorted(t for _, t in train.samples).count(3) == 6
    img, target = train[0]
    assert img.size == (20, 20) and img.mode == "RGB" and target == 0
    jpeg = (root / "train" / "class_00" / "img_0000.jpg").read_bytes()
    assert jpeg[:2] == b"\xff\xd8"  # JPEG start-of-image marker
    assert json.loads((root / "dataset.json").read_text())["per_class"] == 6


def test_existing_directory_is_reused_when_same_and_refused_when_different(tmp_path: Path) -> None:
    root = make_imagefolder(tmp_path / "e", classes=2, per_class=2, val_per_class=1, size=8)
    before = _digest_tree(root)
    assert make_imagefolder(root, classes=2, per_class=2, val_per_class=1, size=8) == root
    assert _digest_tree(root) == before
    with pytest.raises(FileExistsError, match="per_class"):
        make_imagefolder(root, classes=2, per_class=3, val_per_class=1, size=8)
    make_imagefolder(root, classes=2, per_class=3, val_per_class=1, size=8, overwrite=True)
    assert len(list((root / "train" / "class_01").glob("*.jpg"))) == 3
    with pytest.raises(ValueError, match="classes=1"):
        make_imagefolder(tmp_path / "f", classes=1)


def test_the_command_says_a_different_data_set_is_there_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from elastic_kit.testing._imagefolder import main

    root = make_imagefolder(tmp_path / "e", classes=2, per_class=2, val_per_class=1, size=8)
    with pytest.raises(SystemExit) as exit_info:
        main([str(root), "--classes", "2", "--per-class", "3", "--val-per-class", "1",
              "--size", "8"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "--overwrite" in err


def test_a_tiny_cnn_learns_it_well_above_chance(tmp_path: Path) -> None:
    classes = 5
    root = make_imagefolder(tmp_path / "g", classes=classes, per_class=24, val_per_class=8, size=16)
    tf = torchvision.transforms
    norm = tf.Compose([tf.ToTensor(), tf.Normalize([0.5] * 3, [0.25] * 3)])
    train_aug = tf.Compose([tf.RandomResizedCrop(16, scale=(0.35, 1.0)),
                            tf.RandomHorizontalFlip(), norm])

    def stack(ds: torch.utils.data.Dataset) -> tuple[torch.Tensor, torch.Tensor]:
        xs, ys = zip(*[ds[i] for i in range(len(ds))])
        return torch.stack(xs), torch.tensor(ys)

    torch.manual_seed(0)
    train = torchvision.datasets.ImageFolder(str(root / "train"), transform=train_aug)
    xv, yv = stack(torchvision.datasets.ImageFolder(str(root / "val"), transform=norm))
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        nn.Flatten(), nn.Linear(32, classes),
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(4):  # epochs, each one fresh random crops of the whole train split
        x, y = stack(train)
        for i in range(0, len(y), 30):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[i:i + 30]), y[i:i + 30]).backward()
            opt.step()
    with torch.no_grad():
        acc = (model(xv).argmax(1) == yv).float().mean().item()
    assert acc > 2.0 / classes, f"val accuracy {acc:.2f} is not well above chance {1 / classes:.2f}"


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another uid needs root")
def test_another_users_data_set_is_not_reused(tmp_path: Path) -> None:
    """One made first by another user (in /tmp, where the README's command writes)
    with the same arguments could hold any images: refused, not reused."""
    out = make_imagefolder(tmp_path / "d", classes=2, per_class=2, val_per_class=1, size=8)
    os.chown(out, 1001, 1001)
    with pytest.raises(PermissionError, match=r"belongs to uid 1001, not to this user"):
        make_imagefolder(out, classes=2, per_class=2, val_per_class=1, size=8)
