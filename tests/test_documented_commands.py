"""Every command in a shell block of README.md, of the pages in docs/ and of the recipes' READMEs is run by a test or
is marked, in its own comment, as needing a GPU or a cluster. The commands that no other test runs are run here, as
typed, each page's from one fresh working directory (later commands read what earlier ones wrote), at a few steps
each; a line that another page's test already ran and checked is not run again."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TRAIN_ENV, documented_lines

README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "recipes").glob("*/README.md"))]
MARKS = ("needs a GPU", "needs a cluster")
REFUSED = "refused"  # a command shown for its one-line error: it must exit 2, saying it on its first line
# Set-up lines: the install that .ci/run itself performs (the README's test command, extracted there).
SET_UP = ("python -m venv ", "python3 -m venv ", "pip install ", "dpkg -s libaio-dev")
# Commands another test runs (from the README, `documented(...)`, or the recipe's steps with the same choices), and
# what that test's file must hold for it.
RUN_ELSEWHERE = {
    "python -m pytest": (".ci/run", "test-command"),  # the whole suite; its fast tier is part of it
    "bash .ci/compat_tier prepare 2.11.0": (".ci/run", "bash .ci/compat_tier prepare"),  # CI's compatibility tier
    "mkdocs build --strict": ("tests/test_docs.py", '"--strict"'),
    "python -m build": ("tests/test_installed_package.py", '"-m", "build"'),  # the sdist and wheel, then installed
    "python train.py dry_run=true trainer=gpu trainer.devices=8 trainer.num_nodes=8 strategy=fsdp": (
        "tests/test_dry_run.py", 'documented(PAGE, "python train.py dry_run=true")'),
    "python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_7b dry_run=true trainer=gpu trainer.devices=8 trainer.num_nodes=8 strategy=fsdp": (
        "tests/test_dry_run.py", 'documented(PAGE, TARGET_7B + "fsdp")'),
    "python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_7b dry_run=true trainer=gpu trainer.devices=8 trainer.num_nodes=8 strategy=deepspeed_stage_3": (
        "tests/test_dry_run.py", 'documented(PAGE, TARGET_7B + "deepspeed_stage_3")'),
    "python -m lightning_dist.prepare deepspeed_stage_3_offload": ("tests/test_prepare.py", 'documented(REPO / "docs" / "install.md"'),
    # tensor parallelism on 4 ranks: the same overrides, 20 steps, losses compared with ddp's
    "python train.py strategy=fsdp_tp trainer.devices=4": ("tests/strategies/test_tensor_parallel.py", '"strategy=fsdp_tp"'),
    "python train.py strategy=hsdp_tp trainer.devices=4 strategy.data_parallel_replicate_size=2": (
        "tests/strategies/test_tensor_parallel.py", '"strategy.data_parallel_replicate_size=2"'),
    "python train.py model=hf_llama strategy=deepspeed_stage_2 strategy.tensor_parallel_size=2 trainer.devices=4": (
        "tests/strategies/test_tensor_parallel.py", '"strategy.tensor_parallel_size=2"'),
    # pipeline stages on 4 and 8 ranks: the same overrides, 20 steps, losses compared with ddp's
    "python train.py strategy=fsdp_pp trainer.devices=4": (
        "tests/strategies/test_pipeline_parallel.py", '"strategy=fsdp_pp", "trainer.devices=4"'),
    "python train.py strategy=fsdp_pp trainer.devices=4 strategy.pipeline_schedule=GPipe": (
        "tests/strategies/test_pipeline_parallel.py", '"strategy.pipeline_schedule=GPipe"'),
    "python train.py strategy=fsdp_pp trainer.devices=4 strategy.pipeline_schedule=Interleaved1F1B strategy.stages_per_rank=2": (
        "tests/strategies/test_pipeline_parallel.py", '"strategy.pipeline_schedule=Interleaved1F1B", "strategy.stages_per_rank=2"'),
    "python train.py strategy=fsdp_pp trainer.devices=4 strategy.pipeline_schedule=ZBVZeroBubble strategy.stages_per_rank=2": (
        "tests/strategies/test_pipeline_parallel.py", '"strategy.pipeline_schedule=ZBVZeroBubble", "strategy.stages_per_rank=2"'),
    "python train.py strategy=fsdp_tp_pp trainer.devices=8": (
        "tests/strategies/test_pipeline_parallel.py", '"strategy=fsdp_tp_pp", "trainer.devices=8"'),
    "python train.py model=hf_llama strategy=fsdp_pp trainer.devices=4 strategy.pipeline_schedule=Interleaved1F1B strategy.stages_per_rank=2": (
        "tests/strategies/test_pipeline_parallel.py", 'pp_runs(f"{HF_LLAMA} Interleaved1F1B")'),
    # the pipelined 70B dry runs: the same commands, typed in full (TARGET_70B + SCHEDULES)
    "python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_70b dry_run=true trainer=gpu trainer.devices=8 trainer.num_nodes=8 strategy=fsdp_pp strategy.pipeline_parallel_size=8": (
        "tests/strategies/test_pipeline_dry_run.py", "dry_run(8, schedule)"),
    "python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_70b dry_run=true trainer=gpu trainer.devices=8 trainer.num_nodes=8 strategy=fsdp_pp strategy.pipeline_parallel_size=8 strategy.pipeline_schedule=Interleaved1F1B strategy.stages_per_rank=2": (
        "tests/strategies/test_pipeline_dry_run.py", '"Interleaved1F1B": " strategy.pipeline_schedule=Interleaved1F1B strategy.stages_per_rank=2"'),
    "python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_70b dry_run=true trainer=gpu trainer.devices=8 trainer.num_nodes=128 strategy=fsdp_pp strategy.pipeline_parallel_size=8": (
        "tests/strategies/test_pipeline_dry_run.py", 'dry_run(128, "1F1B")'),
    # context parallelism on 4 ranks: the same overrides, 10 steps, losses compared with those without it
    "python train.py strategy=fsdp strategy.context_parallel_size=2 trainer.devices=4 data.block_size=1024 data.batch_size=2": (
        "tests/strategies/test_context_parallel.py", 'LONG = ("data.block_size=1024", "data.batch_size=2")'),
    "python train.py model=hf_llama strategy=fsdp strategy.context_parallel_size=2 trainer.devices=4": (
        "tests/strategies/test_context_parallel.py", '"llama cp 2": (*LLAMA, *CP_2)'),
    "python train.py strategy=fsdp strategy.context_parallel_size=2 strategy.tensor_parallel_size=2 trainer.devices=4 strategy.activation_checkpointing=ops strategy.compile=true data.block_size=512 data.batch_size=4": (
        "tests/strategies/test_context_parallel.py", '"gpt cp 2 x tp 2, ops, compiled": (*SHORTER, *CP_2, "strategy.tensor_parallel_size=2",'),
    "python train.py strategy=deepspeed_stage_2 strategy.context_parallel_size=2 trainer.devices=2 data.block_size=512 data.batch_size=4": (
        "tests/strategies/test_context_parallel.py", '"gpt zero-2 cp 2": (*SHORTER, "strategy=deepspeed_stage_2", "strategy.context_parallel_size=2", "trainer.devices=2")'),
    "python train.py model=hf_llama strategy=deepspeed strategy.config=recipes/long_context/ds_config_ulysses_zero3.json trainer.devices=4": (
        "tests/strategies/test_context_parallel.py", '"llama zero-3 cp 2 from its file": (*LLAMA, "strategy=deepspeed", f"strategy.config={ULYSSES_CONFIG}",'),
    "python train.py strategy=fsdp strategy.context_parallel_size=2 strategy.context_parallel=ring trainer=gpu trainer.devices=4 dry_run=true": (
        "tests/strategies/test_context_parallel.py", '" strategy.context_parallel=ring trainer=gpu trainer.devices=4 dry_run=true")'),
    "python train.py strategy=fsdp strategy.context_parallel_size=2 trainer.devices=4 dry_run=true": (
        "tests/strategies/test_context_parallel.py", '" trainer.devices=4 dry_run=true")'),
    # recipes/long_context: its 8,192-token runs and its 7B dry run, read from the recipe by the tests that run them
    "python train.py strategy=fsdp trainer.devices=2 data.block_size=8192 data.batch_size=1 trainer.max_steps=3": (
        "tests/recipes/test_long_context.py", 'documented_commands(RECIPE) if "data.block_size=8192" in c'),
    "python train.py strategy=fsdp strategy.context_parallel_size=2 trainer.devices=4 data.block_size=8192 data.batch_size=1 trainer.max_steps=3": (
        "tests/recipes/test_long_context.py", 'documented_commands(RECIPE) if "data.block_size=8192" in c'),
    "python train.py strategy=auto_fit strategy.family=fsdp strategy.device_memory_gb=0.22 trainer.devices=4 data.block_size=8192 data.batch_size=1 trainer.max_steps=3": (
        "tests/recipes/test_long_context.py", 'documented_commands(RECIPE) if "auto_fit" in c'),
    "python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_7b dry_run=true trainer=gpu trainer.devices=8 trainer.num_nodes=8 strategy=fsdp strategy.context_parallel_size=8 strategy.activation_checkpointing=true data.block_size=131072 data.batch_size=1 data.repeat=8": (
        "tests/recipes/test_long_context.py", 'documented_commands(RECIPE) if "dry_run=true" in c'),
    "python train.py -m strategy=ddp,fsdp trainer.max_steps=20": ("tests/run/test_multirun.py", "python train.py -m strategy="),
    "python -m lightning_dist.sweep_report logs/train/multiruns/<date>": ("tests/run/test_multirun.py", "python -m lightning_dist.sweep_report"),
    "python train.py -m hparams_search=optuna": ("tests/run/test_hparams_search.py", "python train.py -m hparams_search=optuna"),
    # docs/deepspeed-configs.md: a ds_config file with the Trainer's precision, and NVMe offload, each run with the
    # same choices by the tests of what they do
    "python train.py strategy=deepspeed strategy.config=tests/strategies/deepspeed/config/configs/transformers_ds_config_zero2.json trainer.precision=bf16-mixed": (
        "tests/strategies/deepspeed/config/test_deepspeed_config_runs.py", 'zero2_runs("bf16-mixed")'),
    "mkdir -p /tmp/nvme && python train.py strategy=deepspeed_stage_3_offload_nvme strategy.nvme_path=/tmp/nvme": (
        "tests/strategies/test_nvme_offload.py", '"strategy=deepspeed_stage_3_offload_nvme", f"strategy.nvme_path={nvme}"'),
    # recipes/
    "python train.py strategy=deepspeed strategy.config=tests/strategies/deepspeed/config/configs/transformers_ds_config_zero2.json": (
        "tests/recipes/test_bring_your_ds_config.py", "strategy.config={HF_ZERO2}"),
    "python -m recipes.bring_your_ds_config.show_auto tests/strategies/deepspeed/config/configs/transformers_ds_config_zero2.json": (
        "tests/recipes/test_bring_your_ds_config.py", "show_auto(["),
    "python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_7b plan=true strategy=deepspeed_stage_3": (
        "tests/recipes/test_choose_a_strategy.py", '"strategy=deepspeed_stage_3"'),
    "python train.py --config-dir recipes/choose_a_strategy/conf model=gpt_7b plan=true trainer.devices=8 trainer.precision=bf16-mixed strategy=auto_fit": (
        "tests/recipes/test_choose_a_strategy.py", '"strategy.device_memory_gb=80"'),
    "python train.py -m strategy=ddp,fsdp,deepspeed_stage_2,deepspeed_stage_3": ("tests/recipes/test_choose_a_strategy.py", 'documented(README, "python train.py -m'),
    "python train.py model=hf_gpt2 strategy=fsdp_activation_checkpointing": (
        "tests/recipes/test_hf_causal_lm.py", '"fsdp_activation_checkpointing"'),
    "python train.py model=hf_bart": ("tests/recipes/test_hf_causal_lm.py", '"model=hf_bart"'),
    "python train.py model=hf_gpt2 model.pretrained=": ("tests/recipes/test_hf_causal_lm.py", 'f"model.pretrained='),
    "lightning-dist export merged": ("tests/recipes/test_finetune.py", "documented_commands(RECIPE)"),
    # expert parallelism on 4 ranks: the same overrides, 5 steps, losses compared with ep 1's
    "python train.py model=gpt_moe strategy=fsdp strategy.expert_parallel_size=2 trainer.devices=4": (
        "tests/parallel/test_expert_parallel.py", '"gpt_moe ep 2": ("strategy=fsdp", "strategy.expert_parallel_size=2"'),
    "python train.py model=hf_mixtral strategy=deepspeed_stage_3 strategy.expert_parallel_size=2 trainer.devices=2": (
        "tests/strategies/test_deepspeed_expert_parallel.py", 'ZERO_3 = ("model=hf_mixtral", "strategy=deepspeed_stage_3")'),
    # recipes/moe (and docs/strategies.md's MoE command): its page's commands in order, by its own test
    "python train.py model=gpt_moe strategy=deepspeed_stage_3 trainer.devices=2": (
        "tests/recipes/test_moe.py", "documented_commands(RECIPE)"),
    "python -m recipes.finetune.make_pretrained pretrained/mixtral": ("tests/recipes/test_moe.py", "documented_commands(RECIPE)"),
    "python train.py model=hf_mixtral model.pretrained=pretrained/mixtral": (
        "tests/recipes/test_moe.py", "documented_commands(RECIPE)"),
    "lightning-dist export mixtral-tuned": ("tests/recipes/test_moe.py", "documented_commands(RECIPE)"),
    # docs/finetune.md: a LoRA model's plan and dry run
    "python train.py model=hf_llama +lora=default": (
        "tests/test_dry_run.py", 'command.startswith("python train.py model=hf_llama +lora=default ")'),
    "lightning-dist export": ("tests/recipes/test_hf_causal_lm.py", "export([str(checkpoint), str(folder)])"),
    # recipes/finetune: its page's commands in order, by its own test
    "python -m recipes.finetune.": ("tests/recipes/test_finetune.py", "documented_commands(RECIPE)"),
    "lightning-dist generate pretrained/llama": ("tests/recipes/test_finetune.py", "documented_commands(RECIPE)"),
    "lightning-dist generate merged": ("tests/recipes/test_finetune.py", "documented_commands(RECIPE)"),
    "python train.py model=hf_llama model.pretrained=pretrained/llama": (
        "tests/recipes/test_finetune.py", "documented_commands(RECIPE)"),
    "python recipes/lightning_hydra_template/train.py trainer=ld_fsdp": ("tests/recipes/test_lightning_hydra_template.py", 'f"trainer={trainer}"'),
    # the template project's own src/train.py, which the recipe's train.py reproduces, with the same trainer configs
    "python src/train.py trainer=": ("tests/recipes/test_lightning_hydra_template.py", 'f"trainer={trainer}"'),
    "sbatch recipes/multi_node/train.sbatch": ("tests/recipes/test_multi_node.py", "train.sbatch"),
    # two nodes on one machine: scripts/two_nodes.py starts torchrun's agents as these commands do
    "GLOO_SOCKET_IFNAME=ldv0 OMP_NUM_THREADS=1 torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d": (
        "tests/run/test_two_nodes.py", 'rendezvous="c10d"'),
    "ip netns exec ld-node1 env GLOO_SOCKET_IFNAME=ldv1 OMP_NUM_THREADS=1 torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d": (
        "tests/run/test_two_nodes.py", 'local_addr={0: "10.77.0.1", 1: "10.77.0.2"}'),
    "OMP_NUM_THREADS=1 torchrun --nnodes 2": ("tests/run/test_two_nodes.py", "run_nodes("),
    "GLOO_SOCKET_IFNAME=ldv0 OMP_NUM_THREADS=1 torchrun --nnodes 2": ("tests/run/test_two_nodes.py", "GLOO_SOCKET_IFNAME"),
    "ip netns exec ld-node1 env GLOO_SOCKET_IFNAME=ldv1": ("tests/run/test_two_nodes.py", "GLOO_SOCKET_IFNAME"),
    "ip ": ("tests/run/test_two_nodes.py", "documented_network_commands()"),
}
STEPS = "trainer.max_steps=3"  # a few steps: what is tested is that the command runs, not the training
RESUMED_STEPS = "trainer.max_steps=6"  # past the checkpoint the resumed run starts from
RUN_DIRS = "logs/*/runs/*"  # logs/train/runs/<time>, and logs/debug/runs/<time> for debug=...
# The lines already run and checked in this session, as run: a page that shows a command another page showed (the
# README's `python train.py` in getting-started.md, a recipe's command on its docs page) does not run it again, unless
# its later commands read what that run left in their directory.
RAN: set[str] = set()
FIRST_RUN_READ = ("<run>", "CHECKPOINT", "<a deepspeed_stage_3 checkpoint", "<same overrides as before>")


def all_commands() -> list[tuple[Path, str, str]]:
    return [(readme, command, comment) for readme in PAGES for command, comment in documented_lines(readme)]


def commands_run_here(readme: Path) -> list[str]:
    shown_from_readme = set() if readme == README else readme_main_commands()
    return [command for command, comment in documented_lines(readme)
            if _runs_here(command, comment) and command not in shown_from_readme]


def readme_main_commands() -> set[str]:
    """The README's two-command block (the docs' home page shows it too): run by the README's own test."""
    block = README.read_text().split("<!-- main-command -->", 1)[1].split("<!-- /main-command -->", 1)[0]
    return {line.strip() for line in block.splitlines() if line.strip() and not line.startswith("```")}


