#!/usr/bin/env bash
# The cluster tier runs kube-proxy (tests/cluster/kubeproxy.py), which programs Services with the
# iptables command (or nft, where only that exists). Install Debian's `iptables` package when neither
# is there. Only the command is used: kube-proxy adds its own chains while the tier runs and removes
# them at its end; no firewall service is enabled.
set -euo pipefail
if command -v iptables >/dev/null || command -v nft >/dev/null; then
    exit 0
fi
echo "installing Debian's iptables package (for kube-proxy in the cluster tier)"
"$(dirname "$0")/../apt-install.sh" iptables
command -v iptables >/dev/null
