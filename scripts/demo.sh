#!/usr/bin/env bash
# Set everything up, then profile the built-in demo CNN with the stats and flops plugins.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec "${HOOKPLUG_VENV:-.venv}/bin/hookplug" profile cnn --plugins stats,flops --backward "$@"
