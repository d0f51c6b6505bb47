#!/usr/bin/env bash
# Installs every Debian package nebula needs. Idempotent: does nothing when all are present.
set -euo pipefail
PACKAGES=(
  cmake ninja-build ccache g++ pkg-config git
  libtorch-dev libgloo-dev libopenblas0-pthread   # without OpenBLAS LibTorch is ~13x slower
  libssl-dev openssl zlib1g-dev libzstd-dev libisal-dev
  libjemalloc-dev                                 # the nebula binary's allocator (src/util/allocator.h)
  libsentencepiece-dev libtomlplusplus-dev libcli11-dev libspdlog-dev nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev                        # fuzz/: clang++ -fsanitize=fuzzer (libFuzzer)
  python3-torch python3-dev pybind11-dev          # the nebula Python package (python/); a real torchrun
  python3-pytest                                  # its tests
  openmpi-bin                                     # a real mpirun in the launcher tests
  iproute2                                        # `ip netns`: the kernel-level black-hole test (transport)
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
  echo "setup: all ${#PACKAGES[@]} packages present"
fi
