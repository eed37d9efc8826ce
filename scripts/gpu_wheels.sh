#!/usr/bin/env bash
# Wheels for a CUDA machine that cannot reach a package registry (Python 3.12, x86-64): what scripts/gpu_check.sh
# installs there when its Python lacks them. Writes .whl/ at the repository root (ignored by git).
#   bash scripts/gpu_wheels.sh hf   # .whl-hf/ instead: transformers, peft and bitsandbytes (QLoRA's GPU test), 62 MB
set -euo pipefail
cd "$(dirname "$0")/.."
platforms=(--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64)
if [[ ${1:-} == hf ]]; then
    mkdir -p .whl-hf
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" \
        -d .whl-hf bitsandbytes==0.50.2 transformers==5.24.0 peft==0.21.2 safetensors==0.8.0 tokenizers==0.23.3 \
        huggingface-hub==2.4.0
    ls -la .whl-hf
    exit 0
fi
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
    hydra-core==1.3.8 omegaconf==2.3.1 hydra-submitit-launcher==1.2.0 submitit==1.5.4 hjson==3.1.0 \
    pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2 \
    pytest==9.1.1 pluggy==1.7.0 iniconfig==2.3.1  # for a machine without pytest (gpu_check.sh runs in one process)
# Published as source only: built here into pure-Python wheels (DeepSpeed compiles its CUDA ops there, on first use).
DS_BUILD_OPS=0 python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl deepspeed==0.19.8 antlr4-python3-runtime==4.9.3
ls -la .whl
