"""A user's fine-tuning script: a plain `L.Trainer`, a transformers model loaded from a local `save_pretrained`
folder, a step that passes `labels=` and logs `.loss`. Writes OUT_DIR/<place>.rank<N>.json: the step's losses and
the first batch each rank trained on.

    python tests/finetune_script.py OUT_DIR FOLDER ld_fsdp configure_model,init_module,init,load_state_dict,ours
    python tests/finetune_script.py OUT_DIR FOLDER ld_deepspeed_stage_3:activation_checkpointing lora 2

The strategy is a registered name, or a preset's name and one of its options after a colon (true, or `=N`), as a
user writes `DeepSpeedStrategy(stage=3, activation_checkpointing=True)`; then the number of ranks, and the
accelerator (cpu unless given: the GPU suite's runs give gpu).

Each place is a way users load the weights, trained in turn (a Trainer each):
- configure_model: `AutoModelForCausalLM.from_pretrained` in `configure_model` (Lightning's hook for big models);
- init_module: in `__init__`, the module built under `with trainer.init_module():`;
- init: in a plain `__init__`;
- model_output: as ours, the step calling the module's own forward, which returns the model's `ModelOutput`, and
  returning that (Lightning takes its "loss");
- load_state_dict: `from_config` then `load_state_dict` of the folder's safetensors, in `configure_model`;
- ours: `lightning_dist.from_pretrained` in `configure_model` (loaded shard by shard);
- all_gather: the same, its step also logging the mean of `self.all_gather(loss)` over the ranks;
- lora: the same, then PEFT's `get_peft_model` (LoRA on the attention's projections), in `configure_model`.
  Written besides: the largest |B| at the start, whether the base weights (every rank's part) ended bit-identical,
  the trainable parameters and the elements of optimizer state each rank holds; after training, the adapters by
  `lightning_dist.save_adapters` (OUT_DIR/adapters-<strategy>) and, gathered in the module, trained_adapters.pt.
- lora_bf16_base: transformers' `from_pretrained(folder, dtype=torch.bfloat16)` then LoRA, in `configure_model`:
  PEFT makes the adapters float32 on the bf16 base (its `autocast_adapter_dtype`; accelerate #3985: FSDP2 refused
  that); the dtypes each kind of parameter ends in are written too.
- lora_decay_groups: the same, its AdamW in two groups as transformers' Trainer splits them for weight decay (no
  decay for biases and norms), over every parameter the module names: the second group holds frozen weights only.
  lora_nanogpt_groups: nanoGPT's split, of the parameters that train (matrices decayed): the second group is empty.
  Both warm up over 2 steps (LambdaLR); the rate each step's first group stepped with is written.
- qlora: QLoRA as users write it, in `__init__`: the folder loaded in 4 bits (bitsandbytes' NF4, float32 storage),
  `prepare_model_for_kbit_training`, then LoRA; what `lora` writes is written, and the bytes of 4-bit weights the
  rank holds. qlora_bf16: the same in bf16 storage and compute, trained bf16-mixed; qlora_uint8: in bitsandbytes'
  default storage (uint8). qlora_configure_model: as qlora, in
  `configure_model`.
- resume=<folder>: adapters that `save_adapters` wrote, loaded onto the pretrained base by PEFT's own
  `PeftModel.from_pretrained(..., is_trainable=True)` in `configure_model`, and trained on: at another world size
  or strategy than the run that wrote them. What `lora` writes is written.
- lora_checkpointed: LoRA, then the model's own `gradient_checkpointing_enable()`, each optimizer step over 2
  microbatches (`accumulate_grad_batches=2`). Under ZeRO-3 it writes how many partitioned parameters are still
  gathered after each microbatch's backward (DeepSpeed #8148: frozen ones left gathered after recompute, growing).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import torch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, BitsAndBytesConfig

import lightning_dist
from lightning_dist.checkpoints import gather_full_state_dict


def lora_config() -> LoraConfig:  # a new one each time: PEFT writes into the config it is given
    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])


# LoRA on the bf16 base with the optimizer's parameter groups as users split them for weight decay, and a warmup.
GROUPED = ("lora_decay_groups", "lora_nanogpt_groups")
QLORA_STORAGE = {"qlora": torch.float32, "qlora_configure_model": torch.float32, "qlora_bf16": torch.bfloat16,
                 "qlora_uint8": torch.uint8}


def quantized_with_lora(folder: str, storage: torch.dtype = torch.float32):
    compute = torch.bfloat16 if storage == torch.bfloat16 else torch.float32
    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute,
                             bnb_4bit_quant_storage=storage)
    model = AutoModelForCausalLM.from_pretrained(folder, quantization_config=nf4, dtype=compute)
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return get_peft_model(model, lora_config())


class FineTune(L.LightningModule):
    def __init__(self, folder: str, place: str) -> None:
        super().__init__()
        self.folder, self.place = folder, place
        self.model = AutoModelForCausalLM.from_pretrained(folder) if place in ("init", "init_module") else None
        if place in ("qlora", "qlora_bf16", "qlora_uint8"):
            self.model = quantized_with_lora(folder, QLORA_STORAGE[place])
        self.losses: list[float] = []
        self.learning_rates: list[float] = []
        self.first_batch: list | None = None

    def configure_model(self) -> None:
        if self.model is not None:
            return
        if self.place in ("ours", "all_gather", "model_output"):
            self.model = lightning_dist.from_pretrained(self.folder)
        elif self.place == "qlora_configure_model":
            self.model = quantized_with_lora(self.folder)
        elif self.place in ("lora_bf16_base", *GROUPED):
            base = AutoModelForCausalLM.from_pretrained(self.folder, dtype=torch.bfloat16)
            self.model = get_peft_model(base, lora_config())
        elif self.place.startswith("resume="):
            from peft import PeftModel

            base = lightning_dist.from_pretrained(self.folder)
            self.model = PeftModel.from_pretrained(base, self.place.removeprefix("resume="), is_trainable=True)
        elif self.place.startswith("lora"):
            self.model = get_peft_model(lightning_dist.from_pretrained(self.folder), lora_config())
            if self.place == "lora_checkpointed":
                self.model.gradient_checkpointing_enable()
        elif self.place == "load_state_dict":
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.folder))
            state = {}
            for shard in sorted(Path(self.folder).glob("*.safetensors")):
                state.update(load_file(shard))
            self.model.load_state_dict(state, strict=False)  # tied weights are saved once
        else:
            self.model = AutoModelForCausalLM.from_pretrained(self.folder)

    def forward(self, input_ids, labels=None):
        return self.model(input_ids=input_ids, labels=labels)

    def training_step(self, batch, batch_idx):
        ids = batch[0]
        if self.first_batch is None:
            self.first_batch = ids.tolist()
        if self.place == "model_output":  # the module's own forward, its ModelOutput returned as the step's output
            output = self(ids, labels=ids)
            self.log("train_loss", output.loss)
            self.losses.append(output.loss.item())
            return output
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        if self.place == "all_gather":
            self.log("mean_loss", self.all_gather(loss.detach()).mean())
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        if self.place not in GROUPED:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)
        if self.place == "lora_decay_groups":  # transformers Trainer's split, over every parameter the module names
            no_decay = [p for n, p in self.named_parameters() if n.endswith(".bias") or "norm" in n]
            decay = [p for n, p in self.named_parameters() if not (n.endswith(".bias") or "norm" in n)]
        else:  # nanoGPT's: of the parameters that train, the matrices are decayed
            trained = [p for p in self.parameters() if p.requires_grad]
            decay, no_decay = [p for p in trained if p.dim() >= 2], [p for p in trained if p.dim() < 2]
        optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                      lr=1e-3)
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 2))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        self.learning_rates.append(optimizer.param_groups[0]["lr"])  # the rate the first group steps with

    def on_after_backward(self) -> None:
        zero3 = [p for p in self.parameters() if hasattr(p, "ds_status")]
        gathered = [p for p in zero3 if not p.ds_persist and p.ds_status.name != "NOT_AVAILABLE"]
        self.gathered_after_backward.append(len(gathered))
        # The bytes ZeRO-3's parameters hold whole on this rank: those it keeps whole (persistent) and any left
        # gathered; the same after every microbatch where nothing is left behind.
        self.held_after_backward.append(sum(p.data.numel() * p.data.element_size() for p in zero3))
        self.persistent_bytes = sum(p.ds_numel * p.element_size() for p in zero3 if p.ds_persist)

    def on_train_start(self) -> None:
        self.gathered_after_backward: list[int] = []
        self.held_after_backward: list[int] = []
        self.persistent_bytes = 0
        if "lora" in self.place or self.place.startswith("resume="):
            self.start = gather_full_state_dict(self)
            self.quantized_bytes_held = quantized_bytes_held(self)

    def on_train_end(self) -> None:
        if "lora" not in self.place and not self.place.startswith("resume="):
            return
        end = gather_full_state_dict(self)
        self.trained_adapters = {n.removeprefix("model."): t for n, t in end.items() if "lora_" in n}
        # bitsandbytes' quantization state is in the state dict beside each 4-bit weight, and its CPU kernels keep
        # their absmax in bf16 once they ran (one plain process too): the weights themselves are what must not change.
        base = [name for name in self.start if "lora_" not in name and not name.endswith(QUANTIZATION_STATE)]
        self.lora = {
            "lora_b_start_max": max(self.start[n].abs().max().item() for n in self.start if "lora_B" in n),
            "base_names": len(base),
            "base_unchanged": all(torch.equal(bits(self.start[n]), bits(end[n])) for n in base),
            "adapters_changed": any(not torch.equal(self.start[n], end[n]) for n in self.start if "lora_A" in n),
            "trainable": sum(getattr(p, "ds_numel", p.numel()) for p in self.parameters() if p.requires_grad),
            "adapter_parameters": sum(t.numel() for n, t in self.start.items() if "lora_" in n),
            "dtypes": {kind: sorted({str(end[n].dtype) for n in end if ("lora_" in n) == (kind == "adapters")
                                     and end[n].is_floating_point()}) for kind in ("adapters", "base")},
            "optimizer_state_elements": optimizer_state_elements(self.trainer.optimizers[0]),
            "gathered_after_backward": self.gathered_after_backward,
            "held_after_backward": self.held_after_backward, "persistent_bytes": self.persistent_bytes,
            "quantized_bytes_held": self.quantized_bytes_held,
        }


QUANTIZATION_STATE = (".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".quant_state.bitsandbytes__nf4")


def bits(tensor: torch.Tensor) -> torch.Tensor:
    # Bit for bit: a 4-bit weight's packed bytes, read as float32, include NaNs, which equal nothing.
    return tensor.reshape(-1).view(torch.uint8)


def quantized_bytes_held(module) -> int:
    """The bytes of 4-bit weights this rank holds: its shard's where FSDP2 (a DTensor) or ZeRO-3 (`ds_tensor`) shards
    them."""
    from bitsandbytes.nn import Linear4bit

    held = 0
    for layer in module.modules():
        if isinstance(layer, Linear4bit):
            weight = layer.weight
            local = weight.ds_tensor if hasattr(weight, "ds_tensor") else getattr(weight, "to_local", lambda: weight)()
            held += local.numel() * local.element_size()
    return held


def optimizer_state_elements(optimizer) -> int:
    """The elements of every tensor in the optimizer's state on this rank (DeepSpeed's wrapper: its inner one)."""
    while not getattr(optimizer, "state", None) and getattr(optimizer, "optimizer", None) is not None:
        optimizer = optimizer.optimizer
    tensors = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return sum((t.to_local() if hasattr(t, "to_local") else t).numel() for t in tensors if t.dim())


def strategy_of(name: str):
    """A registered name, or `<ld_preset>:<option>[=<int>]`: the preset's class with its arguments and that option
    set (true, or the number)."""
    if ":" not in name:
        return name
    from lightning_dist.strategies.presets import PRESETS

    preset, option = name.split(":")
    key, _, value = option.partition("=")
    found = PRESETS[preset.removeprefix("ld_")]
    return found.strategy(**found.kwargs, **{key: int(value) if value else True})


def main(out_dir: str, folder: str, strategy: str, places: str, devices: str = "2", accelerator: str = "cpu") -> None:
    vocab = AutoConfig.from_pretrained(folder).vocab_size
    starts = torch.randint(0, vocab, (64, 1), generator=torch.Generator().manual_seed(2))
    tokens = (starts + torch.arange(16)) % vocab
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(tokens), batch_size=4)
    for place in places.split(","):
        L.seed_everything(0)
        trainer = L.Trainer(strategy=strategy_of(strategy), accelerator=accelerator, devices=int(devices), max_steps=3,
                            precision="bf16-mixed" if place == "qlora_bf16" else "32-true",
                            accumulate_grad_batches=2 if place == "lora_checkpointed" else 1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        if place == "init_module":
            with trainer.init_module():
                module = FineTune(folder, place)
        else:
            module = FineTune(folder, place)
        trainer.fit(module, data)
        if place == "lora":  # every rank: the adapters are gathered from each one's shards
            lightning_dist.save_adapters(module.model, Path(out_dir, f"adapters-{strategy.replace(':', '-')}"))
            if trainer.global_rank == 0:
                torch.save(module.trained_adapters, Path(out_dir, "trained_adapters.pt"))
        result = {"losses": module.losses, "learning_rates": module.learning_rates, "first_batch": module.first_batch,
                  **getattr(module, "lora", {})}
        name = "resume" if place.startswith("resume=") else place
        Path(out_dir, f"{name}.rank{trainer.global_rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main(*sys.argv[1:])
