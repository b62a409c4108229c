#!/usr/bin/env bash
# Slurm for tests/slurm/: Debian's packages (slurm-wlm 22.05: slurmctld, slurmd, the client commands, munge),
# installed with apt-get. Only the programs are installed: the packages' own services are not started (and
# not configured); the slurm_cluster fixture (tests/conftest.py, tests/helpers/slurm_cluster.py) starts a private
# cluster (its own munged, slurmctld and two slurmd) with its config and state in a temp dir, and stops it when
# the tests end.
#
# A second run is a no-op: every package already installed at the wanted version -> exit 0. Needs root
# (or passwordless sudo) and Debian's package lists; elsewhere it says so and exits 1, and tests/slurm
# skip (fail under CI=true unless FLEDGE_SLURM_OPTIONAL=1).
set -euo pipefail
PACKAGES=(slurm-wlm slurmctld slurmd slurm-client munge)
VERSION=22.05  # the series the tests were written against (Debian 12's)

installed() {
  local p v
  for p in "${PACKAGES[@]}"; do
    v=$(dpkg-query -W -f='${db:Status-Status} ${Version}' "$p" 2>/dev/null) || return 1
    case "$v" in
      "installed $VERSION"*|"installed 0."*) ;;  # munge has its own version numbers
      *) return 1 ;;
    esac
  done
}

command -v dpkg-query >/dev/null && installed && exit 0
if ! command -v apt-get >/dev/null; then
  echo "setup_slurm: no apt-get here; install Slurm $VERSION (slurmctld, slurmd, sbatch, munged) yourself" >&2
  exit 1
fi
SUDO=()
if [ "$(id -u)" != 0 ]; then
  sudo -n true 2>/dev/null || { echo "setup_slurm: apt-get needs root (or passwordless sudo)" >&2; exit 1; }
  SUDO=(sudo -n)
fi
start=$(date +%s)
# Services must not start on install: the tests run their own daemons (policy-rc.d is Debian's switch for it;
# containers usually ship one already; this one is ours only while apt-get runs).
policy=/usr/sbin/policy-rc.d
ours=0
if [ ! -e "$policy" ]; then
  printf '#!/bin/sh\nexit 101\n' | "${SUDO[@]}" tee "$policy" >/dev/null
  "${SUDO[@]}" chmod 755 "$policy"
  ours=1
fi
cleanup() { if [ "$ours" = 1 ]; then "${SUDO[@]}" rm -f "$policy"; fi; }
trap cleanup EXIT
install() {
  "${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${PACKAGES[@]}"
}
# stale package lists: refresh once and retry
install >/dev/null || { "${SUDO[@]}" apt-get update -q >/dev/null && install >/dev/null; }
installed || { echo "setup_slurm: installed, but not Slurm $VERSION: $(slurmd -V 2>&1)" >&2; exit 1; }
echo "setup_slurm: installed $(slurmd -V) and munge in $(( $(date +%s) - start )) s" >&2
