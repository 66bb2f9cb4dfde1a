#!/bin/sh
# Records the CLI backend's `squeue --steps` listings of one job on the dev cluster, for the
# in-process controller tests (tests/unit/test_controller_replay.py). Run under the cluster lock:
#   eval "$(.venv/bin/slurm-elastic devcluster env)"
#   flock /tmp/se-cluster.lock sh tests/unit/data/record_controller_steps.sh
# Situations: three worker steps and a trainer step on two GPUs running; one worker vanished;
# a worker step pending (it asks for a GPU on the node whose GPUs are all taken).
set -eu
out=$(dirname "$0")
fmt=$(.venv/bin/python -c 'from slurm_elastic.slurm.parse import STEP_FORMAT; print(STEP_FORMAT)')
listing() { squeue --steps --jobs="$job" --noheader --format="$fmt"; }
job=$(sbatch --parsable --nodes=2 --exclusive --gres=gpu:4 --output=/dev/null --wrap 'sleep 600')
trap 'scancel "$job"' EXIT
until [ "$(squeue --jobs="$job" --noheader --format=%T)" = RUNNING ]; do sleep 0.5; done
step() { name=$1 gpus=$2; shift 2
  srun --jobid="$job" --job-name="$name" --nodes=1 --ntasks=1 --exact --input=none --output=/dev/null \
    --gres="gpu:$gpus" "$@" sleep 600 2>/dev/null & }
step trainer 2; sleep 1
step se-w-0001 1; step se-w-0002 1; step se-w-0003 1
until [ "$(listing | grep -c se-w-)" = 3 ]; do sleep 0.5; done
listing > "$out/controller_steps_running.txt"
scancel "$(listing | awk -F'\037' '/se-w-0002/ {print $1}')"
while listing | grep -q se-w-0002; do sleep 0.5; done
listing > "$out/controller_steps_vanished.txt"
full=$(listing | awk -F'\037' '/trainer/ {print $2}')
step se-w-0004 1 --nodelist="$full"; sleep 3
listing > "$out/controller_steps_pending.txt"
