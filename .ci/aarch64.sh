#!/usr/bin/env bash
# aarch64 under emulation: the quant crate's tests (every NEON kernel against its scalar twin, bit for bit) and the
# forward-pass fixture tests (logits against Moonshot's reference), cross-compiled for aarch64-unknown-linux-gnu and
# run under qemu-aarch64 (user-mode emulation). Installs the cross linker and qemu with apt-get when they are
# missing (as root; CI runs as root) and the Rust target with rustup.
#
# The log shows, for every dispatch test, which kernels it exercised ("...: Mxfp4F32 on neon"); a dispatch test that
# finds NEON missing fails. Extra arguments go to the test binaries (e.g. a test name filter).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS

if ! command -v aarch64-linux-gnu-gcc >/dev/null || ! { command -v qemu-aarch64-static || command -v qemu-aarch64; } >/dev/null; then
    echo "-- apt-get install gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user-static >/dev/null
fi
rustup target add aarch64-unknown-linux-gnu
qemu=$(command -v qemu-aarch64-static || command -v qemu-aarch64)
echo "-- tools ready after $((SECONDS - start)) s: $($qemu --version | head -1)"

export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="$qemu -L /usr/aarch64-linux-gnu"
export RUSTFLAGS="-D warnings"
# The emulator keeps the process's madvise from the kernel, so memory advised to use huge pages never gets them:
# the test that checks it says so in the log instead of failing.
echo "note: under qemu user emulation madvise does not reach the kernel: the huge-pages check is skipped" \
    "(DELTAFIN_TEST_SKIP=huge-pages)"
export DELTAFIN_TEST_SKIP="${DELTAFIN_TEST_SKIP:+$DELTAFIN_TEST_SKIP,}huge-pages"

cargo test --locked --profile emulated --target aarch64-unknown-linux-gnu \
    -p deltafin-quant -p deltafin-tests --lib --test simd_twins --test forward_fixtures \
    -- --show-output "$@"
echo "-- aarch64 done in $((SECONDS - start)) s"
