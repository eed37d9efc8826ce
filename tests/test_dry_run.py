"""dry_run=true: the strategy's set-up and two steps at 64 ranks, seen from the first and the last, in one process,
nothing allocated: the mesh coordinates, each parameter's shard and each rank's peak beside the plan. The documented
commands run as typed: the default model with CUDA faked (this machine has none), and the 7B-class target of
recipes/choose_a_strategy, whose static parts equal the plan's to 1% and whose peak is within 15% of it."""

from __future__ import annotations

import math
import re
import subprocess
import sys
from functools import partial

import pytest
import torch

from tests.conftest import REPO, documented, documented_commands, run_documented

PAGE = REPO / "docs" / "memory.md"
FINETUNE = REPO / "docs" / "finetune.md"


@pytest.fixture(scope="module")
def documented_dry_run(tmp_path_factory) -> subprocess.CompletedProcess:
    command = documented(PAGE, "python train.py dry_run=true")
    return run_documented(command, tmp_path_factory.mktemp("dry_run"), timeout=600)  # as typed, from a fresh directory


TARGET_7B = ("python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_7b dry_run=true trainer=gpu"
             " trainer.devices=8 trainer.num_nodes=8 strategy=")


@pytest.fixture(scope="module")
def documented_7b_dry_run() -> subprocess.CompletedProcess:
    return run_documented(documented(PAGE, TARGET_7B + "fsdp"), REPO, timeout=600)  # as the recipe's are typed


@pytest.fixture(scope="module")
def documented_7b_zero3_dry_run() -> subprocess.CompletedProcess:
    return run_documented(documented(PAGE, TARGET_7B + "deepspeed_stage_3"), REPO, timeout=600)


def rows(output: str) -> dict[str, list[str]]:
    return {cells[0]: cells[1:] for line in output.splitlines() if line.startswith("| ")
            for cells in [[c.strip(" *") for c in line.strip("|").split("|")]]}


def test_the_documented_dry_run_shows_both_ranks_in_the_mesh(documented_dry_run):
    assert documented_dry_run.returncode == 0, documented_dry_run.stderr[-3000:]
    out = documented_dry_run.stdout
    assert ("Dry run: fsdp, bf16-mixed, 64 ranks (8 per node) on fake CUDA devices (this machine has none): nothing"
            " allocated, nothing sent") in out
    assert "rank 0: data_parallel=0, tensor_parallel=0" in out and "rank 63: data_parallel=63, tensor_parallel=0" in out


def test_every_shard_is_its_parameter_split_64_ways(documented_dry_run):
    table = rows(documented_dry_run.stdout)
    shards = {name: cells for name, cells in table.items() if name.startswith("model.")}
    assert "model.blocks.0.mlp.2.weight" in shards and not any(".blocks.1." in name for name in shards)
    for name, (global_shape, local_shape, placement) in shards.items():
        whole, shard = eval(global_shape), eval(local_shape)  # noqa: S307 - our own table's lists
        assert placement == "S(0)" and shard == [math.ceil(whole[0] / 64), *whole[1:]], name


def test_the_peak_is_the_plans_give_or_take_what_the_plan_cannot_know(documented_dry_run):
    table = rows(documented_dry_run.stdout)
    rank_0, rank_63, plan = (float(v) for v in table["peak"])
    assert rank_0 == rank_63 and abs(rank_0 - plan) / plan < 0.15
    # Model state: the plan's arithmetic, up to CUDA's allocation unit (512 bytes) for each of the default model's
    # 68 small shards (and for each of their two moments and step count).
    for static, tensors in (("sharded parameters", 68), ("optimizer state", 3 * 68)):
        measured, _, planned = (float(v) for v in table[static])
        assert 0 <= measured - planned <= tensors * 512 / 1e6, static
    assert "Not seen by a dry run (the other 15%): the CUDA context, library workspaces" in documented_dry_run.stdout
    verdict = f"Verdict on 80 GB devices (dry_run_device_memory_gb), 85% usable: fits ({rank_0 / 1e3:.2f} of 68.00 GB)."
    assert verdict in documented_dry_run.stdout


