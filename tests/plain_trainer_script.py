"""A user's own script: plain `L.Trainer`, no Hydra, modules that are not ours. Writes OUT_DIR/rank<N>.json.

    python tests/plain_trainer_script.py OUT_DIR ld_fsdp              # a registered name, Lightning's BoringModel
    python tests/plain_trainer_script.py OUT_DIR FSDPStrategy-ac      # a class instance: FSDP + activation checkpointing
    python tests/plain_trainer_script.py OUT_DIR ld_fsdp_activation_checkpointing encoder  # torch's TransformerEncoder
    python tests/plain_trainer_script.py OUT_DIR ld_fsdp_activation_checkpointing encoder_decoder  # Lightning's demo
    python tests/plain_trainer_script.py OUT_DIR ld_fsdp mesh        # configure_model on device_mesh["data_parallel"]
    python tests/plain_trainer_script.py OUT_DIR ld_fsdp_tp tensor_parallel  # Lightning's tensor-parallel docs
    python tests/plain_trainer_script.py OUT_DIR ld_fsdp feedforward 1  # the same model on one rank
    python tests/plain_trainer_script.py OUT_DIR ds-config:PATH      # DeepSpeedStrategy(config=PATH)
    python tests/plain_trainer_script.py OUT_DIR ds-dict:PATH        # DeepSpeedStrategy(config=dict), betas etc. set
"""

import json
import sys
from collections import Counter
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

import lightning_dist
from lightning_dist.parallel.placement import parameter_numel


class RecordingBoringModel(BoringModel):
    def training_step(self, batch, batch_idx):
        output = super().training_step(batch, batch_idx)
        self.losses = [*getattr(self, "losses", []), float(output["loss"])]
        return output


class EncoderModel(RecordingBoringModel):
    """BoringModel's task through torch's own nn.TransformerEncoder, whose layers sit in an nn.ModuleList."""

    def __init__(self):
        super().__init__()
        layer = torch.nn.TransformerEncoderLayer(d_model=32, nhead=2, dim_feedforward=64, batch_first=True)
        self.layer = torch.nn.Sequential(torch.nn.TransformerEncoder(layer, num_layers=2), torch.nn.Linear(32, 2))

    def forward(self, x):
        return self.layer(x.unsqueeze(1)).squeeze(1)


class DemoTransformer(LightningTransformer):
    """Lightning's own demo LightningTransformer, an nn.Transformer with an encoder and a decoder stack, unchanged but
    for its size, no dropout (losses are compared across strategies) and random tokens instead of a download."""

    def __init__(self, vocab_size: int = 64):
        super().__init__(vocab_size)
        self.model = Transformer(vocab_size=vocab_size, ninp=32, nhead=2, nhid=64, nlayers=2, dropout=0.0)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.losses = [*getattr(self, "losses", []), float(loss)]
        return loss

    def prepare_data(self):
        pass  # the demo downloads WikiText-2 here

    def train_dataloader(self):
        tokens = torch.randint(0, self.model.vocab_size, (2, 64, 12), generator=torch.Generator().manual_seed(0))
        return DataLoader(TensorDataset(*tokens), batch_size=4)


class MixedListModel(RecordingBoringModel):
    """An nn.ModuleList of two classes: which one is the block cannot be inferred."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.ModuleList([torch.nn.Linear(32, 32), torch.nn.Linear(32, 2), torch.nn.ReLU()])

    def forward(self, x):
        for layer in self.layer:
            x = layer(x)
        return x


class MeshConfiguredModel(RecordingBoringModel):
    """`configure_model` as Lightning's documentation writes it for its ModelParallelStrategy: FSDP2 over the
    mesh's `data_parallel` axis, applied by the module itself."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        data_parallel = self.device_mesh["data_parallel"]
        self.mesh_axes = {name: self.device_mesh[name].size() for name in self.device_mesh.mesh_dim_names}
        fully_shard(self.layer, mesh=data_parallel)


