"""A worker's exit: the shutdown's garbage collections are spared the objects that
exist at the library's exit hook, and what an open file holds is written first."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from elastic_kit.distributed import _spare_exit_collections


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the rest of the test session collects as usual


def test_the_objects_are_frozen_and_a_file_in_a_cycle_is_flushed_first(
        tmp_path: Path, unfrozen: None) -> None:
    class Holder:
        pass

    holder = Holder()
    holder.self = holder  # a reference cycle: only the collector would close the file
    holder.file = open(tmp_path / "metrics.csv", "w")  # noqa: SIM115
    holder.file.write("step,loss\n1,0.5\n")
    text = (tmp_path / "metrics.csv").read_text()
    assert text == ""  # still in the buffer
    frozen_before = gc.get_freeze_count()

    _spare_exit_collections()

    assert (tmp_path / "metrics.csv").read_text() == "step,loss\n1,0.5\n"
    assert gc.get_freeze_count() > frozen_before + 1000
    assert not holder.file.closed  # flushed, not closed: the script may still write
    holder.file.close()
