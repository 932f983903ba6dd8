#!/usr/bin/env bash
# A two-node (or N-node) Slurm cluster on this machine, out of Linux network
# namespaces, for testing launch/slurm.sh across hosts that each have their
# own address, their own slurmd, and processes that can die or be cut off
# separately (tests/test_cluster.py).
#
#   sudo launch/cluster-local-setup.sh               install if needed, build, start, wait
#   launch/cluster-local-setup.sh --no-install       build and start only; never calls apt-get
#   launch/cluster-local-setup.sh --teardown         stop the daemons, delete namespaces, bridge and state
#   launch/cluster-local-setup.sh --status           print the nodes' state; exit 1 if the cluster is not up
#
# What it builds (defaults; see Environment):
#   * a bridge rltbr0 with the address 10.199.42.1/24: a private subnet that
#     exists only inside this machine. Nothing is routed or forwarded to or
#     from it; the namespaces have no default route, so no packet of theirs
#     can reach any other address;
#   * network namespaces node0 .. node<N-1>, each with one veth ("eth0"
#     inside, rltv<k> on the bridge), the address 10.199.42.<10+k>, and its
#     own loopback; /etc/netns/node<k>/hosts (which `ip netns exec`
#     bind-mounts over /etc/hosts) names the nodes and the controller;
#   * one munged, shared through its unix socket (the filesystem is shared;
#     one-node Slurm of launch/slurm-local-setup.sh uses the same one);
#   * one slurmctld in this (the root) namespace, on 10.199.42.1:6917, with
#     its own slurm.conf, cluster name, ports, state, pid and log files, so it
#     coexists with the one-node cluster of launch/slurm-local-setup.sh (port
#     6817, /etc/slurm/slurm.conf);
#   * one slurmd per namespace, in its own UTS namespace whose hostname is the
#     node name (node<k>), listening on <its address>:6918. Jobs it starts
#     inherit its network, UTS and /etc/hosts: on node1 `hostname` says node1,
#     node0 resolves to 10.199.42.10, gloo binds to the node's own address.
#
# The checkout and its .venv are at the same path on every node: the
# namespaces share this machine's filesystem (only /etc/hosts and /sys differ).
#
# Clients reach this cluster through SLURM_CONF:
#   SLURM_CONF=/etc/slurm-rlt-cluster/slurm.conf sbatch --nodes=2 launch/slurm.sh configs/tiny.yaml
#
# Idempotent: a rerun with everything up returns in about a second; a rerun
# after a node's processes were killed (a dead machine) restarts its slurmd,
# and a link that was taken down (a partition) is brought back up. Daemons are
# found through their pid files, namespaces through the list this script keeps
# in /run/rlt-cluster/namespaces: nothing else on the machine is touched (a
# namespace node<k> that this script did not create is an error).
#
# Environment (defaults in brackets):
#   CLUSTER_NODES [2]                      number of nodes (namespaces)
#   CLUSTER_SUBNET [10.199.42]             first three octets of the private /24
#   CLUSTER_CONF [/etc/slurm-rlt-cluster/slurm.conf]
#   CLUSTER_CTLD_PORT [6917]  CLUSTER_SLURMD_PORT [6918]
#   CLUSTER_SLURMD_TIMEOUT [20]            seconds without an answer before slurmctld marks a node DOWN
#   CLUSTER_TCP_RETRIES2 [5]               net.ipv4.tcp_retries2 inside the nodes: TCP drops a connection
#                                          whose peer vanished after ~12 s (the kernel default, 15, takes
#                                          ~15 min, and torch's rendezvous store waits that long)
#   SLURM_WAIT_S [60]                      how long to wait for the nodes to become idle
#
# Exit status: 0 when the cluster accepts jobs on all nodes (or, with
# --teardown, when nothing of it is left), 1 otherwise with the reason on
# stderr. Needs root. .ci/run calls it before `make test`; tests/test_cluster.py
# calls it with --no-install and skips, quoting the reason, when it fails.
set -euo pipefail

NODES=${CLUSTER_NODES:-2}
SUBNET=${CLUSTER_SUBNET:-10.199.42}
CONF=${CLUSTER_CONF:-/etc/slurm-rlt-cluster/slurm.conf}
CTLD_PORT=${CLUSTER_CTLD_PORT:-6917}
SLURMD_PORT=${CLUSTER_SLURMD_PORT:-6918}
SLURMD_TIMEOUT=${CLUSTER_SLURMD_TIMEOUT:-20}
TCP_RETRIES2=${CLUSTER_TCP_RETRIES2:-5}
WAIT_S=${SLURM_WAIT_S:-60}
BRIDGE=rltbr0
RUN=/run/rlt-cluster
STATE=/var/spool/rlt-cluster
LOGS=/var/log/slurm
NSLIST=$RUN/namespaces
MARK="# Written by rlt-scale launch/cluster-local-setup.sh"

