#!/usr/bin/env bash
# A one-machine Slurm cluster for trying the templates: this host is both the controller
# (slurmctld) and the one compute node (slurmd), from Debian's slurm-wlm and munge.
#
#   eval "$(infra/deploy/slurm/local-cluster.sh up)"     # exports SLURM_CONF
#   infra/deploy/slurm/local-cluster.sh down
#
# Everything lives under $POLAR_SLURM_DIR (default /tmp/polar-slurm): slurm.conf, the
# daemons' state, logs and pid files, and munged's socket; nothing is written to
# /etc/slurm and no systemd unit is started. The node declares POLAR_SLURM_CPUS CPUs
# (default 8, `config_overrides`: more than this machine has, so a toy-sized services
# job plus an array of gateway jobs fit at once on two cores). Only the final `export`
# line goes to stdout.
set -euo pipefail

DIR="$(realpath -m "${POLAR_SLURM_DIR:-/tmp/polar-slurm}")"
CPUS="${POLAR_SLURM_CPUS:-8}"
HOST="$(hostname -s)"
CONF="$DIR/slurm.conf"
MUNGE_SOCKET="$DIR/munge/munge.socket"

log() { echo "slurm-local: $*" >&2; }

install_packages() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return
  log "installing slurm-wlm and munge"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >&2
}

write_config() {
  mkdir -p "$DIR"/{state,spool,log,munge}
  chown munge: "$DIR/munge"
  cat >"$CONF" <<CONF
ClusterName=polar-local
SlurmctldHost=$HOST
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
NodeName=$HOST CPUs=$CPUS RealMemory=2000 State=UNKNOWN
PartitionName=polar Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
CONF
  # slurmd reads cgroup.conf only with cgroup plugins; an empty one stops its warning
  : >"$DIR/cgroup.conf"
}

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

up() {
  install_packages
  write_config
  if ! running "$DIR/munged.pid"; then
    log "starting munged ($MUNGE_SOCKET)"
    runuser -u munge -- munged --socket="$MUNGE_SOCKET" --pid-file="$DIR/munge/munged.pid" \
      --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
    cp "$DIR/munge/munged.pid" "$DIR/munged.pid"
  fi
  export SLURM_CONF="$CONF"
  running "$DIR/slurmctld.pid" || { log "starting slurmctld"; slurmctld -f "$CONF"; }
  running "$DIR/slurmd.pid" || { log "starting slurmd"; slurmd -f "$CONF"; }
  for _ in $(seq 60); do
    if sinfo -h -o '%T' 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; then
      log "node $HOST up: $(sinfo -h -o '%P %D %T %c')"
      echo "export SLURM_CONF=$CONF"
      return
    fi
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    sleep 0.5
  done
  log "node did not come up; see $DIR/log"
  exit 1
}

down() {
  for pidfile in "$DIR/slurmd.pid" "$DIR/slurmctld.pid" "$DIR/munged.pid"; do
    if running "$pidfile"; then kill "$(cat "$pidfile")"; fi
  done
  log "stopped (state kept in $DIR)"
}

case "${1:-up}" in
  up) up ;;
  down) down ;;
  *) echo "usage: $0 up|down" >&2; exit 2 ;;
esac
