#!/usr/bin/env bash
# Set up (if needed) and start the server: bash scripts/serve.sh [--llm PATH] [--port N] ...
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
exec .venv/bin/mmserve serve "$@"
