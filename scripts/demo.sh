#!/usr/bin/env bash
# Sets everything up (Debian packages, build) and runs the demo: on this machine's gettext
# catalogs, two emulated sites joined by an emulated WAN pre-train a multilingual encoder, then
# a translation student on one site learns from a teacher on the other (README, "The demo").
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
scripts/build.sh
exec build/nebula demo "$@"
