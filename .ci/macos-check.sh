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
# The `emulated` profile, as .ci/aarch64.sh builds with: the build scripts and proc macros a cross build compiles for
# the host (and cannot share with the native steps) are then compiled once for both scripts. Only code generation
# differs between profiles, so what is checked is the same as under the default one.
cargo check --locked --profile emulated --target aarch64-apple-darwin --workspace --all-targets
# The same code through clippy's lints (the NEON kernels and the macOS paths are not compiled by the native clippy
# step); the dependencies are checked already, so this costs seconds.
cargo clippy --locked --profile emulated --target aarch64-apple-darwin --workspace --all-targets -- -D warnings
echo "-- macOS check done in $((SECONDS - start)) s"
