"""Two `torchrun` "nodes" on one machine (scripts/two_nodes.py, which runs the full matrix): they train as one job,
a requeued job saves over what a cut-off save left in the shared run directory, and a node saving to a disk of its
own is refused at the first save."""

from __future__ import annotations

import json
import shutil
import socket

import pytest

from lightning_dist.checkpoints.manifest import MANIFEST
from lightning_dist.checkpoints.whole import is_whole
from scripts.two_nodes import SAVES, leftovers, run_nodes
from tests.warm_python import REAL_PYTHON

pytestmark = pytest.mark.slow

COMMAND_LINES = ("+callbacks.cmdline_probe._target_=tests.probes.CommandLineProbe",
                 "+callbacks.cmdline_probe.directory=${paths.output_dir}")


@pytest.mark.parametrize("strategy", ["ddp", "fsdp", "deepspeed_stage_2"])
def test_two_nodes_train_as_one_job_and_a_requeue_saves_over_a_cut_off_saves_leftovers(strategy, tmp_path, deepspeed_ops):
    run_dir = tmp_path / "run"
    first = run_nodes([f"strategy={strategy}", *SAVES, "trainer.max_steps=4", *COMMAND_LINES], run_dir)
    assert [node.code for node in first] == [0, 0], first[0].output[-3000:] + first[1].output[-3000:]
    summary = json.loads((run_dir / "metrics.json").read_text())
    assert (summary["world_size"], summary["num_nodes"], summary["train_batches_per_rank"]) == (2, 2, [4, 4])
    assert (summary["node_rank_per_rank"], summary["host_per_rank"]) == ([0, 1], [socket.gethostname()] * 2)
    # Each rank is the worker torchrun started on its node (Lightning started none), and both met at the one
    # rendezvous the agents agreed on.
    records = [json.loads((run_dir / f"cmdline_rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [f"hydra.job.name=node{node}" in record["cmdline"] for node, record in enumerate(records)] == [True, True]
    assert records[0]["master_port"] == records[1]["master_port"] and records[0]["pid"] != records[1]["pid"]
    assert {p.name for p in run_dir.glob("node*.log")} == {"node0.log", "node1.log"}

    # What a save cut off midway leaves: a real save's shards (or file) under the partial names of the saves the
    # requeued job makes, without the manifest that ends a whole save.
    checkpoints = run_dir / "checkpoints"
    for name in (".last.ckpt.partial", ".step000006.ckpt.partial"):
        if (checkpoints / "step000004.ckpt").is_dir():
            shutil.copytree(checkpoints / "step000004.ckpt", checkpoints / name)
            (checkpoints / name / MANIFEST).unlink(missing_ok=True)
        else:
            shutil.copy(checkpoints / "step000004.ckpt", checkpoints / name)
    assert leftovers(run_dir) == [".last.ckpt.partial", ".step000006.ckpt.partial"]

    requeued = run_nodes([f"strategy={strategy}", *SAVES, "trainer.max_steps=6", "resume=run_dir"], run_dir)
    assert [node.code for node in requeued] == [0, 0], requeued[0].output[-3000:] + requeued[1].output[-3000:]
    assert f"resume=run_dir: resuming from {checkpoints / 'last.ckpt'}" in requeued[0].output  # step 4's, saved last
    assert json.loads((run_dir / "metrics.json").read_text())["global_step"] == 6
    assert leftovers(run_dir) == []
    assert is_whole(checkpoints / "step000006.ckpt") and is_whole(checkpoints / "last.ckpt")


def test_a_node_saving_to_a_disk_of_its_own_is_refused_at_the_first_save(tmp_path):
    run_dir = tmp_path / "run"
    # A real interpreter: one forked by the suite's warm process would run outside node 1's mount namespace.
    nodes = run_nodes(["strategy=fsdp", *SAVES, "trainer.max_steps=4"], run_dir, own_disk=True, python=REAL_PYTHON)
    assert [node.code for node in nodes] == [1, 1], nodes[0].output[-3000:] + nodes[1].output[-3000:]
    said = (f"error: checkpoints in {run_dir / 'checkpoints'} are not on storage every node shares: {{who}} does not see"
            " a file global rank 0 wrote there, so no node could resume from the shards each keeps; put hydra.run.dir"
            " on a file system all nodes share")
    errors = [[line for line in node.output.splitlines() if line.startswith("error: ")] for node in nodes]
    assert errors == [[said.format(who="another node")], [said.format(who=f"rank 1, on {socket.gethostname()},")]]
    assert not [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.startswith(".")]
