#!/usr/bin/env bash
# Runs the test suite; sets up .venv on first run. Extra arguments go to pytest.
set -u
source "$(dirname "$0")/_bootstrap.sh" || exit 1
cd "$root" || exit 1
exec python -m pytest "$@"
