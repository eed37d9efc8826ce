"""Peak memory per rank from building a model to the end of `setup`, under ddp, fsdp and ZeRO-3, through each of
the three ways a user builds a model: `train.py` (the Hydra path), `configure_model`, `trainer.init_module()`.

    torchrun --nproc_per_node 2 -m tests.sharded_init_memory OUT.json [--d-model 2048 --n-layer 8]

One process pair runs every case in turn (torchrun starts the ranks, so Lightning launches none). Before each case
the peak resident set size is reset (/proc/self/clear_refs), so a case's growth is its own. Rank 0 writes
{case: {"params": N, "growth": [bytes per rank at the end of setup], "at_init": [... right after the sharded
initialisation, ZeRO-3 only]}}.

Every allocation of 1 MiB or more is mapped and unmapped on its own (glibc's mmap threshold, set below before any
case runs): resident memory then follows the live tensors, where glibc's default reuses or keeps freed heap at will
and the same case measured 43% in one run and over 75% in another.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json

import deepspeed  # noqa: F401  imported before any case is measured
import lightning as L
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.hydra_config import HydraConfig

import lightning_dist.strategies.deepspeed.strategy as deepspeed_strategy
from lightning_dist.models.gpt import GPT
from lightning_dist.run.compose import build
from lightning_dist.run.config_check import CONF_DIR
from lightning_dist.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (glibc malloc.h)
ONE_MIB = 1 << 20

STRATEGIES = {"ddp": DDPStrategy, "fsdp": FSDPStrategy, "deepspeed_stage_3": lambda: DeepSpeedStrategy(stage=3)}


def map_every_large_allocation() -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(M_MMAP_THRESHOLD, ONE_MIB)
    libc.mallopt(M_TRIM_THRESHOLD, ONE_MIB)


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def reset_peak() -> int:
    """Free what earlier cases left, reset the peak to the current size, and return that size in bytes."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return _status_kib("VmRSS") * 1024


def peak() -> int:
    return _status_kib("VmHWM") * 1024


class HFStyleLM(L.LightningModule):
    """The shape of a Hugging Face causal LM wrapped for Lightning: layers built in `configure_model`, kept in an
    `nn.ModuleList`, initialised by an `_init_weights(module)` of the model's own."""

    def __init__(self, d_model: int, n_layer: int) -> None:
        super().__init__()
        self.d_model, self.n_layer = d_model, n_layer
        self.model: GPT | None = None

    def configure_model(self) -> None:
        if self.model is None:
            self.model = GPT(vocab_size=256, block_size=64, n_layer=self.n_layer, n_head=16, d_model=self.d_model, dropout=0.0)

    def training_step(self, batch, batch_idx):
        return self.model(batch[0]).float().mean()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


class StopBeforeFirstStep(L.Callback):
    """Ends `fit` after `setup`, before the first step (and before Adam allocates its moments)."""

    def __init__(self, baseline: int) -> None:
        self.baseline, self.growth = baseline, None

    def on_train_start(self, trainer, pl_module) -> None:
        self.growth = peak() - self.baseline
        trainer.should_stop = True


def data() -> torch.utils.data.DataLoader:
    tokens = torch.zeros(8, 64, dtype=torch.long)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens, tokens), batch_size=1)


def run_case(strategy_name: str, path: str, d_model: int, n_layer: int) -> dict:
    at_init = []
    baseline = reset_peak()
    original = deepspeed_strategy.initialize_deferred_parameters

    def recording_initialize(*args, **kwargs):  # ZeRO-3's partitions are in place: its weights, before the optimizer
        result = original(*args, **kwargs)
        at_init.append(peak() - baseline)
        return result

    deepspeed_strategy.initialize_deferred_parameters = recording_initialize
    probe = StopBeforeFirstStep(baseline)
    try:
        if path == "hydra":
            model, trainer = hydra_path(strategy_name, d_model, n_layer, probe)
        else:
            trainer = L.Trainer(
                accelerator="cpu", devices=2, strategy=STRATEGIES[strategy_name](), max_steps=1, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[probe],
            )
            if path == "configure_model":
                model = HFStyleLM(d_model, n_layer)
            else:
                with trainer.init_module(empty_init=True):
                    model = HFStyleLM(d_model, n_layer)
                    model.configure_model()
        trainer.fit(model, data())
    finally:
        deepspeed_strategy.initialize_deferred_parameters = original
    return {"growth": probe.growth, "at_init": at_init[0] if at_init else None}


def hydra_path(strategy_name: str, d_model: int, n_layer: int, probe: L.Callback):
    overrides = [
        f"strategy={strategy_name}", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.max_steps=1",
        f"model.d_model={d_model}", f"model.n_layer={n_layer}", "model.n_head=16", "model.block_size=64",
        "~callbacks", "~logger", "paths.output_dir=/tmp/unused",
    ]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("train", overrides=overrides, return_hydra_config=True)
    HydraConfig.instance().set_config(cfg)
    parts = build(cfg)
    trainer = parts["trainer"]
    trainer.callbacks.append(probe)
    return parts["model"], trainer


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("output")
    parser.add_argument("--d-model", type=int, default=2048)
    parser.add_argument("--n-layer", type=int, default=8)
    args = parser.parse_args()
    map_every_large_allocation()
    results = {}
    for strategy_name in STRATEGIES:
        for path in ("hydra", "configure_model", "init_module"):
            if strategy_name == "ddp" and path != "hydra":
                continue  # the control: eager construction, a full copy per rank
            L.seed_everything(0)
            case = run_case(strategy_name, path, args.d_model, args.n_layer)
            gathered = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, case)
            results[f"{strategy_name}/{path}"] = {
                "growth": [c["growth"] for c in gathered], "at_init": [c["at_init"] for c in gathered]
            }
            if dist.get_rank() == 0:
                print(strategy_name, path, results[f"{strategy_name}/{path}"], flush=True)
    if dist.get_rank() == 0:
        with open(args.output, "w") as handle:
            json.dump(results, handle)
    # Left up, gloo's threads abort the interpreter at exit now and then (SIGABRT on a rank, seen in CI).
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
