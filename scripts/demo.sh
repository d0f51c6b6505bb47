#!/usr/bin/env bash
# Sets everything up (Debian packages, build) and runs the demo: two emulated sites joined by
# an emulated WAN, pre-training a multilingual MLM on this machine's gettext catalogs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
exec build/nebula demo "$@"
