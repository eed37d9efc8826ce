"""Kubernetes, simulated on this machine: pods as Kubeflow's PyTorchJob starts them (several ranks each, `torchrun
train.py` reading the pod's `PET_*`), training the losses of one node with as many ranks; a launcher's world that
disagrees with `trainer.devices` x `trainer.num_nodes`, and a pod that runs `python train.py` where torchrun was
expected, refused in one line before any rank trains (lightning_dist/run/launch_world.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from lightning_dist.reports.equivalence import read_train_losses
from lightning_dist.run.launch_world import launch_world_refusal
from scripts.two_nodes import run_nodes
from tests.conftest import REPO, TRAIN_ENV, run_train

SHORT = ("strategy=ddp", "trainer.max_steps=4", "test=false", "trainer.num_sanity_val_steps=0",
         "trainer.limit_val_batches=0", "trainer.log_every_n_steps=1", "callbacks.model_checkpoint.monitor=null")
# A pod of Kubeflow's PyTorchJob (training-operator 1.7 and later) for node 1 of 2, 2 ranks each, as it starts.
POD_1_OF_2 = {"PET_NNODES": "2", "PET_NPROC_PER_NODE": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "job-master-0",
              "PET_MASTER_PORT": "23456", "MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "4",
              "RANK": "1", "KUBERNETES_SERVICE_HOST": "10.96.0.1"}
# A rank torchrun started there (what it puts in its workers' environment).
TORCHRUN_RANK_3_OF_4 = {**POD_1_OF_2, "TORCHELASTIC_RUN_ID": "none", "WORLD_SIZE": "4", "RANK": "3",
                        "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}


@pytest.mark.parametrize("devices, nodes, environ, said", [
    (2, 2, TORCHRUN_RANK_3_OF_4, None),
    (1, 2, TORCHRUN_RANK_3_OF_4, "trainer.devices=1: torchrun started 2 ranks on this node (LOCAL_WORLD_SIZE=2, its"
                                 " --nproc-per-node); set trainer.devices=2, or start torchrun with --nproc-per-node 1"),
    (2, 1, TORCHRUN_RANK_3_OF_4, "trainer.num_nodes=1: torchrun's job has 4 ranks (WORLD_SIZE=4), not trainer.devices x"
                                 " trainer.num_nodes = 2 x 1 = 2; set trainer.num_nodes=2, or start 1 nodes (torchrun"
                                 " --nnodes)"),
    (None, 1, TORCHRUN_RANK_3_OF_4, None),  # devices=auto: Lightning counts them, and checks
    (2, 2, POD_1_OF_2, "this pod is node 1 of 2 (PET_NODE_RANK, PET_NNODES: Kubeflow's, for torchrun), but train.py"
                       " was started without torchrun: each pod would train alone as node 0; run torchrun train.py ..."
                       " (it reads PET_NNODES, PET_NPROC_PER_NODE and PET_NODE_RANK itself)"),
    (2, 2, {**POD_1_OF_2, "PET_NNODES": "1:2"}, "this pod is node 1 of 2 (PET_NODE_RANK, PET_NNODES: Kubeflow's, for"
                                                " torchrun), but train.py was started without torchrun: each pod would"
                                                " train alone as node 0; run torchrun train.py ... (it reads"
                                                " PET_NNODES, PET_NPROC_PER_NODE and PET_NODE_RANK itself)"),
    (2, 1, {**POD_1_OF_2, "PET_NNODES": "1", "PET_NODE_RANK": "0", "WORLD_SIZE": "2", "RANK": "0"}, None),  # one pod
    # PyTorchJob before training-operator 1.7: WORLD_SIZE pods, one process each.
    (2, 2, {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "1",
            "KUBERNETES_SERVICE_HOST": "10.96.0.1"},
     "this pod is rank 1 of WORLD_SIZE=2 (Kubeflow's PyTorchJob), but train.py was started without torchrun: each pod"
     " would train alone as node 0; run torchrun --nnodes $WORLD_SIZE --node-rank $RANK --master-addr $MASTER_ADDR"
     " --master-port $MASTER_PORT --nproc-per-node 2 train.py ..."),
    (2, 1, {"LOCAL_RANK": "1", "WORLD_SIZE": "2", "RANK": "1", "NODE_RANK": "0"}, None),  # a rank Lightning started
    (2, 1, {}, None),
], ids=["agrees", "devices", "nodes", "auto", "pod", "elastic pod", "one pod", "pytorchjob v1.6", "lightning", "none"])
def test_the_launchers_world_against_the_configs(devices, nodes, environ, said):
    assert launch_world_refusal(devices, nodes, environ) == said


def test_a_pod_started_without_torchrun_is_refused_in_one_line_before_anything_starts(tmp_path):
    run = subprocess.run([sys.executable, str(REPO / "train.py"), f"hydra.run.dir={tmp_path / 'run'}",
                          "trainer.num_nodes=2"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env={**TRAIN_ENV, **POD_1_OF_2})
    assert run.returncode == 2, run.stderr[-3000:]
    assert [line for line in run.stderr.splitlines() if line.strip()] == [
        "error: this pod is node 1 of 2 (PET_NODE_RANK, PET_NNODES: Kubeflow's, for torchrun), but train.py was started"
        " without torchrun: each pod would train alone as node 0; run torchrun train.py ... (it reads PET_NNODES,"
        " PET_NPROC_PER_NODE and PET_NODE_RANK itself)"]
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_two_pods_of_two_ranks_train_the_losses_of_one_node_of_four_and_a_mismatch_is_one_line(tmp_path):
    pods = run_nodes(list(SHORT), tmp_path / "pods", nproc_per_node=2, kubeflow=True)
    assert [pod.code for pod in pods] == [0, 0], pods[0].output[-3000:] + pods[1].output[-3000:]
    one_node = run_train(tmp_path / "one_node", *SHORT, "trainer.devices=4")
    assert one_node.process.returncode == 0, one_node.output[-3000:]
    losses = read_train_losses(tmp_path / "pods")
    assert sorted(losses) == [0, 1, 2, 3]
    assert losses == pytest.approx(read_train_losses(one_node.run_dir), rel=1e-5)

    # The pods' torchrun starts 2 ranks each; the config asks for 1 per node: each pod's first line says why (its
    # agent stops a rank that has not said it yet; and prints, as for any rank that failed, its own traceback).
    pods = run_nodes([*SHORT, "trainer.devices=1"], tmp_path / "mismatch", nproc_per_node=2, kubeflow=True, timeout=180)
    said = ("error: trainer.devices=1: torchrun started 2 ranks on this node (LOCAL_WORLD_SIZE=2, its --nproc-per-node);"
            " set trainer.devices=2, or start torchrun with --nproc-per-node 1")
    for pod in pods:
        errors = [line for line in pod.output.splitlines() if line.startswith("error: ")]
        assert pod.code != 0 and errors[0] == said, pod.output[-3000:]
        assert all(line == said or line.startswith("error: stopped by SIGTERM") for line in errors), errors


MANIFESTS = REPO / "recipes" / "kubernetes"


def _pods_and_command(manifest: str) -> tuple[int, int, list[str]]:
    """(pods, ranks per pod, the pod's command) as the manifest starts them."""
    import yaml

    documents = [d for d in yaml.safe_load_all((MANIFESTS / manifest).read_text()) if d]
    job = next(d for d in documents if d["kind"] != "Service")
    spec = job["spec"]
    if job["kind"] == "PyTorchJob":
        replicas = spec["pytorchReplicaSpecs"]
        (container,) = replicas["Master"]["template"]["spec"]["containers"]
        return sum(r["replicas"] for r in replicas.values()), int(spec["nprocPerNode"]), [*container["command"],
                                                                                        *container["args"]]
    if job["kind"] == "TrainJob":
        trainer = spec["trainer"]
        return trainer["numNodes"], trainer["numProcPerNode"], [*trainer["command"], *trainer["args"]]
    (container,) = spec["template"]["spec"]["containers"]
    command = [*container["command"], *container["args"]]
    flags = dict(word.removeprefix("--").split("=", 1) for word in command if word.startswith("--"))
    assert int(flags["nnodes"]) == spec["completions"] == spec["parallelism"]
    return spec["completions"], int(flags["nproc-per-node"]), command


@pytest.mark.parametrize("manifest", ["pytorchjob.yaml", "trainjob.yaml", "job.yaml"])
def test_each_manifest_runs_train_py_under_torchrun_with_the_ranks_its_pods_start(manifest):
    from lightning_dist.run.config_check import check_overrides

    pods, per_pod, command = _pods_and_command(manifest)
    assert command[0] == "torchrun"
    script = next(word for word in command if word.endswith("train.py"))
    overrides = command[command.index(script) + 1:]
    cfg = check_overrides(overrides)
    assert (cfg.trainer.devices, cfg.trainer.num_nodes, cfg.trainer.accelerator) == (per_pod, pods, "gpu")
    assert "hydra.run.dir=/shared/runs/lightning-dist-fsdp" in overrides  # on the volume every pod mounts
