#!/usr/bin/env bash
# The seed's single-node script as a rider-grm launch (8 GPUs, one node); run it from the root of a clone.
set -euo pipefail
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
MODEL_PATH=${MODEL_PATH:-/models/longcat-18b-kefu-sft}
TRAIN_FILE=${TRAIN_FILE:-/data/rider_v4/train_2.parquet}
RM1=${REWARD_MODEL_PATH1:-$MODEL_PATH}
RM2=${REWARD_MODEL_PATH2:-$MODEL_PATH}

uv run accelerate launch --num_processes 8 --num_machines 1 apps/rider-grm/__main__.py \
  --config examples/rider-grm/verl-with-rms.toml \
  model.path="$MODEL_PATH" \
  data.train_files="$TRAIN_FILE" data.val_files="$TRAIN_FILE" \
  reward.judges='[{name="rider", module="examples/rider-grm/reward_function/rating_judge.py", model="'"$RM1"'", weight=0.3, combine="add", temperature=0.7, gate=1.0, gated_out="zero", completion_field="Response"},
                  {name="consistency", module="examples/rider-grm/reward_function/no_contradiction_judge.py", model="'"$RM2"'", weight=0.5, combine="add", temperature=0.7, max_new_tokens=16, gate=1.0, gated_out="zero", completion_field="Response"}]' \
  train.batch_size=32 train.save_freq=30 train.epochs=15 2>&1 | tee rider_grm.log

# The seed's parallel-list form works too (lists of unequal length are rejected at load), but
# has no place for the gate, gated_out and completion_field of each judge: those are the
# rider-grm defaults then (no gate), not VeRL-with-RMs' formula:
#   reward.judges='[]' reward.verl.reward_function=examples/rider-grm/reward_function/rating_judge.py,examples/rider-grm/reward_function/no_contradiction_judge.py \
#   reward.verl.model_path=$RM1,$RM2 reward.verl.reward_weight=0.3,0.5 \
#   reward.verl.reward_combine_func=add,add reward.verl.temperature=0.7,0.7
