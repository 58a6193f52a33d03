#!/usr/bin/env bash
# Set up (if needed) and run the test suite. Extra arguments go to pytest; when they name test
# files or directories, only those run, otherwise the whole tests/ directory.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh

targets=(tests)
for arg in "$@"; do
    if [[ "$arg" != -* && -e "${arg%%::*}" ]]; then
        targets=()
        break
    fi
done
# Two pytest-xdist workers, each running whole files (a file's module fixtures, its servers and
# Celery workers, start once): one file's set-ups and waits overlap the other's compute.
# MMSERVE_TEST_WORKERS=0 runs the tests in this one process.
workers=${MMSERVE_TEST_WORKERS:-2}
xdist=()
if [ "$workers" != 0 ]; then
    xdist=(-n "$workers" --dist loadfile)
fi
exec .venv/bin/python -m pytest -q "${xdist[@]}" "${targets[@]}" "$@"
