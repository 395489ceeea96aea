#!/usr/bin/env bash
# The main job: capture the tiny example, plan it for this machine, compile it and train it with
# the recipe of examples/train/llama_tiny.toml (warmup + cosine, clipping, held-out evaluation).
set -euo pipefail
cd "$(dirname "$0")/.."
H2C=.venv/bin/h2c
H2X=.venv/bin/h2x
CONFIG=examples/train/llama_tiny.toml
echo "== h2c ir: layers and costs of examples/llama_tiny.py"
$H2C ir examples/llama_tiny.py --summary
echo
echo "== h2c compile --config $CONFIG (HeteroAuto on the built-in 'local' cluster)"
$H2C compile --config $CONFIG
echo
cat build/plan.h2plan
echo
echo "== h2x run build --config $CONFIG: 40 steps, eval on the held-out README every 10"
$H2X run build --config $CONFIG --trace build/trace.json
echo
echo "per-step log: build/train.jsonl   measured timeline (open in ui.perfetto.dev): build/trace.json"
echo "every setting: h2c config"
