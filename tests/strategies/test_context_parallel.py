"""Context parallelism on 4 CPU ranks: `strategy=fsdp strategy.context_parallel_size=2` (2 context-parallel x 2 data-
parallel ranks, all_to_all) trains the default GPT at 1,024 tokens a sequence, and a transformers Llama, with the
per-step fp32 losses of the same runs without context parallelism on the 2 data-parallel ranks (the same global
batch), over 10 steps; each rank holds half of every sequence. Activation checkpointing is on in the GPT's run: its
blocks run their exchanged attention again in backward. A context-parallel checkpoint resumes without context
parallelism, and the reverse, with the uninterrupted run's losses (context parallelism holds no weights of its own).
cp 2 x tp 2 with op-level checkpointing and compiled blocks trains one rank's losses. Under DeepSpeed (ZeRO-2 by the
strategy's option, ZeRO-3 by a ds_config's `sequence_parallel_size`) DeepSpeed's own Ulysses trains them too.

torch's ring attention does not train here: on CPU it has no kernel (`_scaled_dot_product_flash_attention_for_cpu`
has no sharding rule in torch 2.13's context-parallel API), and it is refused in one line (tests/test_config_errors.py);
its dry run on fake CUDA is here, Lightning's whole loop with it in tests/test_loop_on_cuda.py."""

from __future__ import annotations

import json

import pytest

from lightning_dist.reports.equivalence import read_train_losses
from tests.conftest import REPO, in_the_suite, run_train

pytestmark = pytest.mark.slow

STEPS = 10  # the same per-step losses over 10 steps as over 20 (both were compared), in half the suite's time
SAVED_AT = 5
COMMON = (f"trainer.max_steps={STEPS}", "test=false", "trainer.log_every_n_steps=1",
          f"callbacks.model_checkpoint.every_n_train_steps={SAVED_AT}", "callbacks.model_checkpoint.save_top_k=-1",
          "callbacks.model_checkpoint.monitor=null")
LONG = ("data.block_size=1024", "data.batch_size=2")  # 2 sequences of 1,024 tokens per data-parallel rank (2,048: 95 s
# of the suite for the same comparison; 8,192 in tests/recipes/test_long_context.py)
SHORTER = ("data.block_size=512", "data.batch_size=4")
ULYSSES_CONFIG = REPO / "recipes" / "long_context" / "ds_config_ulysses_zero3.json"
LLAMA = ("model=hf_llama",)
CP_2 = ("strategy=fsdp", "strategy.context_parallel_size=2", "trainer.devices=4")
RUNS = {
    "gpt cp 2": (*LONG, *CP_2, "strategy.activation_checkpointing=true"),
    "gpt cp 1": (*LONG, "strategy=fsdp", "trainer.devices=2"),
    "llama cp 2": (*LLAMA, *CP_2),
    "llama cp 1": (*LLAMA, "strategy=fsdp", "trainer.devices=2"),
    # Every dimension at once, in parallelize()'s one order: heads split by tp, then by cp's exchange; op-level
    # checkpointing (its policy keeps attention's output); each block compiled with the exchange inside it.
    "gpt cp 2 x tp 2, ops, compiled": (*SHORTER, *CP_2, "strategy.tensor_parallel_size=2",
                                       "strategy.activation_checkpointing=ops", "strategy.compile=true"),
    "gpt 1 rank": (*SHORTER, "strategy=fsdp", "trainer.devices=1"),
    # DeepSpeed's own Ulysses: the strategy's option, and a Hugging Face-style ds_config's `sequence_parallel_size`.
    "gpt zero-2 cp 2": (*SHORTER, "strategy=deepspeed_stage_2", "strategy.context_parallel_size=2", "trainer.devices=2"),
    "llama zero-3 cp 2 from its file": (*LLAMA, "strategy=deepspeed", f"strategy.config={ULYSSES_CONFIG}",
                                        "trainer.devices=4"),
}