def _runs_here(command: str, comment: str) -> bool:
    return not (any(mark in comment for mark in MARKS) or _set_up_only(command) or _elsewhere(command))


def _set_up_only(command: str) -> bool:
    return not _runnable_part(command)


def _elsewhere(command: str) -> tuple[str, str] | None:
    return next((where for start, where in RUN_ELSEWHERE.items() if _runnable_part(command).startswith(start)), None)


def _runnable_part(command: str) -> str:
    """The command without its set-up: `pip install ... && python train.py` runs `python train.py`; the libaio
    line is set-up only."""
    if not command.startswith(SET_UP):
        return command
    return command[command.index("&& python ") + 3:] if "&& python " in command else ""


def test_every_documented_command_is_run_by_a_test_or_marked():
    for _, command, _ in all_commands():
        where = _elsewhere(command)
        if where is not None:
            assert where[1] in (REPO / where[0]).read_text(), (command, where)
    run_here = {command for readme in PAGES for command in commands_run_here(readme)}
    accounted = {c for _, c, comment in all_commands() if c in run_here or _elsewhere(c) or _set_up_only(c)
                 or any(mark in comment for mark in MARKS) or c in readme_main_commands()}
    assert readme_main_commands() <= set(commands_run_here(README)) | {c for c in readme_main_commands() if _set_up_only(c)}
    assert accounted == {c for _, c, _ in all_commands()}
    assert len(run_here) >= 15  # the README's and the pages' own, and the recipes' not run by their tests


