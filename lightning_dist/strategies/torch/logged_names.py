"""What the last pipeline stage logged in a step (names, options, which values are deferred means), told to the
other stages of its pipeline, which log the same: through the process group's store, and only when it changed.

The values themselves travel as one tensor broadcast on the device. The names used to travel with
`broadcast_object_list`, whose receivers read the object's size on the host: a device synchronisation in every
step, quiet ones included. The store is a key-value server on the host (the one the process group formed through),
so telling the names reads nothing from a device; and after the first step a user's step logs the same names, so
what the store carries is an empty marker: "as before".
"""

from __future__ import annotations

import pickle
from typing import Any

from lightning_dist._compat.torch import default_process_group_store

_PREFIX = "lightning_dist/pipeline_logged_names"


class LoggedNames:
    """The last stage's logged names on every stage of one pipeline, exchanged once per step (the same number of
    times on every rank of the pipeline: each step, and each held-out batch, calls `exchange` once)."""

    def __init__(self, sender: int, sends: bool, receivers: int) -> None:
        self._store = default_process_group_store()
        self._prefix = f"{_PREFIX}/{sender}/"  # one pipeline's keys: its last stage's global rank
        self._sends, self._receivers = sends, receivers
        self._exchanges = 0
        self._sent = b""
        self._names: Any = None

    def exchange(self, names: Any = None) -> Any:
        """On the sender: `names`, passed on. On the others: the sender's names of this exchange."""
        key = f"{self._prefix}{self._exchanges}"
        self._exchanges += 1
        if self._sends:
            blob = pickle.dumps(names)
            self._store.set(key, b"" if blob == self._sent else blob)
            self._sent, self._names = blob, names
            return names
        told = self._store.get(key)  # waits until the sender has set it
        if told:
            self._names = pickle.loads(told)
        # The last receiver to read a key removes it: the store keeps no key per step of a long run. (The sender
        # cannot: in quiet steps its host may run steps ahead of theirs.)
        if self._store.add(f"{key}/read", 1) == self._receivers:
            self._store.delete_key(key)
            self._store.delete_key(f"{key}/read")
        return self._names