@pytest.fixture(scope="module")
def cp_runs(tmp_path_factory):
    runs = {}

    def get(name: str):
        if name not in runs:
            runs[name] = run_train(tmp_path_factory.mktemp("cp"), *RUNS[name], *COMMON)
            assert runs[name].process.returncode == 0, runs[name].output[-3000:]
        return runs[name]

    return get


def metrics(run) -> dict:
    return json.loads((run.run_dir / "metrics.json").read_text())


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_all_to_all_context_parallelism_trains_the_losses_of_whole_sequences(model, cp_runs):
    split, whole = cp_runs(f"{model} cp 2"), cp_runs(f"{model} cp 1")
    expected, losses = read_train_losses(whole.run_dir), read_train_losses(split.run_dir)
    assert sorted(losses) == sorted(expected) == list(range(STEPS))
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step
    assert losses[STEPS - 1] < losses[0] - 0.5  # it learned (the GPT by 0.9, the Llama by 1.6)
    summary, reference = metrics(split), metrics(whole)
    assert summary["parallel_sizes"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 1}
    assert [(c["dp_shard"], c["cp"]) for c in summary["coordinates_per_rank"]] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert summary["data_parallel_size"] == 2
    assert summary["metrics"]["val_loss"] == pytest.approx(reference["metrics"]["val_loss"], rel=1e-5)


def test_context_parallelism_composes_with_tensor_parallelism_op_level_checkpointing_and_compile(cp_runs):
    composed, whole = cp_runs("gpt cp 2 x tp 2, ops, compiled"), cp_runs("gpt 1 rank")
    expected, losses = read_train_losses(whole.run_dir), read_train_losses(composed.run_dir)
    assert sorted(losses) == sorted(expected) == list(range(STEPS))
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step
    assert metrics(composed)["parallel_sizes"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 2}
    assert "torch.compile: compiled" in composed.output
    assert metrics(composed)["metrics"]["val_loss"] == pytest.approx(metrics(whole)["metrics"]["val_loss"], rel=1e-5)


@pytest.mark.parametrize(("run", "reference", "global_batch"), [
    ("gpt zero-2 cp 2", "gpt 1 rank", None),
    ("llama zero-3 cp 2 from its file", "llama cp 1", 32),  # 16 sequences on each of the 2 data-parallel ranks
])
def test_deepspeeds_ulysses_trains_the_losses_of_whole_sequences_under_zero(run, reference, global_batch, cp_runs):
    split, whole = cp_runs(run), cp_runs(reference)
    expected, losses = read_train_losses(whole.run_dir), read_train_losses(split.run_dir)
    assert sorted(losses) == sorted(expected) == list(range(STEPS))
    for step, loss in expected.items():
        assert losses[step] == pytest.approx(loss, rel=1e-5), step
    assert metrics(split)["parallel_sizes"]["cp"] == 2
    assert metrics(split)["metrics"]["val_loss"] == pytest.approx(metrics(whole)["metrics"]["val_loss"], rel=1e-5)
    config = json.loads((split.run_dir / "deepspeed_config.effective.json").read_text())
    assert config["sequence_parallel_size"] == 2
    assert config.get("train_batch_size") == global_batch  # counted over the data-parallel ranks, as DeepSpeed does


RESUMES = {
    # (the run whose step-SAVED_AT checkpoint is read, what resumes it)
    "cp 2 -> cp 1": ("gpt cp 2", (*LONG, "strategy=fsdp", "trainer.devices=2")),
    "cp 1 -> cp 2": ("gpt cp 1", (*LONG, *CP_2)),
}


