#!/usr/bin/env bash
# dev_cluster.sh [start|stop|status] -- a real Slurm cluster on this machine, for development and CI: munged,
# MariaDB + slurmdbd (real job accounting: `sacct` reports true job states), slurmctld and a slurmd per node, all from
# Debian's packages, run as root without systemd. Idempotent: "start" on a healthy cluster only checks it.
#
#   HYBRIDFLOW_SLURM_DIR   state, spool and logs   (default /var/lib/hybridflow-slurm: kept, like the accounting
#                          database in /var/lib/mysql, so job ids keep counting up across restarts)
#   HYBRIDFLOW_SLURM_CPUS  CPUs the node advertises (default 8; more than the machine has is allowed, so several
#                          worker groups fit at once on a small machine: tasks then share cores)
#   HYBRIDFLOW_SLURM_NODES      compute nodes of partition "multi" besides this host (default 3; 0: none)
#   HYBRIDFLOW_SLURM_NODE_CPUS  CPUs each of them advertises (default 2)
#
# Needs root and Debian (apt-get installs the packages when they are missing). Cluster "hybridflow": a node named
# after this host, in two partitions: "debug" (the default) and "urgent", whose jobs preempt debug's as a shared
# cluster's higher-priority partition does (preempt/partition_prio: a debug job is sent SIGTERM, then cancelled
# GraceTime=20 s later); and partition "multi" of HYBRIDFLOW_SLURM_NODES nodes hf-node1, hf-node2, ... for runs
# across nodes, with this host as the controller's host (a login node). Each is a slurmd of its own in a UTS
# namespace of its own (its hostname is the node's name, in its jobs too), with an address of its own in the loopback
# range (hf-nodeK: 127.0.1.K, in /etc/hosts) and a port of its own (6830 + K; slurmctld has 6817, slurmdbd 6819); the
# file system is shared, as a real cluster's home is, but for one folder, $HYBRIDFLOW_SLURM_DIR/login-only: this
# host's own, where every node of "multi" sees an empty file system of its own (a tmpfs in a mount namespace of its
# own), as a cluster's nodes do not see a login node's local disk. No other address is used. It writes /etc/slurm/slurm.conf and
# slurmdbd.conf, and refuses to replace ones it did not write (a real cluster's).
set -euo pipefail
DIR=${HYBRIDFLOW_SLURM_DIR:-/var/lib/hybridflow-slurm}
CPUS=${HYBRIDFLOW_SLURM_CPUS:-8}
NODES=${HYBRIDFLOW_SLURM_NODES:-3}
NODE_CPUS=${HYBRIDFLOW_SLURM_NODE_CPUS:-2}
CMD=${1:-start}
NODE=$(hostname -s)
CONF_DIR=/etc/slurm
DB_PASS_FILE=$DIR/dbpass
MARKER="# written by hybridflow hybridflow/slurm/dev_cluster.sh"
OLD_MARKERS=("# written by hybridflow runtime/dev_cluster.sh" "# written by hybridflow slurm/dev_cluster.sh")  # its earlier paths

# running PIDFILE: its process is alive. A killed daemon stays a zombie until it is reaped, and kill -0 succeeds on a
# zombie: its state (the field after the name in /proc/PID/stat) tells them apart.
running() {
  [ -s "$1" ] || return 1
  local stat; stat=$(cat "/proc/$(cat "$1")/stat" 2>/dev/null) || return 1
  stat=${stat##*) }
  [ "${stat%% *}" != Z ]
}

# detach LOG COMMAND...: start a daemon in a session of its own, from /, holding none of this script's descriptors:
# stdin from /dev/null, stdout and stderr to LOG, every other inherited descriptor closed. A caller that reads this
# script's output through pipes (subprocess.run(capture_output=True), CI logs) then sees EOF as soon as the script
# ends, whatever it left running. `setsid -f` forks, so no shell of ours stays behind waiting on the daemon.
detach() {
  local log=$1; shift
  (
    cd /
    for fd in /proc/$BASHPID/fd/*; do
      fd=${fd##*/}
      if [ "$fd" -gt 2 ] && [ "$fd" != 255 ]; then eval "exec $fd>&-"; fi
    done 2>/dev/null
    exec setsid -f "$@" </dev/null >>"$log" 2>&1
  )
}

stop_pidfile() {  # stop_pidfile FILE: TERM the process, wait up to 10 s
  if running "$1"; then
    local pid; pid=$(cat "$1"); kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
}