# --------------------------------------------------------------------------- the commands no other test runs


@pytest.mark.slow
@pytest.mark.parametrize("readme", [page for page in PAGES if commands_run_here(page)],
                         ids=lambda p: str(p.relative_to(REPO)))
def test_the_documented_commands_run_as_written(readme, tmp_path, deepspeed_ops, request):
    commands = commands_run_here(readme)
    if any("nvme" in command for command in commands):
        # async_io built first, outside the command's timeout: a loaded suite's first build of it took the 900 s of
        # docs/deepspeed-configs.md's NVMe command (2026-12-01).
        request.getfixturevalue("nvme_ops")
    for shared in ("recipes", "tests"):  # what commands name relative to a clone's root
        (tmp_path / shared).symlink_to(REPO / shared)
    made: dict[str, Path | None] = {}  # command -> the run directory it made
    refused = {command for command, comment in documented_lines(readme) if REFUSED in comment}
    first_run_read = any(mark in later for later in commands[1:] for mark in FIRST_RUN_READ)
    for command in commands:
        run_as = _as_run_here(command, commands, made)
        if run_as in RAN and not (command == commands[0] and first_run_read):
            continue
        before = set(tmp_path.glob(RUN_DIRS))
        process = _run(run_as, tmp_path)
        if command in refused:
            assert process.returncode == 2 and process.stderr.startswith("error: "), f"{command}\n{process.stderr}"
            assert set(tmp_path.glob(RUN_DIRS)) == before
            continue
        assert process.returncode == 0, f"{command}\n{process.stderr[-3000:]}"
        new = sorted(set(tmp_path.glob(RUN_DIRS)) - before, key=lambda p: p.name)
        made[command] = new[-1] if new else None
        _check(command, process, made[command], tmp_path)
        RAN.add(run_as)


