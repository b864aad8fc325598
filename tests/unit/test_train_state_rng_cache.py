"""numpy's generator state as a step-end mark captures it after a restore: the state
restored, cached normal included, never one kept from before."""

from __future__ import annotations

import numpy as np

from elastic_kit.state import raw_rng_state
from elastic_kit.state._train_state import capture_rng_state, restore_rng_state


def test_capture_after_restore_sees_the_restored_cached_normal() -> None:
    np.random.seed(1234)
    np.random.standard_normal()            # draws two, keeps one: has_gauss = 1
    saved = capture_rng_state()
    assert saved["numpy"]["has_gauss"] == 1
    np.random.standard_normal()            # takes the kept one: same MT19937 bytes
    raw_rng_state()                        # a step-end mark: (bytes, has_gauss=0) kept
    restore_rng_state(saved)               # back to (bytes, has_gauss=1)
    again = capture_rng_state()
    assert again["numpy"]["has_gauss"] == 1
    assert again["numpy"]["cached_gaussian"] == saved["numpy"]["cached_gaussian"]
    first = [np.random.standard_normal() for _ in range(3)]
    restore_rng_state(again)               # what the mark captured replays the draws
    assert [np.random.standard_normal() for _ in range(3)] == first
