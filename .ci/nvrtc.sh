#!/usr/bin/env bash
# NVIDIA's NVRTC from its pip wheel (no GPU, driver or CUDA toolkit needed), unpacked under target/: prints the
# directory that holds libnvrtc.so.13, for LD_LIBRARY_PATH. The version is pinned so that CI compiles the kernels with
# one known compiler; pip is installed with apt-get where it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=13.5.37
DIR="target/nvrtc-$VERSION"
LIB="$DIR/nvidia/cu13/lib"
if [ ! -e "$LIB/libnvrtc.so.13" ]; then
    if ! python3 -m pip --version >/dev/null 2>&1; then
        echo "-- apt-get install python3-pip" >&2
        apt-get update -qq >&2
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends python3-pip >&2
    fi
    rm -rf "$DIR"
    python3 -m pip download --quiet --disable-pip-version-check --no-deps "nvidia-cuda-nvrtc==$VERSION" \
        -d "$DIR/wheel" >&2
    python3 -m zipfile -e "$DIR"/wheel/*.whl "$DIR"
fi
cd "$LIB" && pwd
