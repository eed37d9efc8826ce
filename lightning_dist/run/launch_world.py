"""The world a cluster's launcher started, against the one the config asks for, before any rank trains.

`torchrun` (on a node, or in a Kubernetes pod as Kubeflow's PyTorchJob and TrainJob start it) tells each rank the
job's size (`WORLD_SIZE`) and its node's (`LOCAL_WORLD_SIZE`); a config that asks for another number of ranks would
have Lightning refuse it on every rank with a traceback, or wait for ranks that never come. Kubeflow gives a pod its
node's place in the job (`PET_NNODES`, `PET_NODE_RANK`, ...) for `torchrun` to read; a pod that runs `python
train.py` instead would start its ranks as node 0 of a job of its own, as every other pod would: refused, saying
what to run.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def launch_world_refusal(devices: int | None, nodes: int | None, environ: Mapping[str, str] = os.environ) -> str | None:
    """Why this process's launcher and `trainer.devices` x `trainer.num_nodes` disagree, in one line; None where they
    agree or no launcher said (a size the config leaves to Lightning, "auto", is not compared)."""
    if "TORCHELASTIC_RUN_ID" in environ:  # a rank torchrun started
        return _torchrun_refusal(devices, nodes, environ)
    if "LOCAL_RANK" in environ:  # a rank Lightning (or another launcher) started: it checks its own
        return None
    # Kubeflow's pods (PyTorchJob since training-operator 1.7, TrainJob) are told their place for torchrun, which
    # reads each `PET_<ARGUMENT>` as its `--<argument>`; PET_NNODES may be elastic, "MIN:MAX".
    pod_nodes = _number(environ.get("PET_NNODES", "").rpartition(":")[2])
    if "PET_NODE_RANK" in environ and (pod_nodes or 0) > 1:
        return (f"this pod is node {environ['PET_NODE_RANK']} of {pod_nodes} (PET_NODE_RANK, PET_NNODES: Kubeflow's,"
                " for torchrun), but train.py was started without torchrun: each pod would train alone as node 0;"
                " run torchrun train.py ... (it reads PET_NNODES, PET_NPROC_PER_NODE and PET_NODE_RANK itself)")
    pod_world, pod_rank = _number(environ.get("WORLD_SIZE")), environ.get("RANK")
    if "KUBERNETES_SERVICE_HOST" in environ and "PET_NODE_RANK" not in environ and pod_rank is not None \
            and (pod_world or 0) > 1:
        # PyTorchJob before training-operator 1.7: one process per pod, WORLD_SIZE pods, RANK the pod's place
        return (f"this pod is rank {pod_rank} of WORLD_SIZE={pod_world} (Kubeflow's PyTorchJob), but train.py was"
                " started without torchrun: each pod would train alone as node 0; run torchrun --nnodes $WORLD_SIZE"
                " --node-rank $RANK --master-addr $MASTER_ADDR --master-port $MASTER_PORT --nproc-per-node"
                f" {devices or 'N'} train.py ...")
    return None


def _torchrun_refusal(devices: int | None, nodes: int | None, environ: Mapping[str, str]) -> str | None:
    world, local = _number(environ.get("WORLD_SIZE")), _number(environ.get("LOCAL_WORLD_SIZE"))
    if devices is not None and local is not None and devices != local:
        return (f"trainer.devices={devices}: torchrun started {local} ranks on this node (LOCAL_WORLD_SIZE={local},"
                f" its --nproc-per-node); set trainer.devices={local}, or start torchrun with --nproc-per-node"
                f" {devices}")
    if devices is not None and nodes is not None and world is not None and devices * nodes != world:
        agreeing = f"set trainer.num_nodes={world // devices}, or " if world % devices == 0 else ""
        return (f"trainer.num_nodes={nodes}: torchrun's job has {world} ranks (WORLD_SIZE={world}), not trainer.devices"
                f" x trainer.num_nodes = {devices} x {nodes} = {devices * nodes}; {agreeing}start {nodes} nodes"
                " (torchrun --nnodes)")
    return None


def _number(value: str | None) -> int | None:
    return int(value) if value is not None and value.strip().isdigit() else None
