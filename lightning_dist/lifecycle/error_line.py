"""A run's one line, written whole: `error: ...` on stderr in a single write.

The ranks torchrun starts on a node share its standard streams, and several of them often say the same refusal at
once. `print` writes the text and the newline separately, so two ranks' lines came out as one
(`error: ...1error: ...1` and then two newlines), which no reader of the first line can parse.
"""

from __future__ import annotations

import sys


def say_error(text: str) -> None:
    """`error: text` and its newline on stderr, in one write (a line under the pipe's 4 KiB is never split)."""
    sys.stderr.write(f"error: {text}\n")
    sys.stderr.flush()
