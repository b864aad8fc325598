"""The in-memory snapshot tier: training state that outlives a torchrun group restart.

torchrun kills and restarts the whole worker group on every failure or membership
change; the next group resumes from the newest durable checkpoint and redoes the
steps since. :class:`SnapshotTier` keeps the full training state every few steps in
node-local shared memory (``/dev/shm``), which belongs to the host rather than to the
worker processes, so a restarted group finds it and redoes only the steps since
(every step is snapshotted while that takes under 1% of the training time;
less often when steps are short or the state large). Taking a snapshot costs the
training thread one copy of the state, straight into a file in shared memory that is
mapped once and reused (two files rotate, see :mod:`elastic_kit.snapshot._slots`; on
CUDA the mapping is registered as pinned memory, so the copy runs at the bus's
speed); the checksums (on a few threads) and the commit run on a background thread,
and a snapshot taken while the previous one is written waits for it in staging
buffers (a newer one replaces it), so training never waits for a write.

Layout, on every host (per user: directories 0700, files 0600)::

    /dev/shm/elastic_kit-<uid>/<run id>-<store key>/<host>-<agent pid>_<start>/step-<n>/{tensors.bin,state.pt,manifest.json}
    /dev/shm/elastic_kit-<uid>/<run id>-<store key>/<host>-<agent pid>_<start>/.slot-<pid>.<start>-...   (the next snapshot's file)
    /dev/shm/elastic_kit-<uid>/<run id>-<store key>/<host>-<agent pid>_<start>/replicas/<peer node>/step-<n>/...

Each snapshot is a checkpoint of the store's format (:func:`elastic_kit.store.commit_flat`):
the tensors' raw bytes in one tensor file, the rest (ints, RNG state, the sampler's
dict) in a small payload, and the manifest, written last, indexing every tensor and
chunk with its xxh3 checksum; the older snapshot is deleted only after the newer one
committed (its file then moves back out to take the next snapshot), so a kill at any
moment leaves the previous snapshot valid. The directory is named by the torchrun run id and a hash of
the durable store's URL, and by the agent, which survives the worker restarts it
drives. Names repeat (a reused job id, a container's agent pid, a store deleted to
start over), so every snapshot also records the run identity the durable store holds
(:meth:`~elastic_kit.CheckpointStore.run_identity`), and one carrying another identity
is never loaded and is removed at the next launch: a deleted or replaced store starts
fresh. Without a durable store there are no snapshots. Every directory of the tree is
checked to be the user's alone (:mod:`elastic_kit.snapshot._private`).

Each node's writer also streams every snapshot it commits into the next node's memory
(ring order over the nodes, a TCP side channel, see
:mod:`elastic_kit.snapshot._replica`), so a node's state outlives the whole node: a
node holds its own snapshot and one peer's replica (plus, for a moment, the next of
each). A data-parallel job holds the same state on every node, so each node's own
snapshot is a full replica already; the streamed one covers what only one node held
(a node that joined or restarted late, a snapshot write that failed on a node).

On restore the ranks agree on the newest snapshot held anywhere (own or replica; its
file is mapped and its chunks verified on a few threads; a corrupt or truncated one
is skipped for the next newest source) and its holder broadcasts it tensor by tensor
(the holder's tensors are views of the mapping: no copy on the CPU, one copy to the
device through the mapping registered as pinned memory on CUDA); a node that lacked it keeps a copy. The state is the
same :class:`~elastic_kit.TrainState` dict as a durable checkpoint (sampler position,
audit, RNG, optimizer), so exact data accounting and bitwise resume hold; since the
sampler's position is global, a snapshot taken at one world size restores at any other.

Sharded state (FSDP2, DTensors): every rank writes its own *part* (its shards and the
rest) and streams it to the next node; a restore at any world size takes each range a
rank now owns from whichever node holds it (:mod:`elastic_kit.snapshot._shards`).
Either kind restores into the other (a script that shards only at world size > 1): an
unsharded state takes the parts whole, a sharded state a whole snapshot's shards.
"""

from elastic_kit.snapshot._leftovers import SnapshotRun, remove_idle_runs, snapshot_runs
from elastic_kit.snapshot._tier import (
    DEFAULT_BUDGET, SnapshotTier, agree_run_identity, default_root, interval_for,
    snapshot_dir,
)

__all__ = ["DEFAULT_BUDGET", "SnapshotTier", "agree_run_identity", "default_root",
           "interval_for", "snapshot_dir", "SnapshotRun", "snapshot_runs", "remove_idle_runs"]
