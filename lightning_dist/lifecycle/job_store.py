"""What the processes of a torchrun job tell each other before their process group exists, through torchrun's own
store (node 0's agent hosts it; every worker reaches it at MASTER_ADDR:MASTER_PORT).

Under torchrun each worker runs the whole of `python train.py`: the checks before launch and the choice of the
checkpoint `resume=...` continues from are made in every process. Two decisions must be the same everywhere:

- a configuration one rank refuses (a path that exists on one node only, a mistyped override on one node's command
  line) ends every rank at once, with that rank's line; the others used to wait for it in the rendezvous for the
  whole `strategy.timeout` (30 minutes by default);
- the checkpoint to resume from is global rank 0's choice, given to the others: a save landing between two nodes'
  searches would have them resume from different steps.

Elsewhere (ranks Lightning starts, SLURM tasks) there is nothing to do here: Lightning's ranks inherit the decisions
of the process that starts them, and `srun --kill-on-bad-exit=1` (recipes/multi_node/train.sbatch) ends a job's
tasks when one fails.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

_POLL_S = 0.5


def _job_key(name: str) -> str:
    # A restarted torchrun job (--max-restarts) is a new attempt: nothing an earlier one said applies to it.
    run, attempt = os.environ.get("TORCHELASTIC_RUN_ID", ""), os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"lightning_dist/{run}/{attempt}/{name}"


REFUSED = "refused"
REFUSERS = "refusers"  # counts the ranks that refused: the first says why, the others only count
READ_BY = "refusal_read_by"  # counts the ranks that have read the refusal (or refused too)
RESUME_FROM = "resume_from"
# How long a refusing rank keeps its process, and so its node's agent and the store the agent hosts, alive for the
# other ranks to read why: node 0's agent hosts it, and a run directory is claimed on node 0 (global rank 0). The
# others read it within a second once they wait for the process group; a node still starting takes longer.
LINGER_S = 30.0


def agent_store(timeout: timedelta = timedelta(seconds=10)) -> Any | None:
    """A client of the torchrun agent's store, or None where this process is not a torchrun worker."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_PORT" not in os.environ:
        return None
    from torch.distributed import TCPStore

    return TCPStore(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=timeout)


def tell_refusal(message: str) -> None:
    """This rank refused the run's configuration: say so to every other rank of the job (torchrun only). On node 0,
    wait until they have read it (up to `LINGER_S`): this process's end ends its agent and the store with it."""
    try:
        store = agent_store(timeout=timedelta(seconds=5))
        if store is None:
            return
        if store.add(_job_key(REFUSERS), 1) > 1:  # the first refusal is the one the job reports
            store.add(_job_key(READ_BY), 1)
            return
        store.set(_job_key(REFUSED), f"rank {os.environ.get('RANK', '?')}: {message}")
        if os.environ.get("GROUP_RANK", "0") != "0":  # the store is on node 0 (its agent's): it stays when this ends
            return
        others = int(os.environ.get("WORLD_SIZE", "1")) - 1
        deadline = time.monotonic() + LINGER_S
        while store.add(_job_key(READ_BY), 0) < others and time.monotonic() < deadline:
            time.sleep(_POLL_S)
    except Exception:  # noqa: BLE001  the refusal is said on this rank already; the others learn that its node is gone
        pass


def refusal(store: Any) -> str | None:
    """Another rank's refusal ("rank N: <its line>"), if one was said; counted as read by this rank."""
    key = _job_key(REFUSED)
    if not store.check([key]):
        return None
    said = store.get(key).decode()
    store.add(_job_key(READ_BY), 1)
    return said


def shared_choice(choose: Any, timeout: timedelta) -> str | None:
    """`choose()` on global rank 0, given to every other rank of a torchrun job (which waits for it, or for a
    refusal, up to `timeout`); `choose()` itself elsewhere. The choice is a string or None."""
    store = agent_store(timeout)
    if store is None:
        return choose()
    key = _job_key(RESUME_FROM)
    if os.environ.get("RANK") == "0":
        chosen = choose()
        store.set(key, "" if chosen is None else chosen)
        return chosen
    deadline = time.monotonic() + timeout.total_seconds()
    while not store.check([key]):
        if (said := refusal(store)) is not None:
            raise RefusedElsewhere(said)
        if time.monotonic() > deadline:
            raise TimeoutError(f"global rank 0 did not say which checkpoint to resume from within {timeout}")
        time.sleep(_POLL_S)
    return store.get(key).decode() or None


class RefusedElsewhere(RuntimeError):
    """Another rank of the job refused its configuration before launch."""

    exit_code = 2  # refused (exits.py, which tells the other ranks through this module)

    def __init__(self, said: str) -> None:
        super().__init__(
            f"{said.split(':', 1)[0]} refused the run's configuration, so this rank stops too: "
            f"{said.split(':', 1)[1].strip()}"
        )
