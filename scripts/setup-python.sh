#!/usr/bin/env bash
# Creates .venv with what the Python schema checks need (schemas/requirements.txt).
# Idempotent: reinstalls only when the requirements change.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
stamp=.venv/.requirements
if ! cmp -s schemas/requirements.txt "$stamp"; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r schemas/requirements.txt
  cp schemas/requirements.txt "$stamp"
fi
echo "python checks ready: .venv/bin/python"
