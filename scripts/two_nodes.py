"""Several "nodes" on one machine: one `torchrun` agent per node on loopback, as on a cluster with one agent per
machine, sharing a run directory, or each with a disk of its own (a mount namespace whose tmpfs hides the shared
directory, at the same path). The checks a multi-node run needs that one node cannot show:

    python -m scripts.two_nodes                                  # every check below, ddp, fsdp, ZeRO-2, ZeRO-3
    python -m scripts.two_nodes --checks requeue --repeats 5 --strategies fsdp
    python -m scripts.two_nodes --checks same_losses --strategies fsdp_hybrid

- `requeue`: a run whose save was cut off (every rank SIGKILLed inside its save, `tests/probes.py` KillDuringSave)
  leaves `.NAME.partial` leftovers in the shared run directory; the requeued job (`resume=true`) must save over them
  and finish on both nodes.
- `own_disk`: node 1 saves to a disk of its own; the run must be refused at its first save in one line naming the
  checkpoint directory and "shared", on both nodes, not split its checkpoints where no node can resume.
- `same_losses`: 2 nodes train as 1 node with as many ranks, loss for loss (float32: within 1e-5); strategy
  `fsdp_hybrid` is HYBRID_SHARD on 2 nodes x 2 ranks against FULL_SHARD on 1 node x 4.

The suite runs a scaled-down version (tests/run/test_two_nodes.py). Needs root for `unshare --mount` (own_disk).
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
# A save every 2 steps under its own name, and `last`; no validation to wait for.
SAVES = ("callbacks.model_checkpoint.every_n_train_steps=2", "callbacks.model_checkpoint.save_top_k=-1",
         "callbacks.model_checkpoint.monitor=null", "callbacks.validate_at_max_steps=null",
         "trainer.num_sanity_val_steps=0", "test=false", "trainer.log_every_n_steps=1")
KILL_DURING_SAVE = "+callbacks.kill_during_save._target_=tests.probes.KillDuringSave"


@dataclass
class Node:
    code: int
    output: str


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_nodes(overrides: list[str], run_dir: Path, *, nnodes: int = 2, nproc_per_node: int = 1,
                own_disk: bool = False, network: dict[int, str] | None = None, master_addr: str = "127.0.0.1",
                env: dict[str, str] | None = None, node_env: dict[int, dict[str, str]] | None = None,
                node_overrides: dict[int, list[str]] | None = None, rendezvous: str = "static",
                local_addr: dict[int, str] | None = None, python: str = sys.executable,
                kubeflow: bool = False) -> list[subprocess.Popen]:
    """`torchrun ... train.py <overrides>` once per node, all at once, the run directory shared unless `own_disk`
    (then every node but 0 sees an empty tmpfs at `run_dir`'s path); `network` puts a node in a network namespace
    of its own (`ip netns`), reaching node 0 at `master_addr`; `node_env` and `node_overrides` add to one node's
    environment (its interface variables) and command line. `rendezvous="c10d"`: the agents meet through torchrun's
    c10d rendezvous, hosted by node 0's agent at `master_addr`, each node at its `local_addr` (else torchrun's static
    rendezvous with fixed node ranks). `kubeflow`: each node is a pod as Kubeflow's PyTorchJob starts it, told its
    place in the environment (`PET_*`, which torchrun reads, and the pod's `WORLD_SIZE` and `RANK`), its command
    `torchrun train.py` without arguments. `python` must be a real interpreter for `own_disk`: a namespace holds only
    the processes started inside it. Each node's output is one pipe (stdout and stderr)."""
    port = free_port()
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore::DeprecationWarning",
                   "PYTHONPATH": str(REPO), **(env or {})}
    run_dir.mkdir(parents=True, exist_ok=True)
    processes = []
    for node in range(nnodes):
        pod: dict[str, str] = {}
        if kubeflow:
            meeting = []
            pod = {"PET_NNODES": str(nnodes), "PET_NPROC_PER_NODE": str(nproc_per_node), "PET_NODE_RANK": str(node),
                   "PET_MASTER_ADDR": master_addr, "PET_MASTER_PORT": str(port), "MASTER_ADDR": master_addr,
                   "MASTER_PORT": str(port), "WORLD_SIZE": str(nnodes * nproc_per_node), "RANK": str(node),
                   "KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
        elif rendezvous == "c10d":
            meeting = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{master_addr}:{port}", "--rdzv-id", "two-nodes",
                       *(["--rdzv-conf", "is_host=1"] if node == 0 else []),
                       *(["--local-addr", local_addr[node]] if local_addr and node in local_addr else [])]
        else:
            meeting = ["--node-rank", str(node), "--master-addr", master_addr, "--master-port", str(port)]
        sizes = [] if kubeflow else ["--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node)]
        command = [
            python, "-m", "torch.distributed.run", *sizes, *meeting, str(REPO / "train.py"),
            f"trainer.devices={nproc_per_node}", f"trainer.num_nodes={nnodes}", f"hydra.run.dir={run_dir}", *overrides,
            *(node_overrides or {}).get(node, []),
        ]
        if own_disk and node > 0:
            mount = f"mount -t tmpfs node{node}-disk {shlex.quote(str(run_dir))} && exec \"$@\""
            command = ["unshare", "--mount", "--", "sh", "-c", mount, "sh", *command]
        if network and node in network:
            command = ["ip", "netns", "exec", network[node], *command]
        processes.append(subprocess.Popen(command, cwd=REPO,
                                          env={**environment, **pod, **(node_env or {}).get(node, {})},
                                          stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True))
    return processes


def wait_for_nodes(processes: list[subprocess.Popen], timeout: float = 600) -> list[Node]:
    """Each node's exit code and output; a node still running after `timeout` is killed (its output says so)."""
    deadline = time.monotonic() + timeout
    nodes = []
    for process in processes:
        try:
            output = process.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            output = process.communicate()[0] + "\n<killed: timeout>"
        nodes.append(Node(process.returncode, output))
    return nodes


def kill_node(process: subprocess.Popen) -> None:
    """SIGKILL a node: its torchrun agent and every process under it (torchrun starts each worker in a session of
    its own, so the agent's process group is not all of it)."""
    import psutil

    try:
        everyone = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for member in everyone:
        try:
            member.kill()
        except psutil.NoSuchProcess:
            pass


def run_nodes(overrides: list[str], run_dir: Path, *, timeout: float = 600, **options: Any) -> list[Node]:
    """`start_nodes`, then `wait_for_nodes`."""
    return wait_for_nodes(start_nodes(overrides, run_dir, **options), timeout)


def leftovers(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob(".*.partial"))


def requeue_after_a_cut_off_save(strategy: str, run_dir: Path) -> tuple[bool, str]:
    """The first attempt is killed inside its second save (step 4); the requeued job, resuming, must save over the
    leftovers and finish on both nodes. Retried (up to 5 times) until the kill leaves a leftover to save over."""
    first_overrides = [f"strategy={strategy}", *SAVES, "trainer.max_steps=6", "resume=true", KILL_DURING_SAVE]
    for attempt in range(5):
        kill_env = {"FAULT_KILL_AT_SAVE": "1", "FAULT_KILL_DELAY_S": f"{0.05 * attempt:.2f}"}
        run_nodes(first_overrides, run_dir, env=kill_env)
        if leftovers(run_dir):
            break
    else:
        return False, "no save was cut off midway: no .partial leftover to save over"
    left = leftovers(run_dir)
    nodes = run_nodes(first_overrides, run_dir)  # the same command again, as a requeued job runs it
    if [node.code for node in nodes] != [0, 0]:
        return False, f"requeued job exited {[node.code for node in nodes]} with {left} left over:\n" + nodes[0].output[-2000:]
    return True, f"saved over {left}, both nodes exit 0"


def own_disk_refused(strategy: str, run_dir: Path) -> tuple[bool, str]:
    nodes = run_nodes([f"strategy={strategy}", *SAVES, "trainer.max_steps=4"], run_dir, own_disk=True)
    lines = [line for node in nodes for line in node.output.splitlines() if line.startswith("error: ") and "shared" in line]
    ok = [node.code for node in nodes] == [1, 1] and len(lines) >= 2
    return ok, (lines[0] if lines else "no error line") + f" (exit codes {[node.code for node in nodes]})"


def same_losses(strategy: str, run_dir: Path) -> tuple[bool, str]:
    """2 nodes x 1 rank against 1 node x 2 ranks (the same global batch and data order): the per-step losses must
    agree to float32 rounding. `fsdp_hybrid`: HYBRID_SHARD on 2 nodes x 2 ranks (shard within a node, replicate
    across) against FULL_SHARD on 1 node x 4 ranks."""
    from lightning_dist.reports.equivalence import COMPARISON_OVERRIDES, run_strategy
    from lightning_dist.reports.summary_file import curve, read_summary

    hybrid = strategy == "fsdp_hybrid"
    preset = "fsdp" if hybrid else strategy
    common = [*COMPARISON_OVERRIDES, "trainer.max_steps=10", "callbacks.model_checkpoint=null"]
    per_node = 2 if hybrid else 1
    nodes = run_nodes([f"strategy={preset}", *common, *(["strategy.sharding_strategy=HYBRID_SHARD"] if hybrid else [])],
                      run_dir / "two_nodes", nproc_per_node=per_node)
    if [node.code for node in nodes] != [0, 0]:
        return False, f"two nodes exited {[node.code for node in nodes]}:\n" + nodes[0].output[-2000:]
    one = run_strategy(preset, [*common, f"trainer.devices={2 * per_node}"], run_dir / "one_node")
    two = curve(read_summary(run_dir / "two_nodes"), "train_loss")
    if one.returncode or sorted(two) != sorted(one.losses):
        return False, f"one node exited {one.returncode}; steps {sorted(two)} against {sorted(one.losses)}"
    worst = max(abs(two[step] - one.losses[step]) / abs(one.losses[step]) for step in two)
    return worst < 1e-5, f"largest relative difference over {len(two)} steps: {worst:.1e}"


CHECKS = {"requeue": requeue_after_a_cut_off_save, "own_disk": own_disk_refused, "same_losses": same_losses}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp", "deepspeed_stage_2", "deepspeed_stage_3"])
    parser.add_argument("--checks", nargs="+", choices=sorted(CHECKS), default=sorted(CHECKS))
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    print("| check | strategy | try | outcome |\n|---|---|---|---|", flush=True)
    failed = 0
    for check in args.checks:
        for strategy in args.strategies:
            for attempt in range(args.repeats):
                with tempfile.TemporaryDirectory(prefix="two_nodes_") as work:
                    ok, what = CHECKS[check](strategy, Path(work) / "run")
                failed += not ok
                print(f"| {check} | {strategy} | {attempt} | {'ok' if ok else 'FAILED'}: {what.splitlines()[0]} |", flush=True)
                if not ok:
                    print(what, flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
