"""A restore from a sharded state's parts in memory (into sharded state, or whole into
an unsharded one) uses only a snapshot with a part of every saving rank that
verifies; one passed over is named, for the restore line, never loaded in part."""

from __future__ import annotations

from pathlib import Path

import elastic_kit as ek
from elastic_kit.snapshot._shards import Listing, load_parts

_INFO = ek.DistInfo(rank=0, local_rank=0, world_size=1, run_id="job")


def _listing(step: int, rank: int, path: str, group: str = "g") -> Listing:
    return Listing(step=step, group=group, rank=rank, world_size=3,
                   key=(step, 0, step * 10), path=path, own=True)


def _load(found: list[Listing]) -> tuple[object, list[tuple[str, int, str]]]:
    notes: list[tuple[str, int, str]] = []
    loaded, all_local = load_parts(info=_INFO, node="node0", found=found, into=None,
                                   device=None, on_skip=lambda *n: notes.append(n))
    assert all_local is False
    return loaded, notes


def test_parts_missing_a_rank_are_named_and_not_loaded() -> None:
    found = [_listing(4, 0, "/s/p0/step-4"), _listing(4, 2, "/s/r/step-4"),
             _listing(7, 0, "/s/p0/step-7"), _listing(7, 2, "/s/r/step-7"),
             _listing(7, 1, "/s/q/step-7", group="another save")]
    loaded, notes = _load(found)
    assert loaded is None
    # the newest snapshot held in part, and which saving rank's part no node holds
    assert notes == [("/s/p0/step-7", 7,
                      "a sharded snapshot of 3 ranks, and no node holds the part of rank(s) 1")]


def test_a_complete_snapshot_whose_part_cannot_be_read_is_passed_over(
        tmp_path: Path) -> None:
    gone = [str(tmp_path / f"p{r}" / "step-000000000005") for r in range(3)]
    loaded, notes = _load([_listing(5, r, gone[r]) for r in range(3)])
    assert loaded is None
    assert notes == [(gone[0], 5, "a part of it verifies on no node")]


def test_no_parts_no_note() -> None:
    assert _load([]) == (None, [])


def _load_after(found: list[Listing], newer_than: int) -> list[tuple[str, int, str]]:
    notes: list[tuple[str, int, str]] = []
    loaded, _ = load_parts(info=_INFO, node="node0", found=found, into=None, device=None,
                           on_skip=lambda *n: notes.append(n), newer_than=newer_than)
    assert loaded is None
    return notes


def test_no_part_older_than_a_whole_snapshot_is_tried_and_the_newest_one_is_named() -> None:
    """Step 9 is held in part (rank 1's part nowhere), step 6 whole by parts; a whole
    snapshot of step 8 is held: step 6 would roll back past it, so it is not tried
    (the caller restores step 8), and the restore line names step 9."""
    found = [_listing(9, 0, "/s/p0/step-9"), _listing(9, 2, "/s/r/step-9"),
             _listing(6, 0, "/s/p0/step-6"), _listing(6, 1, "/s/r1/step-6"),
             _listing(6, 2, "/s/r/step-6")]
    notes = _load_after(found, newer_than=8)
    assert [(step, why) for _, step, why in notes] == [
        (9, "a sharded snapshot of 3 ranks, and no node holds the part of rank(s) 1")]
    # without a whole snapshot, step 6 is tried (here its files are not there) after
    # step 9 is named
    notes = _load_after(found, newer_than=-1)
    assert [step for _, step, _ in notes] == [9, 6]
    assert notes[1][2] == "a part of it verifies on no node"
