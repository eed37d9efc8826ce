#!/usr/bin/env bash
# Everything a lent GPU machine should measure, in one call of at most 8 minutes, written to one report.
#
#   bash scripts/gpu_check.sh [REPORT]          # on the GPU machine; default report: GPU.md (a copy in $OUT where set)
#   bash scripts/gpu_check.sh --cpu [REPORT]    # the rehearsal on a CPU: every part that can run there, scaled down
#
# The parts, most valuable first, each under its own limit (seconds; they sum to 480, under the call's 8 minutes):
#   1. set-up, 20: deepspeed, Hydra and pytest from .whl/ (scripts/gpu_wheels.sh) where the machine lacks them
#   2. the GPU suite (tests/gpu), 250: every preset's 20 fp32 steps against ddp's, mixed precision, resume, the
#      plain load of a consolidated checkpoint, tensor parallelism on 2 GPUs, QLoRA where its wheels came
#   3. ours against the raw loops (benchmarks/gpu_compare.py --budget), 130: and the seconds parts 1 and 2 left
#      unused, and part 4's where it does not run (one GPU: about 250 in all). ddp, fsdp and ZeRO-3 eager, then ddp
#      and fsdp compiled, ZeRO-2 and ZeRO-1; a row that would not end in the time left is not started (a run takes
#      about 45 s on an H200, most of it start-up). Each row's step time, MFU, CUDA peak against the plan, host reads
#      per quiet step; ZeRO-3 against FSDP2. A row above 1.03 is run again on both sides under cProfile before the
#      next (where the host time went; about 90 s)
#   4. tensor, pipeline and context parallelism, 60: each on 2 GPUs (nccl) beside ddp on 1, 20 steps, the same
#      batches; where fewer than 2 are visible, not run
#   5. the report, 20: GPU.md, every part's figures and the parts that failed or ran past their limits
# --cpu: the suite's tests need a GPU (none runs); gpu_compare runs the tiny GPT on 6 steps
# ($LD_GPU_CHECK_ROWS, default ddp), unprofiled (tests/test_gpu_compare.py profiles a row on its own); part 4 runs
# on 2 CPU ranks (gloo); every limit is 4 times as long (2 CPU cores shared with a test suite). tests/test_gpu_compare.py runs it so, keeping its work in $LD_GPU_CHECK_WORK.
# Exit status: 1 where a part failed or ran past its limit (the report says which), else 0.
set -uo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
    exit 0
fi
device=cuda
if [ "${1:-}" = "--cpu" ]; then device=cpu; shift; fi
report=$(realpath -m "${1:-GPU.md}")
python=${PYTHON:-python3}
site=${LD_GPU_SITE:-/tmp/lightning-dist-site}
work=${LD_GPU_CHECK_WORK:-$(mktemp -d)}
mkdir -p "$work"
CALL_LIMIT=480  # seconds of the parts' limits together (times scale): the call's 8 minutes
scale=1
[ "$device" = cpu ] && scale=4
failed=()
part() {  # part NAME LIMIT COMMAND...: the command under its limit; its failure is named, the next part still runs
    local name=$1 limit=$2 started=$SECONDS
    shift 2
    timeout --kill-after=10 "$((limit * scale))" "$@"
    local status=$?
    echo "gpu_check: $name took $((SECONDS - started)) s of its $((limit * scale)) (exit $status)"
    [ "$status" = 0 ] || failed+=("$name (exit $status$([ "$status" = 124 ] && echo ", past its limit"))")
    return 0
}

