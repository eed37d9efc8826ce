"""Real DeepSpeed configs from public projects, unchanged (configs/README.md names their sources), each through
`python train.py strategy=deepspeed strategy.config=FILE` on 2 CPU ranks: it trains, or it is refused before any
rank starts in one line that names the keys. None may end in a traceback."""

from __future__ import annotations

import json
import re

import pytest

from lightning_dist.strategies.deepspeed.config.resolve import auto_keys
from tests.conftest import DS_CONFIGS, REPO, cpu_has_fp16, in_the_suite, run_train

pytestmark = pytest.mark.slow

TRAINS = ()
# A file's fp16 decides the precision where the Trainer keeps its default; DeepSpeed's CPU accelerator trains in
# fp16 only on a CPU with AVX512-FP16/AMX-FP16, so these files train there and are refused, with the reason, elsewhere.
FP16 = ('fp16.enabled=true: this CPU has no fp16 support in DeepSpeed (its CPU accelerator needs AVX512-FP16/AMX-FP16);'
        ' set it to "auto" or false, or run on CUDA')
WHERE_FP16 = () if cpu_has_fp16() else (FP16,)
# file -> () when it trains, else the `key...` fragments its one-line refusal must hold, in order.
OUTCOMES: dict[str, tuple[str, ...]] = {
    "transformers_ds_config_zero2.json": TRAINS,
    "transformers_ds_config_zero3.json": (*WHERE_FP16, "zero_optimization.reduce_bucket_size=0: DeepSpeed 0.19.8 refuses it"),
    "accelerate_zero_stage1_config.json": WHERE_FP16,
    "accelerate_zero_stage2_config.json": WHERE_FP16,
    "accelerate_zero_stage2_offload_config.json": WHERE_FP16,
    "accelerate_zero_stage3_config.json": WHERE_FP16,
    "accelerate_zero_stage3_offload_config.json": WHERE_FP16,
    "llama_factory_ds_z0_config.json": TRAINS,
    "llama_factory_ds_z2_config.json": TRAINS,
    "llama_factory_ds_z2_offload_config.json": TRAINS,
    "llama_factory_ds_z3_config.json": TRAINS,
    "llama_factory_ds_z3_offload_config.json": TRAINS,
    "llama_factory_ds_z2_autotp_config.json": TRAINS,  # AutoTP over both ranks, which share each batch
    "deepspeed_examples_autotuning_ds_config_tune.json": TRAINS,
    "deepspeed_examples_zero_stage_infinity_config.json": (
        *WHERE_FP16, "train_micro_batch_size_per_gpu=4 but the train loader's batch size is 16",
        "zero_optimization.stage3_param_persitance_threshold=100000: DeepSpeed 0.19.8 refuses it (Extra inputs are not permitted)",
    ),
    "deepspeed_examples_cifar_ds_config.json": (*WHERE_FP16, "train_batch_size=4 but micro batch x accumulation x world size = 16 x 1 x 2 = 32"),
}
RUN = ("trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=3", "trainer.limit_val_batches=1",
       "trainer.num_sanity_val_steps=0", "+trainer.limit_test_batches=1", "callbacks.progress_bar=null")


def test_every_config_in_the_folder_has_an_outcome_and_a_source():
    files = sorted(p.name for p in DS_CONFIGS.glob("*.json"))
    assert files == sorted(OUTCOMES) and len(files) >= 12
    readme = (DS_CONFIGS / "README.md").read_text()
    assert [name for name in files if not re.search(rf"^\| `{re.escape(name)}` \| [\w.-]+/[\w.-]+: `", readme, re.M)] == []


def test_the_documentation_counts_the_outcomes_on_this_cpu():
    trains, files = sum(outcome == TRAINS for outcome in OUTCOMES.values()), len(OUTCOMES)
    counted = (f"on a CPU with fp16, {trains} train and {files - trains} are refused" if cpu_has_fp16()
               else f"without it, {trains} and {files - trains};")
    assert counted in " ".join((REPO / "docs" / "deepspeed-configs.md").read_text().split())


# Every refusal is said before a rank starts (seconds); of the configs that train, one of each stage and kind is
# trained in the suite, the others' runs in scripts/extended_checks.sh.
TRAINED_ELSEWHERE = ["deepspeed_examples_autotuning_ds_config_tune.json", "llama_factory_ds_z0_config.json",
                     "llama_factory_ds_z2_autotp_config.json", "llama_factory_ds_z2_config.json",
                     "llama_factory_ds_z2_offload_config.json", "llama_factory_ds_z3_config.json",
                     "llama_factory_ds_z3_offload_config.json"]


@pytest.mark.parametrize("name", in_the_suite(sorted(OUTCOMES), [n for n in sorted(OUTCOMES) if n not in TRAINED_ELSEWHERE]))
def test_a_real_config_trains_or_is_refused_in_one_line(name, tmp_path, deepspeed_ops):
    run = run_train(tmp_path, "strategy=deepspeed", f"strategy.config={DS_CONFIGS / name}", *RUN)
    assert "Traceback" not in run.output, run.output[-3000:]
    refusal = OUTCOMES[name]
    if refusal == TRAINS:
        assert run.process.returncode == 0, run.output[-3000:]
        assert run.summary["train_batches_per_rank"] == [3, 3]
        assert {"test_loss", "val_loss"} <= set(run.summary["metrics"])
        assert auto_keys(json.loads((tmp_path / "deepspeed_config.effective.json").read_text())) == []
        return
    assert run.process.returncode == 2
    (line,) = [line for line in run.process.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith(f"error: strategy.config ({name}): {len(refusal)} problem")
    positions = [line.find(fragment) for fragment in refusal]
    assert -1 not in positions and positions == sorted(positions), (refusal, line)
    assert not (tmp_path / "train_ddp_process_1.log").exists()  # no rank was started
