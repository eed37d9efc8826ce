"""Lightning's EMAWeightAveraging on a CUDA device under fsdp, its copy where the CPU runs cannot put it: in host
memory beside shards on the GPU (`callbacks.ema.device=cpu`), and beside a CPU-offloaded model, each checkpoint
gathered into one file (the gather runs over nccl, which takes no host tensor), and under ZeRO-2. Each validates
and tests as ddp,
and resumes from its step-3 checkpoint as the run that went on. The CPU's runs of the same:
tests/strategies/test_weight_averaging.py."""

from __future__ import annotations

import pytest

from tests.gpu.conftest import GPU, run_many

pytestmark = pytest.mark.gpu

EMA = ("callbacks=[default,ema]", "callbacks.ema.decay=0.5", "trainer.max_steps=6", "trainer.val_check_interval=3",
       "callbacks.model_checkpoint.every_n_train_steps=3", "callbacks.model_checkpoint.save_top_k=-1",
       "callbacks.model_checkpoint.monitor=null", "callbacks.progress_bar=null")
LAYOUTS = {
    "ddp": ("strategy=ddp",),
    "fsdp, the average in host memory": ("strategy=fsdp", "callbacks.ema.device=cpu",
                                         "strategy.save_distributed_checkpoint=false"),
    "fsdp_cpu_offload": ("strategy=fsdp_cpu_offload", "strategy.save_distributed_checkpoint=false"),
    # the engine's weights on the GPU, the average kept beside them in each checkpoint (strategies/deepspeed/average.py)
    "deepspeed_stage_2": ("strategy=deepspeed_stage_2",),
}


def test_ema_under_fsdp_with_the_average_in_host_memory_validates_tests_and_resumes_as_ddp(tmp_path, measurements):
    runs = run_many({name: (tmp_path / str(index), [*overrides, *GPU, *EMA])
                     for index, (name, overrides) in enumerate(LAYOUTS.items())})
    for name, run in runs.items():
        assert run.process.returncode == 0, (name, run.output[-3000:])
    resumed = run_many({name: (tmp_path / f"resumed{index}", [*overrides, *GPU, *EMA, "ckpt_path="
                                                              + str(runs[name].run_dir / "checkpoints" / "step000003.ckpt")])
                        for index, (name, overrides) in enumerate(LAYOUTS.items()) if name != "ddp"})
    ddp = runs["ddp"]
    measurements["ema"] = {name: {"val": run.val_losses(), "test": run.summary["metrics"]["test_loss"]}
                           for name, run in {**runs, **{f"{n} resumed": r for n, r in resumed.items()}}.items()}
    for name, run in resumed.items():
        assert run.process.returncode == 0, (name, run.output[-3000:])
        assert run.summary["metrics"]["test_loss"] == pytest.approx(ddp.summary["metrics"]["test_loss"], rel=1e-5)
    for name, run in runs.items():
        assert run.val_losses() == pytest.approx(ddp.val_losses(), rel=1e-5), name
        assert run.summary["metrics"]["test_loss"] == pytest.approx(ddp.summary["metrics"]["test_loss"], rel=1e-5)
