#!/usr/bin/env bash
# The Debian packages the real node and the image builds need (e2e/node.py, e2e/images.py):
# containerd, runc and the CNI plugins run the pods; debootstrap and buildah build the
# images; gcc builds the pause binary; chromium-headless-shell takes the tests' screenshots
# of a real TensorBoard (e2e/screenshot.py); qemu-user emulates a CPU without AVX-512 for
# tests/trainer/test_cpu_isa.py (vLLM's AVX2 kernels). Installs the missing ones with apt (as root).
set -euo pipefail
packages=(containerd runc containernetworking-plugins debootstrap buildah iptables iproute2 gcc chromium-headless-shell qemu-user)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "[host-packages] all installed: ${packages[*]}" >&2
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "[host-packages] missing: ${missing[*]}; install them as root:" >&2
  echo "  apt-get install -y --no-install-recommends ${missing[*]}" >&2
  exit 1
fi
echo "[host-packages] installing: ${missing[*]}" >&2
apt-get update -q >/dev/null
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >/dev/null