multi_nodes() { local k; for k in $(seq "$NODES"); do echo "hf-node$k"; done; }

stop_slurm() {  # every node's slurmd (slurmd.pid: the file of this script's one-node versions), then the controller
  local f
  for f in "$DIR"/slurmd*.pid; do [ -e "$f" ] && stop_pidfile "$f"; done
  stop_pidfile "$DIR/slurmctld.pid"; stop_pidfile "$DIR/slurmdbd.pid"
}

case "$CMD" in
  stop)
    stop_slurm
    if [ -f "$DIR/started-mariadb" ]; then stop_pidfile /run/mysqld/mysqld.pid; rm -f "$DIR/started-mariadb"; fi
    if [ -f "$DIR/started-munged" ]; then stop_pidfile /run/munge/munged.pid; rm -f "$DIR/started-munged"; fi
    echo "slurm stopped"; exit 0 ;;
  status) sinfo -N -o '%N %T %c %m %E'; squeue; exit 0 ;;
  start) ;;
  *) echo "usage: $0 [start|stop|status]" >&2; exit 2 ;;
esac

if [ "$(id -u)" != 0 ]; then
  echo "error: starting the development Slurm cluster needs root (it installs packages and runs the daemons)" >&2
  exit 1
fi

# 1. Debian packages, only when missing.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null || ! command -v slurmdbd >/dev/null \
   || ! command -v munged >/dev/null || ! command -v mariadbd >/dev/null; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends \
    slurmctld slurmd slurmdbd slurm-client munge mariadb-server >/dev/null
fi
mkdir -p "$DIR/state" "$DIR/spool" "$DIR/log" "$DIR/login-only" "$CONF_DIR"

# 2. The nodes' names must resolve (slurmd, gloo and the worker groups' controller address use them).
for name in "$NODE" "$(hostname)"; do
  getent hosts "$name" >/dev/null || echo "127.0.0.1 $name" >> /etc/hosts
done
for k in $(seq "$NODES"); do
  grep -qE "^127\.0\.1\.$k[[:space:]]+hf-node$k\$" /etc/hosts || echo "127.0.1.$k hf-node$k" >> /etc/hosts
  mkdir -p "$DIR/spool/hf-node$k"
done
mkdir -p "$DIR/spool/$NODE"

# 3. munge: authentication between the daemons and the commands.
if [ ! -s /etc/munge/munge.key ]; then
  install -d -o munge -g munge -m 0700 /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  detach "$DIR/log/munged.log" runuser -u munge -- /usr/sbin/munged
  touch "$DIR/started-munged"
  for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
  munge -n | unmunge >/dev/null
fi

# 4. MariaDB for slurmdbd (Debian's package has initialised /var/lib/mysql; root logs in over the unix socket).
install -d -o mysql -g mysql /run/mysqld
if ! mysqladmin ping >/dev/null 2>&1; then
  detach "$DIR/log/mariadb.log" /usr/sbin/mariadbd --user=mysql --bind-address=127.0.0.1 \
    --socket=/run/mysqld/mysqld.sock --pid-file=/run/mysqld/mysqld.pid
  touch "$DIR/started-mariadb"
  for _ in $(seq 150); do mysqladmin ping >/dev/null 2>&1 && break; sleep 0.2; done
  mysqladmin ping >/dev/null || { echo "MariaDB did not start; see $DIR/log/mariadb.log" >&2; exit 1; }
fi
[ -s "$DB_PASS_FILE" ] || (umask 077 && head -c 18 /dev/urandom | base64 | tr -dc 'A-Za-z0-9' > "$DB_PASS_FILE")
DB_PASS=$(cat "$DB_PASS_FILE")
mysql <<EOF
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';
EOF

# 5. Configuration. A change restarts the daemons.
MEM=$(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | head -1)
MEM=$(( MEM * 9 / 10 ))
DBD_CONF=$(cat <<EOF
$MARKER
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=$DIR/slurmdbd.pid
LogFile=$DIR/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
)
SLURM_CONF=$(cat <<EOF
$MARKER
ClusterName=hybridflow
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
MinJobAge=300
KillWait=2
InactiveLimit=0
Waittime=0
PreemptType=preempt/partition_prio
PreemptMode=CANCEL
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=1 GraceTime=20
PartitionName=urgent Nodes=$NODE MaxTime=INFINITE State=UP OverSubscribe=NO PriorityTier=2 PreemptMode=OFF
EOF
)
if [ "$NODES" -gt 0 ]; then
  for k in $(seq "$NODES"); do
    SLURM_CONF+=$'\n'"NodeName=hf-node$k NodeAddr=127.0.1.$k Port=$(( 6830 + k )) CPUs=$NODE_CPUS"
    SLURM_CONF+=" RealMemory=$MEM State=UNKNOWN"
  done
  SLURM_CONF+=$'\n'"PartitionName=multi Nodes=hf-node[1-$NODES] MaxTime=INFINITE State=UP OverSubscribe=NO"
