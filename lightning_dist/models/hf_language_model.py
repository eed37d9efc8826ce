"""A Hugging Face `transformers` language model as a LightningModule (`model=hf_gpt2|hf_llama|hf_mixtral|hf_bart`, with
`+lora=default`): built from its config (random init) or loaded from a local `save_pretrained` folder, trained on
next-token prediction. A causal LM (GPT-2, Llama) predicts every next token; an encoder-decoder (BART, T5) reads
the first half of each window and continues it.

Nothing here is strategy-specific: FSDP finds the blocks itself (the model's `nn.ModuleList` of layers) and ZeRO-3
partitions whatever it is given. `lightning-dist export` writes a checkpoint of it as a `save_pretrained` folder.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from lightning_dist._compat.transformers import computes_router_loss
from lightning_dist.checkpoints.adapters import save_adapters
from lightning_dist.models.pretrained import from_pretrained
from lightning_dist.optim import ConfiguredOptimizers
from lightning_dist.optim.configured import OptimizerFactory, SchedulerFactory
from lightning_dist.parallel.sharded_init import draw_init_seed, initialize_parameters


def build_language_model(model_type: str, config: dict[str, Any] | None = None, pretrained: str | None = None,
                         weights: bool = True, dtype: str | None = None) -> torch.nn.Module:
    """`pretrained` (a local folder) loads its weights, in `dtype` ("auto": the folder's; unset: the run's);
    otherwise a random model of `model_type` with `config`. `weights=False`: the model only, its weights to come (an
    export gives it a checkpoint's).

    A pretrained model is read tensor by tensor into the shards each rank keeps (lightning_dist.from_pretrained).
    A random model is initialised module by module from one seed (lightning_dist's sharded initialisation), not in
    transformers' single pass over the global generator: a strategy that builds it on the meta device and
    initialises only its shards then starts from the very weights an eager build has.
    """
    if pretrained and weights:  # the folder checked first: a name that is none would be looked up on the Hub
        return from_pretrained(pretrained, key="model.pretrained", dtype=dtype)
    if pretrained:
        hf_config = AutoConfig.from_pretrained(pretrained)
    else:
        hf_config = AutoConfig.for_model(model_type, **(config or {}))
    auto_class = AutoModelForSeq2SeqLM if hf_config.is_encoder_decoder else AutoModelForCausalLM
    if not weights:
        return auto_class.from_config(hf_config, dtype=torch.get_default_dtype())
    seed = draw_init_seed()  # before any layer: built on meta, the layers draw nothing
    model = auto_class.from_config(hf_config)
    model.init_seed = seed
    initialize_parameters(model)  # eager build: re-drawn here; on meta: left for the strategy
    return model


ADAPTERS = "adapters"  # where in the run directory a LoRA run writes its adapters
WEIGHTS_PREFIX = "model."  # HFLanguageModel keeps the transformers model as `self.model`
LORA_KEYS = {"r": "r", "alpha": "lora_alpha", "dropout": "lora_dropout", "target_modules": "target_modules",
             "target_parameters": "target_parameters"}


def with_lora(model: torch.nn.Module, lora: dict[str, Any] | None) -> torch.nn.Module:
    """`model` with PEFT's LoRA adapters (`lora`: the lora/ config group's keys), or `model` itself."""
    if not lora:
        return model
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise ValueError(f"model.lora.{unknown[0]}: not a LoRA option; choose from {', '.join(LORA_KEYS)}")
    from peft import LoraConfig, get_peft_model

    options = {LORA_KEYS[key]: value for key, value in lora.items()}
    if not isinstance(options.get("target_modules", "all-linear"), str):
        options["target_modules"] = list(options["target_modules"])
    seed = getattr(model, "init_seed", None)
    if seed is None:  # pretrained: nothing drew before, under any strategy
        return get_peft_model(model, LoraConfig(**options))
    # A random base drew from the global generator while it was built eagerly (ddp), not on the meta device (fsdp):
    # PEFT's adapters, drawn next, differed between the two (measured: Llama's losses 7e-3 apart at step 1). Drawn
    # from the base's own seed instead, they are the same under every strategy.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return get_peft_model(model, LoraConfig(**options))


class HFLanguageModel(ConfiguredOptimizers, L.LightningModule):
    """`optimizer` and `scheduler` come from the `optimizer/` and `scheduler/` config groups (AdamW by default)."""

    def __init__(
        self,
        model_type: str = "gpt2",
        config: dict[str, Any] | None = None,
        pretrained: str | None = None,
        optimizer: OptimizerFactory | None = None,
        scheduler: SchedulerFactory | None = None,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["optimizer", "scheduler"])
        self.optimizer_factory, self.scheduler_factory = optimizer, scheduler
        # A LoRA base is frozen: held in the folder's dtype (bf16 for most), as transformers and PEFT hold it, not
        # in the run's float32, which doubled its memory (PEFT makes the adapters float32 on a 16-bit base).
        base = build_language_model(model_type, config, pretrained, dtype="auto" if lora else None)
        if getattr(base.config, "output_router_logits", False) and not computes_router_loss(base):
            raise ValueError(f"model.config.output_router_logits=true: {type(base).__name__} computes no routers'"
                             " load-balancing loss (transformers has none for it); set model.config."
                             "output_router_logits=false")
        self.model: Any = with_lora(base, lora)

    def on_train_end(self) -> None:
        if self.hparams.get("lora"):  # on every rank: each holds a part of the adapters
            save_adapters(self.model, Path(self.trainer.default_root_dir) / ADAPTERS)

    def forward(self, tokens: torch.Tensor, decoder_tokens: torch.Tensor | None = None,
                whole_output: bool = False) -> Any:
        """The logits; `whole_output`: the model's output (its `aux_loss` too, for a mixture of experts)."""
        if decoder_tokens is None:
            output = self.model(input_ids=tokens)
        else:
            output = self.model(input_ids=tokens, decoder_input_ids=decoder_tokens)
        return output if whole_output else output.logits

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        inputs, targets = batch  # targets are the inputs shifted by one token
        if self.model.config.is_encoder_decoder:
            half = inputs.shape[1] // 2
            logits, targets = self(inputs[:, :half], inputs[:, half:]), targets[:, half:]
            return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        # Through this module's call, not straight to the model's: the engines hook this module too (called past
        # it, ZeRO-3's dry run of a LoRA model held 3x its sharded parameters: tests/test_dry_run.py).
        output = self(inputs, whole_output=True)
        loss = F.cross_entropy(output.logits.flatten(0, 1).float(), targets.flatten())
        # A mixture of experts asked for its routers' load-balancing loss (`output_router_logits`) returns it apart
        # (Mixtral, Qwen2-MoE, OLMoE): weighed in as the model weighs it when given `labels=`.
        balance = getattr(output, "aux_loss", None)
        if balance is None and getattr(self.model.config, "output_router_logits", False):
            raise ValueError("model.config.output_router_logits=true: the routers' balancing loss did not reach the"
                             " step (pipeline stages each hold some of the routers); set it false to train without it")
        return loss if balance is None else loss + self.model.config.router_aux_loss_coef * balance

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("test_loss", self._loss(batch), sync_dist=True)
