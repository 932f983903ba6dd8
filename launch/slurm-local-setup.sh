#!/usr/bin/env bash
# A single-node Slurm cluster on this machine, for testing launch/slurm.sh.
#
#   sudo launch/slurm-local-setup.sh               install (Debian/Ubuntu), configure, start, wait
#   launch/slurm-local-setup.sh --no-install       configure and start only; never calls apt-get
#
# Installs Debian's packages (slurmctld, slurmd, slurm-client, munge) when
# `sbatch` is missing, writes a minimal cgroup-free /etc/slurm/slurm.conf
# (one node: this host, all its CPUs), starts munged, slurmctld and slurmd
# directly (containers and CI machines often run no init system), and waits
# until the node accepts jobs. Idempotent: rerunning it with Slurm already up
# returns in a second. A slurm.conf that this script did not write (a real
# cluster) is never touched; the script then only checks that Slurm answers.
#
# Environment (defaults in brackets):
#   SLURM_CONF_FILE [/etc/slurm/slurm.conf]
#   SLURM_WAIT_S [60]      how long to wait for the node to become idle
#
# Exit status: 0 when `sbatch` can run jobs here, 1 otherwise (with the reason
# on stderr). .ci/run calls it before `make test`; tests/test_slurm.py calls it
# with --no-install and skips, quoting the reason, when it fails.
set -euo pipefail

CONF=${SLURM_CONF_FILE:-/etc/slurm/slurm.conf}
WAIT_S=${SLURM_WAIT_S:-60}
MARK="# Written by rlt-scale launch/slurm-local-setup.sh"
INSTALL=1
[[ "${1:-}" == "--no-install" ]] && INSTALL=0

say() { echo "slurm-local-setup: $*" >&2; }
die() { say "$*"; exit 1; }

# The node must be idle (or already running a job), not down or drained.
node_ready() {
  local state
  state=$(sinfo --noheader --node="$(hostname -s)" --format=%T 2>/dev/null | head -1) || return 1
  [[ "$state" =~ ^(idle|mixed|allocated|completing)$ ]]
}

# This host's CPUs. Not plain `nproc`: GNU nproc reports OMP_NUM_THREADS when it is set, and a shell set up
# for training (OMP_NUM_THREADS=1) once wrote a one-CPU node, on which every job asking for two CPUs pends
# forever (Reason=PartitionConfig).
CPUS=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)

# Up, and (when the slurm.conf is ours) with this host's CPU count: nothing to do.
our_conf_is_current() {
  ! grep -qF "$MARK" "$CONF" 2>/dev/null \
    || [[ "$(sinfo --noheader --node="$(hostname -s)" --format=%c 2>/dev/null | head -1)" == "$CPUS" ]]
}
if command -v sbatch >/dev/null && scontrol ping 2>/dev/null | grep -q UP && node_ready && our_conf_is_current; then
  say "Slurm is up ($(sinfo --version))"
  exit 0
fi

# ---------------------------------------------------------------- install
if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  [[ $INSTALL == 1 ]] || die "Slurm is not installed (sbatch/slurmctld/munged missing); run: sudo launch/slurm-local-setup.sh"
  [[ $(id -u) == 0 ]] || die "installing Slurm needs root; run: sudo launch/slurm-local-setup.sh"
  command -v apt-get >/dev/null || die "no apt-get: install slurmctld, slurmd, slurm-client and munge by hand"
  packages=(slurmctld slurmd slurm-client munge)
  export DEBIAN_FRONTEND=noninteractive
  # A fresh image may have no package lists yet; update only when needed.
  if ! apt-get install -y -qq --no-install-recommends "${packages[@]}" >/tmp/slurm-apt.log 2>&1; then
    apt-get update -qq >>/tmp/slurm-apt.log 2>&1 || true
    apt-get install -y -qq --no-install-recommends "${packages[@]}" >>/tmp/slurm-apt.log 2>&1 \
      || { tail -20 /tmp/slurm-apt.log >&2; die "apt-get install failed (log: /tmp/slurm-apt.log)"; }
  fi
  say "installed $(slurmd -V)"
fi

# ---------------------------------------------------------------- configure
if [[ -f "$CONF" ]] && ! grep -qF "$MARK" "$CONF"; then
  # Someone else's cluster: only report on it.
  scontrol ping 2>/dev/null | grep -q UP || die "$CONF exists (not written by this script) but slurmctld does not answer"
  node_ready || die "slurmctld answers, but this host ($(hostname -s)) is not an idle node of that cluster," \
                    "and tests/test_slurm.py runs its jobs here: $(sinfo --noheader --format='%N %T %E' 2>&1 | head -3)"
  exit 0
fi
[[ $(id -u) == 0 ]] || die "configuring and starting Slurm needs root; run: sudo launch/slurm-local-setup.sh"

HOST=$(hostname -s)
# Everything runs as root: slurmd must anyway, and a throwaway test cluster
# gains nothing from a separate SlurmUser. No cgroups: proctrack/linuxproc
# finds a job's processes through /proc, which works in containers too.
desired=$(cat <<EOF
$MARK: a single-node test cluster.
ClusterName=rlt-local
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# Preempted or cancelled jobs get KillWait seconds between SIGTERM and SIGKILL
# to write their checkpoint.
KillWait=60
MinJobAge=600
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
changed=0
if [[ ! -f "$CONF" ]] || [[ "$(cat "$CONF")" != "$desired" ]]; then
  mkdir -p "$(dirname "$CONF")"
  printf '%s\n' "$desired" >"$CONF"
  changed=1
fi
mkdir -p /var/spool/slurmctld /var/spool/slurmd /var/log/slurm

# ---------------------------------------------------------------- start
# Daemons are found through their pid files, never by name: other Slurm or
# munge processes on the machine are not ours to touch.
alive() { [[ -s "$1" ]] && kill -0 "$(cat "$1")" 2>/dev/null; }
stop() {
  if alive "$1"; then
    kill "$(cat "$1")"
    for _ in $(seq 40); do alive "$1" || return 0; sleep 0.25; done
  fi
}

if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [[ -f /etc/munge/munge.key ]] || mungekey --create 2>/dev/null || create-munge-key -f
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  alive /run/munge/munged.pid || runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.25; done
  munge -n | unmunge >/dev/null || die "munged does not work (see /var/log/munge/munged.log)"
fi

# The daemons read slurm.conf when they start: a changed one needs a restart.
if [[ $changed == 1 ]]; then
  stop /run/slurmd.pid
  stop /run/slurmctld.pid
fi
alive /run/slurmctld.pid || slurmctld
alive /run/slurmd.pid || slurmd

deadline=$((SECONDS + WAIT_S))
until scontrol ping 2>/dev/null | grep -q UP; do
  (( SECONDS < deadline )) || die "slurmctld did not answer within ${WAIT_S}s (see /var/log/slurm/slurmctld.log)"
  sleep 0.5
done
until node_ready; do
  # After a restart the node may come back DOWN ("unexpectedly rebooted");
  # on a single-node test cluster it is safe to return it to service.
  if sinfo --noheader --node="$HOST" --format=%T 2>/dev/null | grep -qE '^(down|drain)'; then
    scontrol update nodename="$HOST" state=resume 2>/dev/null || true
  fi
  (( SECONDS < deadline )) || die "node $HOST is not idle after ${WAIT_S}s: $(sinfo --noheader --format='%T %E' 2>&1) (see /var/log/slurm/slurmd.log)"
  sleep 0.5
done
say "Slurm is up ($(sinfo --version)): $(sinfo --noheader --format='%P %D %T %c CPUs')"
