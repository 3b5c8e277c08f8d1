# The command of every pod of the plain-Kubernetes manifests: `sh /etc/torchps/job/torchps-task.sh CLI ARGS`
# (this file and cluster.json reach the pods in the ConfigMap torchps-job, mounted at /etc/torchps/job).
#
# 1. TF_CONFIG, the same as Kubeflow's operator would write: the cluster of cluster.json and the pod's
#    task, its type from TORCHPS_TASK_TYPE (set by its Job) and its index from JOB_COMPLETION_INDEX (set
#    by its Indexed Job; the suffix of the pod's hostname, torchps-TYPE-INDEX). A worker whose index is
#    past cluster.json's list (the workers Job scaled up: deploy/README.md) adds itself to the list under
#    its pod's DNS name; the job's shards and the other workers keep the list they started with.
# 2. Its own credentials: every pod of a type mounts the Secrets of all replicas of that type (they share
#    a pod template) at /etc/torchps/TYPE-INDEX; the TORCHPS_* variables name this task's files to
#    ps-server and ps-worker (the admin token is in the chief's and the shards' Secrets only).
# 3. With TORCHPS_REPLICA=backup (overlays/replicas), a shard's backup: `--replica-of` the shard's address
#    (cluster.json's) and `--bind` its own, this pod's DNS name (backups.json's entry of its index). A shard
#    of a job with backups (backups.json beside this file) gets `--replicated`: started again, on a new disk
#    too, it asks its arbiter who serves it before serving.
# 4. exec the command: it gets the pod's signals, and its exit code is the container's.
set -eu
: "${TORCHPS_TASK_TYPE:?set by the Job}" "${JOB_COMPLETION_INDEX:?set by an Indexed Job}"
TF_CONFIG=$(python -c '
import json, os, re, sys
with open(sys.argv[1]) as f:
    cluster = json.load(f)
task = {"type": os.environ["TORCHPS_TASK_TYPE"], "index": int(os.environ["JOB_COMPLETION_INDEX"])}
listed, used = cluster.setdefault(task["type"], []), {a for v in cluster.values() for a in v}
while task["type"] == "worker" and listed and len(listed) <= task["index"]:  # the workers Job scaled up
    named = re.sub(r"-\d+\.", f"-{len(listed)}.", listed[-1], count=1)  # JOB-N.SUBDOMAIN:PORT, the pod DNS name
    host, _, port = listed[-1].rpartition(":")
    free = (f"{host}:{p}" for p in range(int(port) + 1, 65536) if f"{host}:{p}" not in used)
    listed.append(named if named not in used else next(free))  # an address without a pod name: another port
    used.add(listed[-1])
print(json.dumps({"cluster": cluster, "task": task, "environment": "cloud"}, separators=(",", ":")))
' "$(dirname "$0")/cluster.json")
export TF_CONFIG
task=$TORCHPS_TASK_TYPE-$JOB_COMPLETION_INDEX
d=/etc/torchps/$task
[ -d "$d" ] || { echo "no credentials for $task: mount the Secret torchps-$task at $d" >&2; exit 2; }
export TORCHPS_TLS_CERT="$d/tls.crt" TORCHPS_TLS_KEY="$d/tls.key" TORCHPS_TLS_CA="$d/ca.crt" \
       TORCHPS_TOKEN_FILE="$d/token"
if [ -f "$d/admin-token" ]; then export TORCHPS_ADMIN_TOKEN_FILE="$d/admin-token"; fi
if [ "${TORCHPS_REPLICA:-}" = backup ]; then
  flags=$(python -c '
import json, os, sys
index = int(os.environ["JOB_COMPLETION_INDEX"])
with open(sys.argv[1]) as f:
    print("--replica-of", json.loads(os.environ["TF_CONFIG"])["cluster"]["ps"][index], "--bind", json.load(f)[index])
' "$(dirname "$0")/backups.json")
  set -- "$@" $flags   # unquoted on purpose: two flags and two addresses, none with spaces
elif [ "$TORCHPS_TASK_TYPE" = ps ] && [ -f "$(dirname "$0")/backups.json" ]; then
  set -- "$@" --replicated
fi
exec "$@"