def _as_run_here(command: str, commands: list[str], made: dict[str, Path | None]) -> str:
    first_run = made.get(commands[0])  # the page's first command, e.g. docs/checkpoints.md's ZeRO-3 run
    command = _runnable_part(command)
    if first_run is not None:
        command = command.replace("<run>", first_run.name)
        command = command.replace("<a deepspeed_stage_3 checkpoint from 2 ranks>", str(first_run / "checkpoints" / "last.ckpt"))
        command = command.replace("CHECKPOINT", str(first_run / "checkpoints" / "last.ckpt"))
    if "<same overrides as before>" in command:  # the first command again, as it ran
        return command.replace("<same overrides as before>", f"{commands[0].split(' ', 2)[2]} {STEPS}")
    if "python train.py" in command and "plan=true" not in command and "debug=" not in command:
        steps = RESUMED_STEPS if "ckpt_path=" in command else STEPS
        command = re.sub(r"trainer\.max_steps=\d+", steps, command) if "max_steps=" in command else f"{command} {steps}"
    if "lightning_dist.equivalence" in command:
        command = re.sub(r"trainer\.max_steps=\d+", STEPS, command)
    return command


def _run(command: str, cwd: Path) -> subprocess.CompletedProcess:
    python = shlex.quote(sys.executable)
    command = command.replace("python train.py", f"{python} {shlex.quote(str(REPO / 'train.py'))}")
    command = command.replace("python -m ", f"{python} -m ")
    if command.startswith("lightning-dist "):  # the console script's own function, in this environment
        command = f"{python} -m lightning_dist.commands {command.removeprefix('lightning-dist ')}"
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=900, env=TRAIN_ENV)


