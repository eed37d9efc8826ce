"""What every rank does before its process group exists (lightning_dist/parallel/devices.py)."""

import subprocess
import sys
import textwrap

from tests.conftest import REPO, free_port

# An exit handler registered first runs last: it sees what the package's handler left.
PROCESS_GROUP_AT_EXIT = textwrap.dedent("""
    import atexit, datetime, sys
    import torch.distributed as dist
    atexit.register(lambda: print("initialized at exit:", dist.is_initialized(), flush=True))
    from lightning_dist.parallel.devices import close_process_group_at_exit, prepare_rank
    import torch
    prepare_rank(torch.device("cpu"), 1, datetime.timedelta(seconds=60))
    close_process_group_at_exit()  # a second strategy in the same process registers it again: still one handler
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    print("initialized in the run:", dist.is_initialized(), flush=True)
""")


def test_the_process_group_is_destroyed_when_the_process_exits():
    process = subprocess.run(
        [sys.executable, "-c", PROCESS_GROUP_AT_EXIT.format(port=free_port())],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert process.returncode == 0, process.stderr
    assert process.stdout.splitlines() == ["initialized in the run: True", "initialized at exit: False"]