@pytest.mark.extended  # the 64-rank dry run of the default model is the suite's
def test_the_7b_target_s_static_parts_are_the_plans_and_its_peak_within_15_percent(documented_7b_dry_run):
    assert documented_7b_dry_run.returncode == 0, documented_7b_dry_run.stderr[-3000:]
    table = rows(documented_7b_dry_run.stdout)
    assert "rank 63: data_parallel=63, tensor_parallel=0" in documented_7b_dry_run.stdout
    for static in ("sharded parameters", "optimizer state"):
        measured, _, planned = (float(v) for v in table[static])
        assert abs(measured - planned) <= 0.01 * planned, static
    rank_0, rank_63, plan = (float(v) for v in table["peak"])
    assert rank_0 == rank_63 and abs(rank_0 - plan) / plan < 0.15, (rank_0, plan)
    assert f"fits ({rank_0:.2f} of 68.00 GB)." in documented_7b_dry_run.stdout


# Seven minutes of one core on our slower machines (DeepSpeed's 64 partitions of every tensor, traced op by op):
# scripts/extended_checks.sh. The suite's ZeRO-3 dry runs are at 8 ranks (tests/test_dry_run_on_cuda.py).
@pytest.mark.extended
def test_the_7b_target_under_zero_3_keeps_the_plans_partitions_and_peaks_within_15_percent(documented_7b_zero3_dry_run):
    run = documented_7b_zero3_dry_run
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Dry run: deepspeed_stage_3, bf16-mixed, 64 ranks (8 per node) on fake CUDA devices" in run.stdout
    assert "rank 0: data_parallel=0, tensor_parallel=0" in run.stdout and "rank 63: data_parallel=63," in run.stdout
    table = rows(run.stdout)
    # A flat partition of each weight: 1/64 of its elements (6.4e9 / 64 in bf16 is 0.2 GB per rank).
    whole, partition, placement = table["model.blocks.0.mlp.0.weight"]
    assert placement == "flat partition" and eval(partition) == [math.prod(eval(whole)) // 64]  # noqa: S307
    for static in ("sharded parameters", "sharded gradients", "optimizer state"):
        measured, _, planned = (float(v) for v in table[static])
        assert abs(measured - planned) <= 0.01 * planned, static
    rank_0, rank_63, plan = (float(v) for v in table["peak"])
    assert rank_0 == rank_63 and abs(rank_0 - plan) / plan < 0.15, (rank_0, plan)


@pytest.mark.parametrize(("option", "refusal"), [
    ("strategy.tensor_parallel_size=2", "DeepSpeed's AutoTP (strategy.tensor_parallel_size > 1) is not dry-run yet"),
    ("strategy.context_parallel_size=2", "DeepSpeed's sequence parallelism (strategy.context_parallel_size > 1) is not"
     " dry-run yet, FSDP's is (strategy=fsdp)"),
])
def test_what_it_cannot_run_is_refused_in_one_line(option, refusal, tmp_path):
    process = subprocess.run([sys.executable, str(REPO / "train.py"), "dry_run=true", "strategy=deepspeed_stage_3",
                              "trainer.devices=4", option], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert process.returncode == 2
    assert process.stderr.strip().splitlines()[-1] == (
        f"error: dry_run=true: strategy=deepspeed_stage_3: {refusal}; plan=true gives its memory")


def test_hybrid_sharding_replicates_across_nodes_and_shards_within_one():
    from lightning_dist.dry_run import dry_run_ranks
    from lightning_dist.models.gpt import GPTLanguageModel
    from lightning_dist.strategies import FSDPStrategy

    batch = (torch.zeros(2, 64, dtype=torch.long), torch.zeros(2, 64, dtype=torch.long))
    (view,) = dry_run_ranks(FSDPStrategy(sharding_strategy="HYBRID_SHARD"), partial(GPTLanguageModel, vocab_size=256),
                            batch, "32-true", devices=4, num_nodes=2, ranks=(5,))
    assert view.coordinate == {"data_parallel_replicate": 1, "data_parallel_shard": 1, "tensor_parallel": 0}
    shards = {name: (whole, local, placement) for name, whole, local, placement in view.shards}
    assert shards["model.token_embedding.weight"] == ((256, 128), (64, 128), "R, S(0)")
    assert view.peak["SHARDED_PARAM"] > 0 and view.peak["Total"] >= sum(v for k, v in view.peak.items() if k != "Total")


def test_zero_3_on_fake_host_devices_partitions_every_weight_flat(monkeypatch):
    import deepspeed.utils.groups
    import torch.distributed as dist

    from lightning_dist.dry_run import dry_run_ranks
    from lightning_dist.models.gpt import GPTLanguageModel
    from lightning_dist.strategies import DeepSpeedStrategy

    # What a DeepSpeed run earlier in the same process leaves: its world group cached, the group itself long gone.
    stale = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    monkeypatch.setattr(deepspeed.utils.groups, "_WORLD_GROUP", stale)
    batch = (torch.zeros(2, 64, dtype=torch.long), torch.zeros(2, 64, dtype=torch.long))
    # Every weight partitioned: none kept whole on every rank (DeepSpeed keeps those under 1e5 elements by default).
    strategy = DeepSpeedStrategy(config={"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}})
    (view,) = dry_run_ranks(strategy, partial(GPTLanguageModel, vocab_size=256), batch, "32-true", devices=4,
                            num_nodes=2, ranks=(6,))
    # ZeRO's own tracker categories (its engine's buffers, its step's temporaries) beside the plan's.
    assert view.coordinate == {"data_parallel": 6, "tensor_parallel": 0}
    assert view.planned_as["ENGINE_BUFFERS"] == "gradient_bucket"
    shards = {name: (whole, local) for name, whole, local, _ in view.shards}
    assert shards["model.blocks.0.mlp.0.weight"] == ((512, 128), (512 * 128 // 8,))
    parameters = 875_264  # fp32 under 32-true: an eighth of every weight, its gradient, master copy and moments
    assert abs(view.peak["SHARDED_PARAM"] - parameters * 4 / 8) <= 2 * 512
    assert abs(view.peak["SHARDED_GRAD"] - parameters * 4 / 8) <= 2 * 512
    assert 0 <= view.peak["OPT"] - parameters * 12 / 8 <= 3 * 4 * 512
    assert deepspeed.utils.groups._WORLD_GROUP is stale  # the process's own state, put back


@pytest.mark.parametrize("ending", ["plan=true", "dry_run=true"])
def test_a_lora_model_s_plan_and_dry_run_hold_its_frozen_base_as_weights_only(ending, tmp_path):
    """docs/finetune.md's commands as typed: the plan counts the frozen base (it left it out: a 7B LoRA fine-tune
    planned without its 7B weights), and ZeRO-3's dry run steps the LoRA model (torch's memory tracker refused its
    frozen parameters) with the plan's gradients and optimizer state, the adapters' only."""
    command = next(c for c in documented_commands(FINETUNE) if c.endswith(ending))
    assert command.startswith("python train.py model=hf_llama +lora=default ")  # the package's own configs
    process = run_documented(command, tmp_path, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    table = rows(process.stdout)
    if ending == "plan=true":
        found = re.search(r"All presets for ([\d,]+) trained of ([\d,]+) parameters", process.stdout)
        trained, total = (int(n.replace(",", "")) for n in found.groups())
        assert 0 < trained < total / 10  # r 8 adapters on a 0.87M-parameter Llama
        # ddp, fp32: every weight held (4 bytes), gradients and Adam's two moments only for the adapters.
        assert f"| per device | parameters | {total * 4 / 1e9:.3f} |" in process.stdout
        assert f"| ddp | {(total * 4 + trained * 12) / 1e9:.3f} |" in process.stdout
        return
    for category in ("sharded gradients", "optimizer state"):
        rank_0, rank_1, planned = (float(v) for v in table[category])
        assert rank_0 == rank_1 == planned > 0, category
    rank_0, _, planned = (float(v) for v in table["sharded parameters"])
    assert abs(rank_0 - planned) / planned < 0.1
    rank_0, _, planned = (float(v) for v in table["peak"])
    assert abs(rank_0 - planned) / planned < 0.02


def test_the_main_job_holds_a_lora_base_in_its_folder_s_bf16(tmp_path):
    """`model.pretrained` with `+lora=default` read the frozen base in the run's float32 from a bf16 folder: twice
    the memory transformers and PEFT hold it in. Now the base is held in the folder's bf16 and the adapters in
    float32, under ZeRO-3 and 32-true too, and the plan counts it so: each rank's partitions are the plan's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from recipes.finetune.make_pretrained import make_pretrained

    make_pretrained(tmp_path / "llama", steps=1)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "llama"),
                           LoraConfig(r=8, target_modules="all-linear"))  # the lora/default config's
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    base = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    process = run_documented(f"python train.py model=hf_llama model.pretrained={tmp_path / 'llama'} +lora=default"
                             " strategy=deepspeed_stage_3 dry_run=true", tmp_path, timeout=600)
    assert process.returncode == 0, process.stderr[-3000:]
    rank_0, rank_1, planned = rows(process.stdout)["sharded parameters"]
    assert rank_0 == rank_1 == planned == f"{(base * 2 + trained * 4) / 2 / 1e6:.3f}"  # of 2 ranks; float32: 0.427
