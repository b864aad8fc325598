"""The in-memory snapshot tier: training state that outlives a torchrun group restart.

torchrun kills and restarts the whole worker group on every failure or membership
change; the next group resumes from the newest durable checkpoint and redoes the
steps since. :class:`SnapshotTier` keeps the full training state every few steps in
node-local shared memory (``/dev/shm``), which belongs to the host rather than to the
worker processes, so a restarted group finds it and loses at most a step or two.

Layout, on every host::

    /dev/shm/elastic_kit/<run id>-<store key>/<host>-<agent pid>/step-<n>/{state.pt,manifest.json}

It is a node-local :class:`~elastic_kit.CheckpointStore` with ``keep_last=2``: two
slots, the manifest (size and xxh3 checksum of the payload) written last, the older
slot deleted only after the newer one committed, so a kill at any moment leaves the
previous snapshot valid. The directory is named by the torchrun run id and a hash of
the durable store's URL (a snapshot of another run or another store is never seen),
and by the agent, which survives the worker restarts it drives.

Because a data-parallel job holds the same state on every node, each node's snapshot
is a full replica: losing a whole node loses nothing while another node lives, and a
node that joins (or lost its memory) receives the newest snapshot from a peer by the
store's tensor-by-tensor broadcast, keeping a copy. The state is the same
:class:`~elastic_kit.TrainState` dict as a durable checkpoint (sampler position, audit,
RNG, optimizer), so exact data accounting and bitwise resume hold; since the sampler's
position is global, a snapshot taken at one world size restores at any other.
"""

from elastic_kit.snapshot._tier import SnapshotTier, default_root, snapshot_dir

__all__ = ["SnapshotTier", "default_root", "snapshot_dir"]
