#!/usr/bin/env bash
# macOS type-check: `cargo check --target aarch64-apple-darwin --workspace --all-targets`, warnings as errors, then
# clippy over the same. Nothing is linked or run (that needs a Mac). ring's build script compiles C and assembly
# with the target's C compiler, which needs Apple's SDK; for a check the objects are never linked, so stand-ins that
# write empty objects and archives (.ci/stand-in/) take its place.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
rustup target add aarch64-apple-darwin
export CC_aarch64_apple_darwin="$PWD/.ci/stand-in/cc"
export AR_aarch64_apple_darwin="$PWD/.ci/stand-in/ar"
export RUSTFLAGS="-D warnings"
cargo check --locked --target aarch64-apple-darwin --workspace --all-targets
# The same code through clippy's lints (the NEON kernels and the macOS paths are not compiled by the native clippy
# step); the dependencies are checked already, so this costs seconds.
cargo clippy --locked --target aarch64-apple-darwin --workspace --all-targets -- -D warnings
echo "-- macOS check done in $((SECONDS - start)) s"