def _check(command: str, process: subprocess.CompletedProcess, run_dir: Path | None, cwd: Path) -> None:
    """What each kind of command must leave, beyond exiting 0."""
    output = process.stdout + process.stderr
    if "plan=true" in command:
        strategy = re.search(r"strategy=(\w+)", command)
        precision = re.search(r"trainer\.precision=([\w-]+)", command)
        said = f"Memory plan: {strategy[1] if strategy else 'ddp'}, {precision[1] if precision else '32-true'}, 2 ranks"
        assert said in process.stdout, process.stdout[-2000:]
    elif "dry_run=true" in command:
        assert "**peak**" in process.stdout and run_dir is None, process.stdout[-2000:]
    elif "show_auto" in command:
        assert "auto -> " in process.stdout
    elif "-m hydra/launcher=local" in command:
        (sweep,) = (cwd / "logs" / "train" / "multiruns").iterdir()
        assert sorted(p.name for p in sweep.glob("*/metrics.json") for p in [p.parent]) == ["0", "1"]
    elif "resume=true" in command:  # the page's first run, of the same overrides, trained to its end
        assert "resume=true: nothing left to train: the newest whole checkpoint of this command, " in output
        assert "checkpoints/last.ckpt, is the last save of a run that trained to its end" in output
    elif "lightning_dist.checkpoints.consolidate" in command:
        consolidated = torch.load(cwd / "model.ckpt", weights_only=True)
        assert "model.token_embedding.weight" in consolidated["state_dict"]
        (line,) = output.strip().splitlines()  # nothing stray: no warning, no DeepSpeed progress
        assert line.startswith("Consolidated ") and line.endswith("/checkpoints/last.ckpt -> model.ckpt")
    elif "lightning_dist.equivalence" in command:
        rows = [line for line in process.stdout.splitlines() if line.startswith("| ") and "strategy" not in line]
        assert [row.split(" | ")[0].strip("| ") for row in rows] == ["ddp", "fsdp", "deepspeed_stage_3"]
        assert all(float(row.split(" | ")[3].strip(" |")) < 1e-5 for row in rows)
    else:  # a training run
        assert run_dir is not None and (run_dir / "metrics.json").exists(), command
        assert "Final metrics: " in process.stdout and "Traceback" not in process.stderr
        if "ckpt_path=" in command:
            assert "Restoring states from the checkpoint" in output or "resum" in output.lower()