fi
for f in "$CONF_DIR/slurm.conf" "$CONF_DIR/slurmdbd.conf"; do
  if [ -s "$f" ] && [ "$(head -n 1 "$f")" != "$MARKER" ] && [ "$(head -n 1 "$f")" != "${OLD_MARKERS[0]}" ] \
    && [ "$(head -n 1 "$f")" != "${OLD_MARKERS[1]}" ]; then
    echo "error: $f exists and was not written by this script (a real cluster's?); not replacing it" >&2
    exit 1
  fi
done
changed=0
if [ ! -f "$CONF_DIR/slurmdbd.conf" ] || [ "$(cat "$CONF_DIR/slurmdbd.conf")" != "$DBD_CONF" ]; then
  (umask 077 && printf '%s\n' "$DBD_CONF" > "$CONF_DIR/slurmdbd.conf"); changed=1
fi
chmod 0600 "$CONF_DIR/slurmdbd.conf"
if [ ! -f "$CONF_DIR/slurm.conf" ] || [ "$(cat "$CONF_DIR/slurm.conf")" != "$SLURM_CONF" ]; then
  printf '%s\n' "$SLURM_CONF" > "$CONF_DIR/slurm.conf"; changed=1
fi
[ "$changed" = 0 ] || stop_slurm

# 6. Daemons: slurmdbd, the cluster in the accounting database, slurmctld, slurmd.
if ! running "$DIR/slurmdbd.pid"; then
  detach "$DIR/log/slurmdbd.out" slurmdbd
fi
for _ in $(seq 100); do sacctmgr -n list cluster >/dev/null 2>&1 && break; sleep 0.2; done
if ! sacctmgr -n list cluster >/dev/null 2>&1; then
  echo "slurmdbd does not answer; logs in $DIR/log" >&2
  tail -n 20 "$DIR/log/slurmdbd.log" "$DIR/log/mariadb.log" >&2 || true
  exit 1
fi
if ! sacctmgr -n -P list cluster format=cluster 2>/dev/null | grep -qx hybridflow; then
  sacctmgr -i add cluster hybridflow >/dev/null
fi
running "$DIR/slurmctld.pid" || detach "$DIR/log/slurmctld.out" slurmctld
running "$DIR/slurmd-$NODE.pid" || detach "$DIR/log/slurmd-$NODE.out" slurmd
for name in $(multi_nodes); do  # its hostname, in a UTS namespace of its own, is the node's name; login-only: empty
  running "$DIR/slurmd-$name.pid" || detach "$DIR/log/slurmd-$name.out" unshare --uts --mount -- sh -c \
    "hostname $name && mount -t tmpfs -o size=1m,mode=0755 hybridflow-login-only $DIR/login-only && exec slurmd"
done

# 7. Wait for the nodes; undo a DRAIN/DOWN left in the saved state by an earlier run (or a failure test).
for name in "$NODE" $(multi_nodes); do
  st=""
  for _ in $(seq 150); do
    st=$(sinfo -h -n "$name" -o %T 2>/dev/null | head -n 1 || true)
    case "$st" in
      idle|mixed|allocated) break ;;
      drain*|down*|inval*|fail*) scontrol update NodeName="$name" State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.2
  done
  case "$st" in idle|mixed|allocated) ;; *)
    echo "slurm node $name not ready (state '$st'); logs in $DIR/log" >&2
    tail -n 20 "$DIR/log/slurmdbd.log" "$DIR/log/slurmctld.log" "$DIR/log/slurmd-$name.log" >&2 || true
    exit 1 ;;
  esac
done
echo "slurm up: cluster hybridflow, node $NODE ($CPUS CPUs) and partition multi of $NODES nodes ($NODE_CPUS CPUs" \
  "each), accounting by slurmdbd; logs in $DIR/log"
