#!/usr/bin/env bash
# The GPU suite (tests/gpu) on a CUDA machine, and its report.
#
#   bash scripts/gpu_check.sh [REPORT]        # default: GPU.md at the repository root (and a copy in $OUT where set)
#
# A bare CUDA machine has torch and lightning but may lack deepspeed and Hydra. Those are installed into a side
# directory, from wheels in .whl/ (scripts/gpu_wheels.sh makes them, for machines with no network) or from the
# registry; the machine's own torch is kept (the report says which versions ran). pytest runs in one process, with
# whatever pytest 8 or 9 the machine has (or the one from .whl/): pytest-xdist and the suite's CI options are left
# out, the GPU runs go several at a time by themselves (tests/gpu/conftest.py). Exit status: pytest's.
set -uo pipefail
cd "$(dirname "$0")/.."
report=${1:-GPU.md}
python=${PYTHON:-python3}
site=${LD_GPU_SITE:-/tmp/lightning-dist-site}

# QLoRA's test needs Hugging Face's libraries and bitsandbytes: their wheels (62 MB, `scripts/gpu_wheels.sh hf`) are
# carried in a call of their own, beside .whl/'s within the 64 MB a call carries.
if compgen -G ".whl-hf/*.whl" >/dev/null && ! $python -c "import bitsandbytes, peft, transformers" 2>/dev/null; then
    $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl-hf/*.whl || exit 1
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
if ! $python -c "import deepspeed, hydra, omegaconf, submitit, hydra_plugins.hydra_submitit_launcher, pytest" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        $python -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
    else
        $python -m pip install -q --no-cache-dir --target "$site" deepspeed==0.19.8 hydra-core==1.3.8 \
            hydra-submitit-launcher==1.2.0 "pytest>=8,<9.2" || exit 1
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the package from this checkout, not installed over torch
export PYTHONWARNINGS=ignore::DeprecationWarning
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true

measurements=$(mktemp --suffix .json)
log=$(mktemp --suffix .log)
LD_GPU_MEASUREMENTS=$measurements $python -m pytest tests/gpu -m gpu -p no:cacheprovider -p no:xdist \
    -o addopts="--strict-markers" -q -rfE 2>&1 | tee "$log"
status=${PIPESTATUS[0]}
summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1 | tr -d '=')
$python -m tests.gpu.report "$measurements" "$report" "${summary:-no tests ran} (exit $status)"
cp "$log" "${report%.md}.log" 2>/dev/null || true
if [ -n "${OUT:-}" ]; then cp "$report" "${report%.md}.log" "$OUT/" 2>/dev/null || true; fi
echo "report: $report"
exit "$status"
