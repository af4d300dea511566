#!/usr/bin/env bash
# Runs the test suite; sets up .venv on first run. Extra arguments go to pytest.
# Fails when pytest's session did not reach its end (a test that exits the interpreter itself, os._exit(0) say,
# would otherwise end the run early with status 0 and every later test unrun).
set -u
source "$(dirname "$0")/_bootstrap.sh" || exit 1
cd "$root" || exit 1
done_file=$(mktemp) || exit 1
rm -f "$done_file"
STRIDE_PYTEST_DONE="$done_file" python -m pytest "$@"
status=$?
if [ ! -f "$done_file" ]; then
    echo "scripts/test.sh: pytest ended (status $status) before its session finished: a test ended the process" >&2
    [ "$status" -eq 0 ] && status=1
fi
rm -f "$done_file"
exit $status
