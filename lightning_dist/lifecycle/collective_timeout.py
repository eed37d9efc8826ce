"""When another rank fails this one: one line that says which of three things happened, instead of a backend's stack
trace (gloo: "Timed out waiting 30000ms for recv operation", "Connection closed by peer ... GLHF!"):

- another rank is stuck (or slower than `strategy.timeout`): this rank waited that long in a collective, or for
  every rank to join the process group (the set-up, before the first step);
- another rank exited (or was killed): its connection closed; a rank that left with an error said which, with its
  exit code (peer_exits.py);
- another rank cannot be reached: the connection was refused, as when a node advertises an address the others do
  not reach (a host name that resolves to 127.0.1.1, Debian's and Ubuntu's default, without GLOO_SOCKET_IFNAME).

The set-up has a bound of its own (`forming_process_group`): a rendezvous or a connection that hangs in native
code past `strategy.timeout` ends the rank, where the library gives no bound; in a torchrun job, a rank that
refused its configuration ends the others at once (job_store.py).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from lightning_dist.lifecycle.error_line import say_error
from lightning_dist.lifecycle.exits import undo_refused_run
from lightning_dist.lifecycle.job_store import RefusedElsewhere, agent_store, refusal
from lightning_dist.lifecycle.peer_exits import first_ended, first_stopped, ranks_on_this_node, said_leaving

_TIMEOUT_MESSAGE = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_EXITED = re.compile(r"connection (closed|reset) by peer|broken pipe", re.IGNORECASE)
_REFUSED = re.compile(r"connection refused", re.IGNORECASE)
# How long past `strategy.timeout` a set-up stuck where no timeout of the library's reaches is given, before the
# rank ends itself: the library's own timeout, when it fires, says more.
SETUP_GRACE_S = 30.0
# A torchrun worker that cannot reach the store its node-0 agent hosts for this long, while the process group forms,
# has lost node 0: the agent ends with its workers, which stop only by failing or refusing (their output says why).
# Each try to connect waits 10 s (job_store.agent_store).
STORE_GONE_S = 30.0

_setting_up = False  # within `forming_process_group`, until the process group formed


class CollectiveFailure(RuntimeError):
    """This rank cannot go on because of another rank: stuck, exited, or unreachable."""

    caused_elsewhere = True  # said by peer_exits to no other rank: the cause is the rank it names, or another


class CollectiveTimeout(CollectiveFailure):
    """This rank gave up waiting in a collective: another rank is stuck, or slower than `strategy.timeout`."""


class PeerExited(CollectiveFailure):
    """Another rank's connection closed: it exited or was killed."""


class PeerUnreachable(CollectiveFailure):
    """Another rank's address refused the connection."""


def explain_collective_failure(error: BaseException, trainer: Any) -> CollectiveFailure | None:
    """The CollectiveFailure that `error` (raised out of `trainer.fit`) stands for, or None if it is another error."""
    if isinstance(error, CollectiveFailure):
        return error
    if not isinstance(error, RuntimeError):
        return None
    text = str(error)
    first_line = text.splitlines()[0] if text else type(error).__name__
    rank = trainer.global_rank
    when = "while the process group formed (set-up)" if _setting_up else f"at global step {trainer.global_step}"
    if _REFUSED.search(text):
        return PeerUnreachable(
            f"rank {rank} could not connect to another rank {when}: connection refused ({_backend_detail(first_line)});"
            " that rank advertised an address this node cannot reach: where a host name resolves to a loopback"
            " address (127.0.1.1 on Debian and Ubuntu), set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME on GPUs) to"
            " the network interface that joins the nodes"
        )
    if _PEER_EXITED.search(text):
        # The ranks this process started first: the launcher knows how each ended (a rank killed says nothing).
        if (ended := first_ended(_started_here(trainer), rank + 1)) is not None:
            return PeerExited(f"rank {rank} lost its connection to another rank {when}: {ended}")
        if (said := said_leaving()) is not None:
            return PeerExited(f"rank {rank} lost its connection to another rank {when}: {said}")
        return PeerExited(
            f"rank {rank} lost its connection to another rank {when}: that rank exited or was killed (its own output,"
            f" or its node's, says why); {_backend_detail(first_line)}"
        )
    if _TIMEOUT_MESSAGE.search(text):
        limit = _limit(trainer)
        if _setting_up:
            return CollectiveTimeout(
                f"rank {rank} waited longer than {limit} for every rank to join the process group (set-up, before the"
                f" first step): another rank exited before joining (its own output says why), or is stuck; {first_line}"
            )
        ranks = ranks_on_this_node(_started_here(trainer), rank, trainer.local_rank)
        if (stopped := first_stopped(ranks)) is not None:
            return CollectiveTimeout(f"rank {rank} waited in a collective at global step {trainer.global_step} longer"
                                     f" than {limit}: {stopped}; {first_line}")
        return CollectiveTimeout(
            f"rank {rank} waited in a collective at global step {trainer.global_step} longer than {limit}: another"
            f" rank did not reach it (stuck, or slower than the timeout); {first_line}"
        )
    return None


