#!/bin/sh
# Records `scontrol show job -d ID` (the GPU indexes of one job per node) on the dev cluster, for
# tests/unit/test_scontrol_job_gpus.py. Run under the cluster lock, on an idle cluster:
#   eval "$(.venv/bin/slurm-elastic devcluster env)"
#   flock /tmp/se-cluster.lock sh tests/unit/data/record_scontrol_job.sh
# Situations: one GPU on node1; two GPUs on each of two nodes, with other indexes on each
# (node1's first GPU is taken); a job that cannot start (pending, no nodes yet).
set -eu
out=$(dirname "$0")
submit() { sbatch --parsable --chdir=/tmp --output=/dev/null "$@" --wrap 'sleep 600' | cut -d';' -f1; }
running() { until [ "$(squeue --jobs="$1" --noheader --format=%T)" = RUNNING ]; do sleep 0.5; done; }
one=$(submit --nodes=1 --nodelist=node1 --gres=gpu:1)
trap 'scancel "$one" ${two:-} ${pending:-}' EXIT
running "$one"
two=$(submit --nodes=2 --gres=gpu:2)
running "$two"
pending=$(submit --nodes=2 --gres=gpu:4)
sleep 2
scontrol show job -d "$one" > "$out/scontrol_job_one_node_22.05.txt"
scontrol show job -d "$two" > "$out/scontrol_job_two_nodes_22.05.txt"
scontrol show job -d "$pending" > "$out/scontrol_job_pending_22.05.txt"
