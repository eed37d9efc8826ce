"""Kill -9 every rank of a training run at random moments during its saves (every 2 steps), resume with
`resume=true`, again and again, until the run finishes; then its weights must equal an uninterrupted run's.

    python -m scripts.fault_loop --strategy fsdp --kills 20 --workdir /tmp/faults
    python -m scripts.fault_loop --strategy fsdp --kills 20 --workdir /tmp/faults_async checkpoint.async=true

The test suite runs a scaled-down loop (tests/checkpoints/test_fault_loop.py); this is the long one.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# 30 steps of the checkpoint-probe GPT (it writes its gathered weights at the end), saving every 2 steps.
OVERRIDES = (
    "model._target_=tests.models.checkpoint_probe.CheckpointProbeGPT",
    "+model.gathered_path=${paths.output_dir}/gathered_state.pt",
    "trainer.max_steps=30", "test=false",
    "callbacks.model_checkpoint.every_n_train_steps=2",
    "callbacks.model_checkpoint.save_top_k=1",
    "callbacks.model_checkpoint.monitor=null",
    "resume=true",
    "+callbacks.kill._target_=tests.probes.KillDuringSave",  # the kill -9 itself (armed through the environment)
)


@dataclass
class FaultLoop:
    returncode: int          # of the run that finished
    final_run: Path          # its directory (gathered_state.pt)
    kills: list[str] = field(default_factory=list)  # what was being written at each kill


def train_through_kills(strategy: str, runs_root: Path, kills: int, seed: int = 0, timeout_s: float = 600,
                        overrides: tuple[str, ...] = ()) -> FaultLoop:
    """Run, and have every rank SIGKILLed 0-15 ms into the run's save number 0-3 (counted from its start), `kills`
    times, each time starting the same command again; then let the last attempt finish. The kill comes from a
    timer inside the run (tests/probes.py KillDuringSave): polling from outside misses saves that last 10 ms."""
    rng = random.Random(seed)
    done = []
    for attempt in range(kills + 1):
        run_dir = runs_root / f"attempt{attempt:02d}"
        armed = {"FAULT_KILL_AT_SAVE": str(rng.randint(0, 3)), "FAULT_KILL_DELAY_S": f"{rng.uniform(0, 0.015):.4f}"}
        env = {**os.environ, "PYTHONWARNINGS": "ignore::DeprecationWarning", **(armed if attempt < kills else {})}
        command = [sys.executable, str(REPO / "train.py"), f"strategy={strategy}", f"hydra.run.dir={run_dir}",
                   *OVERRIDES, *overrides]
        with open(runs_root / f"attempt{attempt:02d}.log", "w") as log:
            process = subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                returncode = process.wait(timeout=timeout_s)
            finally:
                _reap(process.pid)
        if returncode == -signal.SIGKILL:
            cut_off = sorted(p.name for p in (run_dir / "checkpoints").glob(".*.partial"))
            done.append(f"attempt {attempt}: save {armed['FAULT_KILL_AT_SAVE']} + {armed['FAULT_KILL_DELAY_S']} s"
                        f" (left behind: {', '.join(cut_off) or 'nothing, the save had finished'})")
        elif returncode == 0:  # finished before its kill, if the loop asked for more kills than saves were left
            break
        else:
            raise RuntimeError(f"attempt {attempt} failed with exit code {returncode}: see {log.name}")
    return FaultLoop(returncode, run_dir, done)


def _reap(group: int) -> None:
    # A rank the launcher had started may outlive its parent for a moment: the next attempt needs the CPU.
    try:
        os.killpg(group, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: list[str] | None = None) -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", required=True)
    parser.add_argument("--kills", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("overrides", nargs="*", help="more of train.py's overrides, for every attempt")
    args = parser.parse_args(argv)
    reference_dir = args.workdir / "uninterrupted"
    subprocess.run([sys.executable, str(REPO / "train.py"), f"strategy={args.strategy}", f"hydra.run.dir={reference_dir}",
                    *OVERRIDES, *args.overrides], cwd=REPO, check=True, capture_output=True)
    (args.workdir / "runs").mkdir(parents=True, exist_ok=True)
    loop = train_through_kills(args.strategy, args.workdir / "runs", args.kills, args.seed,
                               overrides=tuple(args.overrides))
    print("\n".join(loop.kills))
    final, reference = (torch.load(d / "gathered_state.pt") for d in (loop.final_run, reference_dir))
    worst = max((final[k].float() - reference[k].float()).abs().max().item() for k in reference if k != "bytes_seen")
    print(f"| strategy | kills | final exit | max weight difference vs uninterrupted |\n|---|---|---|---|\n"
          f"| {args.strategy} | {len(loop.kills)} | {loop.returncode} | {worst:.2e} |")
    return 0 if loop.returncode == 0 and worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