def _started_here(trainer: Any) -> list:
    """The processes of the ranks this one started (Lightning's launcher's), in local-rank order; none elsewhere."""
    return list(getattr(getattr(trainer.strategy, "launcher", None), "procs", None) or [])


@contextmanager
def forming_process_group(timeout: timedelta, rank: Callable[[], int]) -> Iterator[None]:
    """Within: the process group's set-up (rendezvous, every rank connecting to every other). A rank that is still
    here `SETUP_GRACE_S` after `timeout` prints why and ends: a peer that died while the backend connects can leave
    it waiting in native code that no timeout of the library's reaches (seen: over 200 s with a 60 s timeout)."""
    global _setting_up
    _setting_up = True
    formed = threading.Event()

    def end_unless_formed() -> None:
        deadline = time.monotonic() + timeout.total_seconds() + SETUP_GRACE_S
        store = None  # a torchrun job's: where a rank that refused its configuration said so
        torchrun = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        reached = time.monotonic()
        while not formed.wait(1.0):
            try:
                if store is None:
                    store = agent_store()
                said = refusal(store) if store is not None else None
                reached = time.monotonic()
            except Exception:  # noqa: BLE001  unreachable: node 0's agent ended, or the connection is slow
                store, said = None, None
            if said is not None:
                say_error(str(RefusedElsewhere(said)))
                undo_refused_run()  # a run refused leaves nothing in its directory (the edge's claim)
                os._exit(2)
            if torchrun and time.monotonic() - reached > STORE_GONE_S:
                say_error(f"rank {rank()}: the job's store (torchrun's agent on node 0, at"
                          f" {os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}) is gone, and with it"
                          " node 0, before the process group formed (set-up); its own output says why")
                os._exit(1)
            if time.monotonic() > deadline:
                say_error(f"rank {rank()} waited longer than strategy.timeout={timeout.total_seconds():g} s (and"
                          f" {SETUP_GRACE_S:g} s more) for every rank to join the process group (set-up, before the"
                          " first step): another rank exited before joining (its own output says why), or is stuck")
                os._exit(1)

    threading.Thread(target=end_unless_formed, name="process-group-set-up", daemon=True).start()
    try:
        yield
        _setting_up = False  # left set after an error: explain_collective_failure says it came in the set-up
    finally:
        formed.set()


def _limit(trainer: Any) -> str:
    from lightning_dist._compat.lightning import strategy_timeout  # a trainer exists: Lightning is loaded already

    seconds = strategy_timeout(trainer.strategy)
    return f"strategy.timeout={seconds.total_seconds():g} s" if seconds is not None else "the process group's timeout"


def _backend_detail(line: str) -> str:
    """The backend's own words without its source locations and advice: "Connection closed by peer [10.0.0.2]:21122",
    "timed out connecting: SO_ERROR: Connection refused, remote=[127.0.0.1]:29080"."""
    line = re.sub(r"\[[^\]\s]*\.(cc|cpp|h):\d+\]\s*", "", line.strip())
    line = line.replace("Gloo connectFullMesh failed with ", "").replace("$0", "")
    return line.split(". This is typically")[0].rstrip(".")
