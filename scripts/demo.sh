#!/usr/bin/env bash
# Sets up Ferry and runs its main job on the bundled example: a tiny Llama and a LoRA adapter
# trained by PEFT (fixtures/cases/llama_lora_all_linear_f32). It converts the adapter into a
# merged Hugging Face model, a vLLM-style fused model and a clean engine adapter, then checks
# the merged model against the one PEFT's merge_and_unload() produced.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/build.sh ferry
FERRY=build/cli/ferry
EXAMPLE=fixtures/cases/llama_lora_all_linear_f32
OUT=${FERRY_DEMO_OUT:-build/demo}
rm -rf "$OUT"

echo "== the adapter"
"$FERRY" inspect "$EXAMPLE/adapter" --no-tensors
echo
echo "== convert: merged (hf), fused and lora layouts"
"$FERRY" convert --base "$EXAMPLE/base" --adapter "$EXAMPLE/adapter" --out "$OUT/merged"
"$FERRY" convert --base "$EXAMPLE/base" --adapter "$EXAMPLE/adapter" --out "$OUT/fused" --layout fused
"$FERRY" convert --base "$EXAMPLE/base" --adapter "$EXAMPLE/adapter" --out "$OUT/lora" --layout lora
echo
echo "== the merged model"
"$FERRY" inspect "$OUT/merged" --no-tensors
echo
echo "== Ferry's merge against PEFT's merge_and_unload() (fp32: within 1e-5 relative)"
"$FERRY" diff "$EXAMPLE/merged" "$OUT/merged" --rtol 1e-5 --atol 1e-6