class FeedForward(torch.nn.Module):
    """The model of Lightning's tensor-parallel documentation."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = torch.nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = torch.nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = torch.nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class FeedForwardModel(RecordingBoringModel):
    def __init__(self):
        super().__init__()
        self.layer = FeedForward(32, 64)

    def train_dataloader(self):
        # Drawn from a generator of its own: BoringModel's draws from the global one, which strategies use differently.
        data = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
        return DataLoader(data, batch_size=2)


class TensorParallelModel(FeedForwardModel):
    """`configure_model` as Lightning's tensor-parallel documentation writes it: the feed-forward layers split over
    the mesh's `tensor_parallel` axis, then FSDP2 over `data_parallel`, by the module itself."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        tp_mesh = self.device_mesh["tensor_parallel"]
        dp_mesh = self.device_mesh["data_parallel"]
        self.mesh_axes = {name: self.device_mesh[name].size() for name in self.device_mesh.mesh_dim_names}
        if tp_mesh.size() > 1:
            plan = {"w1": ColwiseParallel(), "w2": RowwiseParallel(), "w3": ColwiseParallel()}
            parallelize_module(self.layer, tp_mesh, plan)
        if dp_mesh.size() > 1:
            fully_shard(self.layer.w1, mesh=dp_mesh)
            fully_shard(self.layer.w2, mesh=dp_mesh)
            fully_shard(self.layer.w3, mesh=dp_mesh)
            fully_shard(self.layer, mesh=dp_mesh)


MODELS = {"boring": RecordingBoringModel, "encoder": EncoderModel, "encoder_decoder": DemoTransformer,
          "mixed": MixedListModel, "mesh": MeshConfiguredModel, "feedforward": FeedForwardModel,
          "tensor_parallel": TensorParallelModel}


def main(out_dir: str, choice: str, model_name: str = "boring", devices: str = "2") -> None:
    strategy = choice
    if choice == "FSDPStrategy-ac":
        strategy = lightning_dist.FSDPStrategy(activation_checkpointing=True, block_class=torch.nn.Linear)
    elif choice.startswith("ds-config:"):
        strategy = lightning_dist.DeepSpeedStrategy(config=choice.removeprefix("ds-config:"))
    elif choice.startswith("ds-dict:"):
        # BoringModel's optimizer is SGD: Adam's settings cannot be copied from it, so the dict names them.
        config = json.loads(Path(choice.removeprefix("ds-dict:")).read_text())
        config["optimizer"]["params"].update(betas=[0.9, 0.999], eps=1e-8, weight_decay=0.0)
        strategy = lightning_dist.DeepSpeedStrategy(config=config)
    L.seed_everything(0)
    model = MODELS[model_name]()
    trainer = L.Trainer(
        strategy=strategy, accelerator="cpu", devices=int(devices), max_steps=4, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model)
    local, total = parameter_numel(model)
    # One file per rank: both ranks share stdout, where their lines can interleave.
    (Path(out_dir) / f"rank{trainer.global_rank}.json").write_text(json.dumps({
        "rank": trainer.global_rank,
        "strategy": type(trainer.strategy).__name__,
        "backend": getattr(trainer.strategy, "_get_process_group_backend", lambda: None)(),
        "global_step": trainer.global_step,
        "losses": model.losses,
        "parameters_local": local,
        "parameters_total": total,
        "checkpointed": Counter(type(m._checkpoint_wrapped_module).__name__ for m in model.modules() if isinstance(m, CheckpointWrapper)),
        "fsdp_units": sum(isinstance(m, FSDPModule) for m in model.modules()),
        "deepspeed_config": getattr(trainer.strategy, "config", None) if choice.startswith("ds-") else None,
        "mesh_axes": getattr(model, "mesh_axes", None),
    }))


if __name__ == "__main__":
    main(*sys.argv[1:])
