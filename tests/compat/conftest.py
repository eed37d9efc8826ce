"""CI's compatibility tier (.ci/compat_tier) runs the tests marked `compat`, in a venv per torch release we support
(the oldest and the newest), and the runs of test_runs_on_this_torch.py: the documented short command of a preset of
each engine and layout, a resume of each checkpoint format, compiled blocks, a dry run. On the default torch the main
suite makes those runs and more (every preset trained, compared and resumed: tests/strategies, tests/checkpoints), so
there they are not collected."""

from __future__ import annotations

import os

TIER = os.environ.get("LD_COMPAT_TIER") == "1"
collect_ignore = [] if TIER else ["test_runs_on_this_torch.py"]