MODE=up INSTALL=1
for arg in "$@"; do
  case $arg in
    --no-install) INSTALL=0 ;;
    --teardown) MODE=down ;;
    --status) MODE=status ;;
    *) echo "usage: $0 [--no-install | --teardown | --status]" >&2; exit 2 ;;
  esac
done

say() { echo "cluster-local-setup: $*" >&2; }
die() { say "$*"; exit 1; }
export SLURM_CONF=$CONF

alive() { local pid; pid=$(cat "$1" 2>/dev/null) && [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; }
stop_pidfile() {
  local pid
  pid=$(cat "$1" 2>/dev/null) || true
  if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null; then
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$1"
}
ours() { [[ -f $NSLIST ]] && grep -qx "$1" "$NSLIST"; }
node_states() { sinfo --noheader --Node --format='%N %T' 2>/dev/null | sort -u; }
cluster_ready() {
  scontrol ping 2>/dev/null | grep -q UP || return 1
  local states ready=0
  states=$(node_states) || return 1
  for ((k = 0; k < NODES; k++)); do
    grep -qE "^node$k (idle|mixed|allocated|completing)$" <<<"$states" && ready=$((ready + 1))
  done
  (( ready == NODES ))
}

# ---------------------------------------------------------------- teardown
if [[ $MODE == down ]]; then
  [[ $(id -u) == 0 ]] || die "tearing down needs root"
  stop_pidfile $RUN/slurmctld.pid
  namespaces=()
  [[ -f $NSLIST ]] && mapfile -t namespaces <"$NSLIST"
  for ns in "${namespaces[@]}"; do
    stop_pidfile "$RUN/slurmd-$ns.pid"
    if ip netns list | grep -qw "^$ns"; then
      # Whatever still runs in the node (job steps, agents, workers) is ours: it was started there.
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      [[ -n $pids ]] && kill -9 $pids 2>/dev/null || true
      ip netns del "$ns"
    fi
    rm -rf "/etc/netns/$ns"
  done
  rmdir /etc/netns 2>/dev/null || true  # only if empty
  ip link show $BRIDGE >/dev/null 2>&1 && ip link del $BRIDGE
  rm -rf "$RUN" "$STATE"
  # Only the files this script wrote; their directory only if nothing else is left in it.
  if [[ -f "$CONF" ]] && grep -qF "$MARK" "$CONF"; then
    rm -f "$CONF"
    plug="$(dirname "$CONF")/plugstack.conf"
    [[ -f "$plug" && ! -s "$plug" ]] && rm -f "$plug"
    rmdir "$(dirname "$CONF")" 2>/dev/null || true
  fi
  if [[ -f $RUN.munged-started ]]; then
    # munged was started by this script; stop it unless the one-node cluster is using it.
    if ! alive /run/slurmctld.pid && ! alive /run/slurmd.pid; then stop_pidfile /run/munge/munged.pid; fi
    rm -f $RUN.munged-started
  fi
  say "torn down"
  exit 0
fi

if [[ $MODE == status ]]; then
  command -v sinfo >/dev/null || die "Slurm is not installed"
  [[ -f "$CONF" ]] || die "no $CONF: the cluster is not built"  # (sinfo would retry for 60 s)
  scontrol ping 2>/dev/null | grep -q UP || die "slurmctld ($CONF) does not answer"
  node_states
  cluster_ready
  exit
fi

[[ $(id -u) == 0 ]] || die "building the cluster needs root (network namespaces, daemons); run: sudo $0"
command -v ip >/dev/null || die "no ip (iproute2): cannot create network namespaces"

# ---------------------------------------------------------------- slurm.conf (written below)
HOST=$(hostname -s)
# Not nproc: it honours OMP_NUM_THREADS, and the conf must not change with the caller's environment.
CPUS=$(getconf _NPROCESSORS_ONLN)
nodelines=""
for ((k = 0; k < NODES; k++)); do
  nodelines+="NodeName=node$k NodeHostname=node$k NodeAddr=$SUBNET.$((10 + k)) CPUs=$CPUS State=UNKNOWN"$'\n'
done
desired=$(cat <<EOF
$MARK: a $NODES-node test cluster of network namespaces.
ClusterName=rlt-netns
SlurmctldHost=$HOST($SUBNET.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
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
SlurmdTimeout=$SLURMD_TIMEOUT
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/%n
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd-%n.pid
SlurmctldLogFile=$LOGS/rlt-cluster-slurmctld.log
SlurmdLogFile=$LOGS/rlt-cluster-slurmd-%n.log
# Preempted, requeued or cancelled jobs get KillWait seconds between SIGTERM and SIGKILL to checkpoint.
KillWait=60
MinJobAge=600
JobRequeue=1
${nodelines}PartitionName=nodes Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
)
# ---------------------------------------------------------------- fast path
all_up() {
  command -v sbatch >/dev/null || return 1
  [[ -f "$CONF" && "$(cat "$CONF")" == "$desired" ]] || return 1
  alive $RUN/slurmctld.pid || return 1
  for ((k = 0; k < NODES; k++)); do
    alive "$RUN/slurmd-node$k.pid" || return 1
    [[ "$(ip netns exec "node$k" sysctl -n net.ipv4.tcp_retries2 2>/dev/null)" == "$TCP_RETRIES2" ]] || return 1
    [[ "$(ip -n "node$k" -brief link show eth0 2>/dev/null | awk '{print $2}')" == UP ]] || return 1
    [[ "$(ip -brief link show "rltv$k" 2>/dev/null | awk '{print $2}')" == UP ]] || return 1
  done
  cluster_ready
}
if all_up; then
  say "cluster is up: $(node_states | tr '\n' ' ')"
  exit 0
fi

if [[ -f "$CONF" ]] && ! grep -qF "$MARK" "$CONF"; then
  die "$CONF exists and was not written by this script; set CLUSTER_CONF to another path"
fi

# ---------------------------------------------------------------- install
if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
   || ! command -v munged >/dev/null; then
  [[ $INSTALL == 1 ]] || die "Slurm is not installed (sbatch/slurmctld/slurmd/munged missing); run: sudo $0"
  command -v apt-get >/dev/null || die "no apt-get: install slurmctld, slurmd, slurm-client and munge by hand"
  packages=(slurmctld slurmd slurm-client munge)
  export DEBIAN_FRONTEND=noninteractive
  if ! apt-get install -y -qq --no-install-recommends "${packages[@]}" >/tmp/slurm-apt.log 2>&1; then
    apt-get update -qq >>/tmp/slurm-apt.log 2>&1 || true
    apt-get install -y -qq --no-install-recommends "${packages[@]}" >>/tmp/slurm-apt.log 2>&1 \
      || { tail -20 /tmp/slurm-apt.log >&2; die "apt-get install failed (log: /tmp/slurm-apt.log)"; }
  fi
  say "installed $(slurmd -V)"
fi

# ---------------------------------------------------------------- network
mkdir -p $RUN $STATE $LOGS
touch $NSLIST
if ! ip link show $BRIDGE >/dev/null 2>&1; then
  ip link add $BRIDGE type bridge stp_state 0 || die "cannot create bridge $BRIDGE"
fi
# IPv4 only: no router solicitations or other IPv6 chatter on the bridge.
sysctl -qw "net.ipv6.conf.$BRIDGE.disable_ipv6=1" 2>/dev/null || true
ip addr show dev $BRIDGE | grep -q "inet $SUBNET.1/24" || ip addr add "$SUBNET.1/24" dev $BRIDGE
ip link set $BRIDGE up

hosts="127.0.0.1 localhost
$SUBNET.1 $(hostname -s) rlt-ctl"
for ((k = 0; k < NODES; k++)); do hosts+=$'\n'"$SUBNET.$((10 + k)) node$k"; done

for ((k = 0; k < NODES; k++)); do
  ns=node$k
  if ip netns list | grep -qw "^$ns"; then
    ours "$ns" || die "a network namespace $ns exists that this script did not create; remove it or tear it down first"
  else
    ip netns add "$ns" || die "cannot create network namespace $ns (ip netns needs root and a kernel with netns)"
    echo "$ns" >>$NSLIST
  fi
  if ! ip -n "$ns" link show eth0 >/dev/null 2>&1; then
    ip link del "rltv$k" 2>/dev/null || true
    ip link add "rltv$k" type veth peer name eth0 netns "$ns"
  fi
  sysctl -qw "net.ipv6.conf.rltv$k.disable_ipv6=1" 2>/dev/null || true
  ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 2>/dev/null || true
  # TCP gives up on an unacknowledged connection after ~12 s instead of ~15 min (tcp_retries2 15):
  # a node cut off from the rendezvous store otherwise hangs in torch's TCPStore (see docs/LAUNCH.md).
  ip netns exec "$ns" sysctl -qw "net.ipv4.tcp_retries2=$TCP_RETRIES2"
  ip link set "rltv$k" master $BRIDGE
  ip link set "rltv$k" up
  ip -n "$ns" addr show dev eth0 | grep -q "inet $SUBNET.$((10 + k))/24" \
    || ip -n "$ns" addr add "$SUBNET.$((10 + k))/24" dev eth0
  ip -n "$ns" link set lo up
  ip -n "$ns" link set eth0 up
  ip -n "$ns" neigh flush all 2>/dev/null || true  # forget neighbours that failed during a partition
  mkdir -p "/etc/netns/$ns"
  printf '%s\n' "$hosts" >"/etc/netns/$ns/hosts"
done
# ---------------------------------------------------------------- slurm.conf
changed=0
if [[ ! -f "$CONF" ]] || [[ "$(cat "$CONF")" != "$desired" ]]; then
  mkdir -p "$(dirname "$CONF")"
  printf '%s\n' "$desired" >"$CONF"
  changed=1
fi
# slurmctld looks for plugstack.conf next to slurm.conf
[[ -f "$(dirname "$CONF")/plugstack.conf" ]] || : >"$(dirname "$CONF")/plugstack.conf"
mkdir -p "$STATE/ctld"
for ((k = 0; k < NODES; k++)); do mkdir -p "$STATE/node$k"; done

# ---------------------------------------------------------------- daemons
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  [[ -f /etc/munge/munge.key ]] || mungekey --create 2>/dev/null || create-munge-key -f
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge /var/log/munge /var/lib/munge && chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if ! alive /run/munge/munged.pid; then runuser -u munge -- /usr/sbin/munged && touch $RUN.munged-started; fi
  for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.25; done
  munge -n | unmunge >/dev/null || die "munged does not work (see /var/log/munge/munged.log)"
fi

if [[ $changed == 1 ]]; then
  for ((k = 0; k < NODES; k++)); do stop_pidfile "$RUN/slurmd-node$k.pid"; done
  stop_pidfile $RUN/slurmctld.pid
fi
alive $RUN/slurmctld.pid || slurmctld -f "$CONF" || die "slurmctld did not start (see $LOGS/rlt-cluster-slurmctld.log)"
for ((k = 0; k < NODES; k++)); do
  if ! alive "$RUN/slurmd-node$k.pid"; then
    # A node killed as a whole leaves its pid file and step sockets behind.
    rm -f "$RUN/slurmd-node$k.pid"
    # Not `ip netns exec`: it remounts /sys, hiding the cgroup mounts that slurmd
    # initialises even with proctrack/linuxproc. Its own /etc/hosts and hostname instead.
    nsenter --net="/run/netns/node$k" unshare --mount --uts --propagation private sh -c \
      "mount --bind /etc/netns/node$k/hosts /etc/hosts && hostname node$k && exec slurmd -f '$CONF' -N node$k" \
      || die "slurmd on node$k did not start (see $LOGS/rlt-cluster-slurmd-node$k.log)"
  fi
done

deadline=$((SECONDS + WAIT_S))
until scontrol ping 2>/dev/null | grep -q UP; do
  (( SECONDS < deadline )) || die "slurmctld did not answer within ${WAIT_S}s (see $LOGS/rlt-cluster-slurmctld.log)"
  sleep 0.5
done
# Every node must reach the controller over the bridge (a TCP connect; no ping needed).
# After a partition the node's ARP entry for the controller may still be FAILED: retry for a while.
for ((k = 0; k < NODES; k++)); do
  for try in $(seq 20); do
    ip netns exec "node$k" timeout 3 bash -c "</dev/tcp/$SUBNET.1/$CTLD_PORT" 2>/dev/null && break
    (( try < 20 )) || die "node$k cannot reach slurmctld at $SUBNET.1:$CTLD_PORT over $BRIDGE (bridge netfilter or firewall?)"
    sleep 0.5
  done
done
until cluster_ready; do
  # A node that was killed, cut off or restarted may come back DOWN; on this
  # test cluster it is safe to return it to service once its slurmd answers.
  for ((k = 0; k < NODES; k++)); do
    if node_states | grep -qE "^node$k (down|drain)"; then
      scontrol update nodename="node$k" state=resume 2>/dev/null || true
    fi
  done
  (( SECONDS < deadline )) || die "nodes not idle after ${WAIT_S}s: $(node_states | tr '\n' ' ')" \
                                  "(see $LOGS/rlt-cluster-slurm*.log)"
  sleep 0.5
done
say "cluster is up ($(sinfo --version), SLURM_CONF=$CONF): $(node_states | tr '\n' ' ')"
