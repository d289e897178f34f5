#!/usr/bin/env bash
# Run the tests selected by a marker expression in a venv; "no tests collected" is a failure.
# usage: .ci/pytest_tier.sh VENV "MARKER EXPRESSION"
set -uo pipefail
venv=$1; marks=$2
"$venv/bin/python" -m pytest -q -m "$marks" tests --durations=10
rc=$?
if [ "$rc" -eq 5 ]; then echo "no tests selected by -m '$marks': failing"; exit 1; fi
exit "$rc"
