#!/usr/bin/env bash
# The e2e suite runs Debian's prometheus and promtool binaries (package `prometheus`). Install the
# package when either is missing. Only the binaries are used: the tests start prometheus themselves
# with a temporary config and data folder on a loopback port, never the packaged service.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi
sudo=""
if [ "$(id -u)" != 0 ]; then
    command -v sudo >/dev/null || { echo "need root (or sudo) to apt-get install prometheus" >&2; exit 1; }
    sudo="sudo"
fi
echo "installing Debian's prometheus package (prometheus, promtool)"
export DEBIAN_FRONTEND=noninteractive
# Keep the package's service from starting, where an init system would start it.
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' | $sudo tee "$policy" >/dev/null
    $sudo chmod +x "$policy"
    trap '$sudo rm -f "$policy"' EXIT
fi
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null
command -v prometheus >/dev/null && command -v promtool >/dev/null
