"""TRL's own `trl sft` script (trl/scripts/sft.py, run unchanged) with one addition for bench/finetune_vs_trl.py:
every --logging_steps optimizer steps it appends to <output_dir>/throughput.jsonl the non-padding tokens that
`SFTTrainer` counted since the previous record (its own `num_tokens` count: attention-mask sums, or the flattened
length when padding-free) and the seconds they took, measured at the end of each optimizer step, as the
fine-tuning template's log measures its `tokens_per_s`. Takes exactly the options of `trl sft`:

    pip install -r bench/requirements-trl.txt
    accelerate launch -q --config_file accelerate_configs/cpu.yaml bench/trl_sft.py \
        --model_name_or_path runs/tiny --dataset_name runs/mixed --output_dir runs/trl ...
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import trl
from transformers import TrainerCallback
from trl.scripts import sft


class ThroughputLog(TrainerCallback):
    """(tokens, seconds) of each logging interval, written by the main process."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.path = Path(trainer.args.output_dir) / "throughput.jsonl"
        self.start, self.tokens = 0.0, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.start, self.tokens = time.perf_counter(), self.trainer._total_train_tokens

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % args.logging_steps and state.global_step != state.max_steps:
            return
        now, tokens = time.perf_counter(), self.trainer._total_train_tokens
        if state.is_world_process_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a") as log:
                log.write(json.dumps({"step": state.global_step, "tokens": tokens - self.tokens,
                                      "seconds": now - self.start}) + "\n")
        self.start, self.tokens = now, tokens


class SFTTrainer(trl.SFTTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.add_callback(ThroughputLog(self))


if __name__ == "__main__":
    trl.SFTTrainer = SFTTrainer  # what sft.main builds (it imports the name from trl when it runs)
    parser = sft.make_parser()
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config(fail_with_unknown_args=False)
    sft.main(script_args, training_args, model_args, dataset_args)
