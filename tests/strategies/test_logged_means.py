"""The bundled model's `train_loss` means the same at any data-parallel size: two ranks of 4 sequences each log the
mean of their losses, which is the loss of the 8 sequences one rank trains on (the weights of the two runs match);
Lightning's own `self.log` logs rank 0's 4 alone. `mean_when_logged` averages at the steps the loggers write only."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from lightning_dist.reports.equivalence import read_train_losses
from tests.conftest import REPO, run_train

pytestmark = pytest.mark.slow

# 10 steps, logged at 5 and 10; neither validation nor test (the curves compared are the training loss's).
SHORT = ("strategy=ddp", "trainer.max_steps=10", "trainer.num_sanity_val_steps=0", "trainer.limit_val_batches=0",
         "test=false", "+model.gathered_path=${paths.output_dir}/gathered_state.pt",
         "model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT")


def test_two_ranks_log_the_loss_of_the_batch_one_rank_trains_on_whole(tmp_path):
    two = run_train(tmp_path / "two", *SHORT, "trainer.devices=2", "data.batch_size=4")
    one = run_train(tmp_path / "one", *SHORT, "trainer.devices=1", "data.batch_size=8")
    for run in (two, one):
        assert run.process.returncode == 0, run.output[-3000:]
    two_losses, one_losses = read_train_losses(two.run_dir), read_train_losses(one.run_dir)
    assert sorted(two_losses) == sorted(one_losses) == [4, 9]
    assert two_losses == pytest.approx(one_losses, rel=1e-5)
    # The runs trained alike, so what each logged is the same batches' loss, not a match by chance: the weights, to
    # a ten-thousandth (Adam magnifies the rounding of a near-zero gradient); not the probe's count of the bytes
    # seen, rank 0's under DDP.
    two_state, one_state = (torch.load(run.run_dir / "gathered_state.pt") for run in (two, one))
    assert sorted(two_state) == sorted(one_state)
    for name in one_state.keys() - {"bytes_seen"}:
        torch.testing.assert_close(two_state[name], one_state[name], rtol=1e-4, atol=1e-4)


# Two gloo ranks with different losses: the mean at a step the loggers write, each rank's own at the others (no
# collective: a rank that reached one alone would wait for ever), and on a pipeline's last stage the value marked,
# left for every stage to average.
MEANS = """
import json, sys, torch, torch.distributed as dist
from types import SimpleNamespace
from lightning_dist.parallel.logged_means import is_deferred_mean, mean_when_logged, means_deferred
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
class Module(torch.nn.Module):
    device = torch.device("cpu")
module = Module()
loss = torch.tensor(1.0 + 2 * rank, requires_grad=True)
said = {}
for step, logs in ((4, True), (5, False)):
    module._trainer = SimpleNamespace(_logger_connector=SimpleNamespace(should_update_logs=logs))
    said[step] = mean_when_logged(module, loss * 1).item()
module._trainer = SimpleNamespace(_logger_connector=SimpleNamespace(should_update_logs=True))
with means_deferred(module):
    marked = mean_when_logged(module, loss)
said["pipeline"] = [marked.item(), is_deferred_mean(marked), is_deferred_mean(loss)]
print(json.dumps(said))
"""


def test_the_mean_is_taken_at_logging_steps_and_left_to_the_stages_on_a_pipelines_last(tmp_path):
    store = tmp_path / "store"
    ranks = [subprocess.Popen([sys.executable, "-c", MEANS, str(rank), str(store)], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], outputs
    said = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert said == [{"4": 2.0, "5": 1.0, "pipeline": [1.0, True, False]},
                    {"4": 2.0, "5": 3.0, "pipeline": [3.0, True, False]}]
