"""Departures noticed and planned: heartbeats that find a silent host in seconds.

The process group notices a peer that died at once (its kernel resets the
connections) but waits for a peer that went silent until its timeout.
:func:`start_heartbeat` gives every worker of a multi-node group a side channel of
beats to its ring neighbour, so a frozen or unreachable host is noticed in a few
seconds and the survivors leave the hung collective (see
:mod:`elastic_kit.health._heartbeat`). A :class:`PreemptionWatcher` reads the cloud's
preemption notice (GCE, AWS, Azure metadata) or the scheduler's signal, so the
checkpointer can turn an announced departure into a planned leave with nothing lost
(see :mod:`elastic_kit.health._preemption`). In the launcher's agent, a planned
leave takes the node out of the rendezvous at once, a restart's rendezvous reads its
state every 0.1 s instead of every second, and it closes as soon as every node of the
last round is back (:mod:`elastic_kit.health._agent_leave`,
:mod:`elastic_kit.health._rdzv_poll`, :mod:`elastic_kit.health._rdzv_close`).
"""

from elastic_kit.health._preemption import (
    CLOUD_ENV, METADATA_URL_ENV, SIGNALS_ENV, PreemptionWatcher, detect_cloud,
    notice_from_metadata, preemption_signals,
)
from elastic_kit.health._agent_leave import (
    LEAVE_ENV, LEAVE_SIGNAL, install as install_agent_leave, leave_rendezvous,
    left as agent_left, uninstall as uninstall_agent_leave,
)
from elastic_kit.health._rdzv_close import install as install_rendezvous_close
from elastic_kit.health._stopped_workers import (
    install as install_resume_stopped, resume as resume_stopped_workers,
)
from elastic_kit.health._rdzv_poll import (
    LOWEST_POLL_S as RDZV_LOWEST_POLL_S, TORCH_POLL_S as RDZV_TORCH_POLL_S,
    install as install_rendezvous_poll,
    max_nodes as rendezvous_max_nodes, poll_seconds as rendezvous_poll_seconds,
)
from elastic_kit.health._heartbeat import (
    DEFAULT_INTERVAL_S, DEFAULT_TIMEOUT_S, HELLO_TIMEOUT_S, MAX_PENDING,
    SILENT_PEER_EXIT_CODE, TIMEOUT_ENV, Heartbeat, exit_for_silence, hello_mac,
    start_heartbeat, timeout_from_env,
)

__all__ = [
    "LEAVE_ENV", "LEAVE_SIGNAL", "agent_left", "install_agent_leave", "leave_rendezvous",
    "uninstall_agent_leave",
    "RDZV_LOWEST_POLL_S", "RDZV_TORCH_POLL_S", "install_rendezvous_close", "install_rendezvous_poll",
    "rendezvous_max_nodes", "rendezvous_poll_seconds", "install_resume_stopped",
    "resume_stopped_workers",
    "CLOUD_ENV", "METADATA_URL_ENV", "SIGNALS_ENV", "PreemptionWatcher", "detect_cloud",
    "notice_from_metadata", "preemption_signals",
    "DEFAULT_INTERVAL_S", "DEFAULT_TIMEOUT_S", "HELLO_TIMEOUT_S", "Heartbeat", "MAX_PENDING",
    "SILENT_PEER_EXIT_CODE", "TIMEOUT_ENV", "exit_for_silence", "hello_mac", "start_heartbeat",
    "timeout_from_env",
]
