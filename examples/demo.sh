#!/usr/bin/env bash
# The main job: capture the tiny example into h2ir and show its layers and costs.
set -euo pipefail
cd "$(dirname "$0")/.."
H2C=.venv/bin/h2c
$H2C ir examples/llama_tiny.py --summary
