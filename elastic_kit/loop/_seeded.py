"""Per-sample seeded randomness: sample ``i`` of epoch ``e`` augments the same way
whichever rank, data-loader worker or restart produces it.

:class:`SeededDataset` wraps a dataset (and optionally a random transform) and, inside
``__getitem__``, seeds Python's ``random``, numpy's global generator and torch's CPU
generator from ``(seed, epoch, index)``, runs the dataset access and the transform,
and restores the previous generator states. torchvision's random transforms draw from
those global generators, so they become a pure function of ``(seed, epoch, index)``.

The epoch reaches data-loader worker processes through the index itself: the
:class:`~elastic_kit.loop.ElasticLoop`, and an
:class:`~elastic_kit.ElasticDistributedSampler` built on the wrapped dataset, ask for
``dataset[(epoch, index)]``, which works with any ``num_workers`` and with
``persistent_workers=True``. Plain integer indices use :attr:`SeededDataset.epoch`
(set it with :meth:`set_epoch` before the loader's iterator is created).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from elastic_kit._checks import check_bool, check_int, type_error

__all__ = ["SeededDataset", "seeded_rng", "sample_seed"]


def sample_seed(seed: int, epoch: int, index: int) -> list[int]:
    """Four 32-bit words derived from ``(seed, epoch, index)`` (numpy SeedSequence)."""
    if min(seed, epoch, index) < 0:
        raise ValueError(f"seed={seed}, epoch={epoch}, index={index} must all be >= 0")
    return [int(w) for w in np.random.SeedSequence([seed, epoch, index]).generate_state(4)]


@contextlib.contextmanager
def seeded_rng(seed: int, epoch: int, index: int) -> Iterator[None]:
    """Seed ``random``, ``numpy.random`` and torch's CPU generator; restore on exit.

    Only the CPU generator of torch is touched (``torch.manual_seed`` would also
    reseed every CUDA device of the process).

    Example::

        with seeded_rng(0, epoch, i):
            img = random_crop(img)      # the same crop for (0, epoch, i) everywhere
    """
    w = sample_seed(seed, epoch, index)
    py_state = random.getstate()
    np_state = np.random.get_state()
    gen = torch.random.default_generator
    torch_state = gen.get_state()
    try:
        random.seed((w[0] << 32) | w[1])
        np.random.seed(w[2])
        gen.manual_seed((w[3] << 32) | w[0])
        yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)
        gen.set_state(torch_state)


class SeededDataset(Dataset):
    """Make a dataset's random augmentation a function of ``(seed, epoch, index)``.

    Args:
        dataset: the wrapped map-style dataset (its own transforms run seeded too).
        transform: optional extra callable applied to the sample, seeded likewise
            (``TypeError`` when it is not callable).
        seed: the run's augmentation seed (an int >= 0; numpy and torch integers too).
        return_index: return ``(index, sample)`` instead of ``sample``.

    ``dataset[i]`` uses :attr:`epoch`; ``dataset[(epoch, i)]`` names the epoch
    explicitly (what the loop does, so loader workers never hold a stale epoch).

    Example::

        train_set = SeededDataset(ImageFolder(root, transform=augment), seed=0)
        loop = ElasticLoop(state, train_set, loss_fn=..., ...)   # epochs reach workers

        # a loop of one's own: the sampler deals (epoch, index) keys to this dataset
        sampler = ElasticDistributedSampler(train_set)
        loader = DataLoader(train_set, batch_size=64, sampler=sampler, num_workers=4)

    .. warning::
        Randomness drawn *outside* ``__getitem__`` (e.g. in a ``collate_fn``) is not
        covered.

    .. warning::
        Wrap it outermost (``SeededDataset(Subset(data, indices))``, not
        ``Subset(SeededDataset(data), indices)``): a ``Subset`` or ``ConcatDataset``
        hands it plain indices, so it would use :attr:`epoch` (refused by the loop;
        in a loop of one's own, call :meth:`set_epoch` before each epoch's iterator).
    """

    #: ``dataset[(epoch, index)]`` works: an ElasticDistributedSampler deals such keys
    takes_epoch_keys = True

    def __init__(self, dataset: Any, transform: Callable[[Any], Any] | None = None, *,
                 seed: int = 0, return_index: bool = False) -> None:
        seed = check_int("seed", seed, minimum=0)  # numpy and torch integers too
        if transform is not None and not callable(transform):
            # otherwise an "'int' object is not callable" inside a loader worker
            raise type_error("transform", transform, "None or a callable sample -> sample")
        return_index = check_bool("return_index", return_index)
        self.dataset = dataset
        self.transform = transform
        self.seed = seed
        self.return_index = return_index
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """The epoch used for plain integer indices (an int >= 0; numpy and torch
        integers too: ``set_epoch(1.5)`` or ``set_epoch(-1)`` raise here, not as the
        first sample is drawn)."""
        self.epoch = check_int("epoch", epoch, minimum=0)

    def __len__(self) -> int:
        return len(self.dataset)

    def get(self, epoch: int, index: int) -> Any:
        """Sample ``index`` as augmented in ``epoch`` (never the index)."""
        index = int(index)
        with seeded_rng(self.seed, int(epoch), index):
            sample = self.dataset[index]
            if self.transform is not None:
                sample = self.transform(sample)
        return sample

    def __getitem__(self, key: int | tuple[int, int]) -> Any:
        if isinstance(key, tuple):
            epoch, index = key
        else:
            epoch, index = self.epoch, key
        sample = self.get(epoch, index)
        return (int(index), sample) if self.return_index else sample