set_up() {
    # QLoRA's test needs Hugging Face's libraries and bitsandbytes: their wheels (62 MB, `scripts/gpu_wheels.sh hf`)
    # are carried in a call of their own, beside .whl/'s within the 64 MB a call carries.
    if compgen -G ".whl-hf/*.whl" >/dev/null && ! $python -c "import bitsandbytes, peft, transformers" 2>/dev/null; then
        $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl-hf/*.whl || return 1
    fi
    if ! $python -c "import deepspeed, hydra, omegaconf, submitit, hydra_plugins.hydra_submitit_launcher, pytest" 2>/dev/null; then
        if compgen -G ".whl/*.whl" >/dev/null; then
            $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || return 1
        else
            $python -m pip install -q --no-cache-dir --target "$site" deepspeed==0.19.8 hydra-core==1.3.8 \
                hydra-submitit-launcher==1.2.0 "pytest>=8,<9.2" || return 1
        fi
    fi
}
export -f set_up
export python site
part "set-up" 20 bash -c set_up
[ -d "$site" ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the package from this checkout, not installed over torch
export PYTHONWARNINGS=ignore::DeprecationWarning
[ "$device" = cpu ] && export DS_ACCELERATOR=cpu
gpus=0
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    gpus=$($python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
fi

# 2. The GPU suite: pytest in one process, with whatever pytest 8 or 9 the machine has; pytest-xdist and the suite's
# CI options are left out, the GPU runs go several at a time by themselves (tests/gpu/conftest.py).
measurements=$work/measurements.json
summary="not run: no GPU"
if [ "$device" = cuda ]; then
    export LD_GPU_MEASUREMENTS=$measurements
    part "the GPU suite" 250 $python -m pytest tests/gpu -m gpu -p no:cacheprovider -p no:xdist \
        -o addopts="--strict-markers" -q -rfE > "$work/suite.log" 2>&1
    cat "$work/suite.log"
    summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$work/suite.log" | tail -1 | tr -d '=')
    summary=${summary:-no tests ran}
fi

# 3. Ours against the raw loops, the rows that fit: its own limit, and what the parts before it left unused and the
# axes will not take (they run only with 2 GPUs, or in the rehearsal).
later=20
{ [ "$gpus" -ge 2 ] || [ "$device" = cpu ]; } && later=$((later + 60))
compare_limit=$((CALL_LIMIT - later - SECONDS / scale))
if [ "$device" = cuda ]; then
    part "ours against raw" $compare_limit $python benchmarks/gpu_compare.py --budget $(((compare_limit - 25) * scale)) \
        --out "$work/compare"
else
    # shellcheck disable=SC2086  # the rows are words
    part "ours against raw" $compare_limit $python benchmarks/gpu_compare.py --device cpu --shape tiny --steps 6 \
        --budget $(((compare_limit - 25) * scale)) --rows ${LD_GPU_CHECK_ROWS:-ddp} --split-above inf --out "$work/compare"
fi

# 4. The parallel axes across 2 devices, each with 1 data-parallel rank: the batches of ddp on one device, and its losses.
axes() {
    local accelerator=$1
    for layout in "ddp 1 ddp" "fsdp_tp 2 fsdp_tp" "fsdp_pp 2 fsdp_pp" "fsdp_cp 2 fsdp strategy.context_parallel_size=2"; do
        # shellcheck disable=SC2086  # a layout is its name, its devices, its preset and the preset's overrides
        set -- $layout
        $python train.py "strategy=$3" "${@:4}" "trainer.accelerator=$accelerator" "trainer.devices=$2" \
            trainer.max_steps=20 test=false trainer.log_every_n_steps=1 "hydra.run.dir=$work/axes/$1" \
            > "$work/axes.log" 2>&1 || { tail -20 "$work/axes.log"; return 1; }
    done
}
export -f axes
export work
if [ "$gpus" -ge 2 ]; then
    part "tensor, pipeline and context parallelism" 60 bash -c "axes gpu"
elif [ "$device" = cpu ]; then
    part "tensor, pipeline and context parallelism" 60 bash -c "axes cpu"
fi

# 5. The report.
part "the report" 20 $python -m tests.gpu.report "$measurements" "$report" "$summary" "$work" "${failed[*]:-}"
if [ -n "${OUT:-}" ]; then cp "$report" "$OUT/" 2>/dev/null || true; fi
echo "report: $report"
[ -n "${LD_GPU_CHECK_WORK:-}" ] || rm -rf "$work"
[ ${#failed[@]} = 0 ]
