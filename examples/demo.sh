#!/usr/bin/env bash
# The main job: capture the tiny example, plan it for this machine, compile it, train it.
set -euo pipefail
cd "$(dirname "$0")/.."
H2C=.venv/bin/h2c
H2X=.venv/bin/h2x
echo "== h2c ir: layers and costs of examples/llama_tiny.py"
$H2C ir examples/llama_tiny.py --summary
echo
echo "== h2c compile --plan auto (HeteroAuto on the built-in 'local' cluster)"
$H2C compile examples/llama_tiny.py --plan auto -o build
echo
cat build/plan.h2plan
echo
echo "== h2x run: train for 30 steps"
$H2X run build --steps 30 --json-log build/train.jsonl --trace build/trace.json
echo
echo "per-step log: build/train.jsonl   measured timeline (open in ui.perfetto.dev): build/trace.json"
