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
exec .venv/bin/python -m pytest -q "${targets[@]}" "$@"
