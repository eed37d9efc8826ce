"""Whether a run can write where it is told to, asked before anything is written there."""

from __future__ import annotations

import tempfile
from pathlib import Path


def unwritable_because(directory: str | Path) -> str | None:
    """Why no file can be written in `directory`, or None where one can. The directory need not exist yet: what
    matters then is its nearest existing parent, where it would be made. Tried, not inferred from permission bits,
    which say nothing of read-only file systems or of root."""
    existing = Path(directory).absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        return f"{existing}: {error.strerror.lower() if error.strerror else error}"
    return None
