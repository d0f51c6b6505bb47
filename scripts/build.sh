#!/usr/bin/env bash
# Configures (once) and builds nebula into build/. Extra args go to cmake, e.g. -DTorch_DIR=...
set -euo pipefail
cd "$(dirname "$0")/.."
export CCACHE_DIR="${CCACHE_DIR:-$PWD/.ccache}"
if [ ! -f build/build.ninja ]; then
  cmake -S . -B build -G Ninja "$@"
fi
cmake --build build -j "$(nproc)"