# Into context parallelism in the extended matrix: a checkpoint holds no context-parallel state either way.
@pytest.mark.parametrize("resume", in_the_suite(list(RESUMES), ["cp 2 -> cp 1"]))
def test_a_checkpoint_moves_in_and_out_of_context_parallelism_with_the_uninterrupted_losses(resume, cp_runs,
                                                                                             tmp_path):
    source, target = RESUMES[resume]
    checkpoint = cp_runs(source).run_dir / "checkpoints" / f"step{SAVED_AT:06d}.ckpt"
    resumed = run_train(tmp_path / "resumed", *target, *COMMON, f"ckpt_path={checkpoint}")
    assert resumed.process.returncode == 0, resumed.output[-3000:]
    uninterrupted, losses = read_train_losses(cp_runs("gpt cp 1").run_dir), read_train_losses(resumed.run_dir)
    assert sorted(losses) == list(range(SAVED_AT, STEPS))
    for step, loss in losses.items():
        assert loss == pytest.approx(uninterrupted[step], rel=1e-5), step


def test_the_dry_run_holds_each_ranks_shard_of_the_sequences_as_the_plan_says(tmp_path):
    """The documented dry run: each rank's activations are its half of the sequences' (the plan's to 1%), the
    weights sharded over the 4 data x context ranks."""
    from tests.conftest import documented, run_documented
    from tests.test_dry_run import rows

    command = documented(REPO / "docs" / "strategies.md", "python train.py strategy=fsdp strategy.context_parallel_size=2"
                         " trainer.devices=4 dry_run=true")
    run = run_documented(command, tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "rank 3: data_parallel_shard=1, context_parallel=1, tensor_parallel=0" in run.stdout
    table = rows(run.stdout)
    assert table["model.blocks.0.mlp.0.weight"][1] == "[128, 128]"  # 512 x 128, sharded 4 ways
    measured, _, planned = (float(v) for v in table["activations"])
    assert abs(measured - planned) <= 0.01 * planned  # 35.8 MB: half of what one rank holds without it
    rank_0, rank_3, plan = (float(v) for v in table["peak"])
    assert rank_0 == rank_3 and abs(rank_0 - plan) / plan < 0.15



def test_ring_attentions_dry_run_steps_each_rank_on_torchs_shard_with_cuda_faked(tmp_path):
    """The documented dry run of `ring` (CUDA's flash kernel, torch's ring over the 2 context-parallel ranks):
    each rank holds half of each sequence's activations, as the plan says (18.5 MB, planned 17.9)."""
    from tests.conftest import documented, run_documented
    from tests.test_dry_run import rows

    command = documented(REPO / "docs" / "strategies.md", "python train.py strategy=fsdp strategy.context_parallel_size=2"
                         " strategy.context_parallel=ring trainer=gpu trainer.devices=4 dry_run=true")
    run = run_documented(command, tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "4 ranks (4 per node) on fake CUDA devices" in run.stdout
    assert "rank 3: data_parallel_shard=1, context_parallel=1, tensor_parallel=0" in run.stdout
    table = rows(run.stdout)
    measured, _, planned = (float(v) for v in table["activations"])
    assert abs(measured - planned) <= 0.05 * planned
    rank_0, rank_3, plan = (float(v) for v in table["peak"])
    assert rank_0 == rank_3 and abs(rank_0 - plan) / plan < 0.15


def test_a_dry_run_of_attention_context_parallelism_cannot_exchange_stops_naming_the_model(tmp_path):
    """The dry run steps each rank as the run does, its attention exchanges counted: attention written out (the
    softmax of q k^T) would see only the rank's shard of each sequence."""
    run = run_train(tmp_path / "run", "model._target_=tests.parallel.written_out_gpt.WrittenOutGPTLanguageModel",
                    "strategy=fsdp", "strategy.context_parallel_size=2", "trainer.devices=4", "dry_run=true")
    assert run.process.returncode != 0
    assert ("strategy.context_parallel_size=2: WrittenOutGPTLanguageModel's forward called"
            " torch.nn.functional.scaled_dot_product_attention 0 times for its 4 blocks, so the rest of its attention"
            " (written out, or another kernel) saw only this rank's shard of the sequence") in run.process.stderr
