#!/usr/bin/env bash
# Sets up Ferry and runs its main job on the bundled example: a tiny Llama with a LoRA
# adapter trained by PEFT (fixtures/cases/llama_lora_all_linear_f32).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh ferry
FERRY=build/cli/ferry
EXAMPLE=fixtures/cases/llama_lora_all_linear_f32

echo "== the adapter"
"$FERRY" inspect "$EXAMPLE/adapter"
echo
echo "== the base model"
"$FERRY" inspect --no-tensors "$EXAMPLE/base"
