#!/usr/bin/env bash
# End-to-end tests of `deltafin serve` with the official openai Python package (see docs/SERVER.md).
#
# Installs the pinned client (and jsonschema, which checks constrained answers) into a virtual environment under
# the target directory (or, where venv is missing, with pip directly), builds the CLI, and runs
# tests/e2e/run_e2e.py against the k3-tiny-a fixture on a free 127.0.0.1 port. The driver always stops the
# server.
set -euo pipefail
cd "$(dirname "$0")/../.."

OPENAI_VERSION=3.57.0
JSONSCHEMA_VERSION=4.26.0
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
VENV="$TARGET_DIR/e2e-venv"

if [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" 2>/dev/null; then
    PY="$VENV/bin/python"
else
    echo "note: python3 -m venv unavailable; installing openai with pip directly"
    PY=python3
fi
PACKAGES=("openai==$OPENAI_VERSION" "jsonschema==$JSONSCHEMA_VERSION")
if ! "$PY" -c "
import sys, importlib.metadata as m
sys.exit(m.version('openai') != '$OPENAI_VERSION' or m.version('jsonschema') != '$JSONSCHEMA_VERSION')" 2>/dev/null; then
    # Machines whose Python is marked externally managed (PEP 668) need --break-system-packages outside a venv.
    "$PY" -m pip install --quiet --disable-pip-version-check "${PACKAGES[@]}" \
        || "$PY" -m pip install --quiet --disable-pip-version-check --break-system-packages "${PACKAGES[@]}"
fi

cargo build -p deltafin-cli --locked
"$PY" tests/e2e/run_e2e.py --bin "$TARGET_DIR/debug/deltafin" --model tests/fixtures/k3/k3-tiny-a
