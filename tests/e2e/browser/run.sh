#!/usr/bin/env bash
# The chat page at `/` in a real headless browser: Debian's chromium and chromium-driver (installed with apt when
# missing), driven by selenium from the e2e virtual environment, against `deltafin serve` on the k3-tiny-a
# fixture. Called from .ci/run after tests/e2e/run.sh (which made the venv and built the CLI).
set -euo pipefail
cd "$(dirname "$0")/../../.."

SELENIUM_VERSION=4.40.0
TARGET_DIR="${CARGO_TARGET_DIR:-target}"
VENV="$TARGET_DIR/e2e-venv"

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    echo "installing chromium and chromium-driver (apt)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null
fi
if [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV" 2>/dev/null; then
    PY="$VENV/bin/python"
else
    PY=python3
fi
if ! "$PY" -c "import selenium, sys; sys.exit(selenium.__version__ != '$SELENIUM_VERSION')" 2>/dev/null; then
    "$PY" -m pip install --quiet --disable-pip-version-check "selenium==$SELENIUM_VERSION" \
        || "$PY" -m pip install --quiet --disable-pip-version-check --break-system-packages \
            "selenium==$SELENIUM_VERSION"
fi

cargo build -p deltafin-cli --locked
"$PY" tests/e2e/run_e2e.py --bin "$TARGET_DIR/debug/deltafin" --model tests/fixtures/k3/k3-tiny-a \
    --suite tests/e2e/browser/test_chat_page.py
