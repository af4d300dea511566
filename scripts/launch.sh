#!/usr/bin/env bash
# Serves a model over the OpenAI API (default: SmolLM2-135M-Instruct); sets up .venv on first run.
set -u
source "$(dirname "$0")/_bootstrap.sh" || exit 1
exec python -m stride serve "$@"
