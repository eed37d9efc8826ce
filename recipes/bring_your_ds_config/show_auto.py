"""What each "auto" of a DeepSpeed config became in a run: the file as written beside the config in effect.

    python -m recipes.bring_your_ds_config.show_auto ds_config.json            # the newest run in logs/train/runs
    python -m recipes.bring_your_ds_config.show_auto ds_config.json RUN_DIR    # or a run directory (or its file)
"""

from __future__ import annotations

import argparse
import json
from functools import reduce
from pathlib import Path

from lightning_dist.reports.runs import RUNS, newest_run
from lightning_dist.strategies.deepspeed.config.resolve import auto_keys

EFFECTIVE = "deepspeed_config.effective.json"  # what a DeepSpeed run writes in its directory


def filled_autos(source: dict, effective: dict) -> dict[str, object]:
    """{dotted key: the value the run used} for every "auto" in `source`."""
    return {key: reduce(lambda node, part: node[part], key.split("."), effective) for key in auto_keys(source)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the DeepSpeed config as written")
    parser.add_argument("run", type=Path, nargs="?", help=f"a run directory or its {EFFECTIVE}; default: the newest run in {RUNS}")
    args = parser.parse_args(argv)
    effective = _effective_config(args.run)
    filled = filled_autos(json.loads(args.source.read_text()), json.loads(effective.read_text()))
    width = max(map(len, filled), default=0)
    for key, value in filled.items():
        print(f"{key:<{width}}  auto -> {json.dumps(value)}")
    return 0


def _effective_config(run: Path | None) -> Path:
    run = run or newest_run(EFFECTIVE)
    return run / EFFECTIVE if run.is_dir() else run


if __name__ == "__main__":
    raise SystemExit(main())
