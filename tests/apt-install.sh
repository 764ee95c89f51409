#!/usr/bin/env bash
# Install Debian packages for a test tier (tests/e2e/ensure-prometheus.sh, tests/cluster/ensure-iptables.sh):
# apt-get as root, or through sudo; a package's service is kept from starting where an init system would
# start it (only the packages' commands are used).
set -euo pipefail
sudo=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "need root (or sudo) to apt-get install $*" >&2; exit 1; }
    sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    trap '$sudo rm -f "$policy"' EXIT
fi
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "$@" >/dev/null
