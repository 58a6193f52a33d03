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
# The whole suite: two pytest-xdist workers, each running whole files (a file's module fixtures,
# its servers and Celery workers, start once), so one file's set-ups and waits overlap the
# other's compute. Named tests run in this one process (--pdb works). MMSERVE_TEST_WORKERS=N
# sets the number either way (0: one process).
default_workers=2
if [ ${#targets[@]} -eq 0 ]; then
    default_workers=0
fi
workers=${MMSERVE_TEST_WORKERS:-$default_workers}
xdist=()
if [ "$workers" != 0 ]; then
    xdist=(-n "$workers" --dist loadfile)
fi
exec .venv/bin/python -m pytest -q "${xdist[@]}" "${targets[@]}" "$@"
