#!/usr/bin/env bash
# Installs the Debian packages the test suites need, once. Quiet when everything is present.
set -euo pipefail

# command-to-check  debian-package
NEEDED=(
  "flock util-linux"
  "unshare util-linux"
  "ip iproute2"
  "promtool prometheus"
  # tests/python/test_slurm.py: a real Slurm 22.05 (slurmctld + one slurmd per node) and munge.
  "slurmctld slurm-wlm"
  "munged munge"
)

missing=()
for pair in "${NEEDED[@]}"; do
  cmd=${pair%% *}
  pkg=${pair#* }
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "system-deps: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >&2
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >&2
fi
