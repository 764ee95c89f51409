#!/usr/bin/env bash
# The e2e suite runs Debian's prometheus and promtool binaries (package `prometheus`). Install the
# package when either is missing. Only the binaries are used: the tests start prometheus themselves
# with a temporary config and data folder on a loopback port, never the packaged service.
set -euo pipefail
if command -v prometheus >/dev/null && command -v promtool >/dev/null; then
    exit 0
fi
echo "installing Debian's prometheus package (prometheus, promtool)"
"$(dirname "$0")/../apt-install.sh" prometheus
command -v prometheus >/dev/null && command -v promtool >/dev/null
