#!/usr/bin/env bash
# Install what is needed, then train the image template on the built-in digits on one CPU process.
set -euo pipefail
. "$(dirname "${BASH_SOURCE[0]}")/setup_env.sh"
export WANDB_MODE="${WANDB_MODE:-offline}"
accelerate launch --config_file accelerate_configs/cpu.yaml templates/image_classification.py "$@"
