#!/usr/bin/env bash
# The README's "Election at scale" table: every row one seeded election-sim run with the
# daemon's default timing (tick 250ms, announce 1s, member_ttl 3s), old rule vs new.
# Usage: timeoutd-sim/table.sh [SECONDS] [SECONDS_FOR_N1000]   (from the repository root)
# N = 1000 under the old rule costs a million deliveries per simulated second (about
# 4 s of CPU each here), hence the shorter runs; the crash target at N = 1000 gets its
# own long run under the new rule.
# Writes the JSON lines to target/election-table.jsonl (or $OUT) and a Markdown table to stdout.
# Runs JOBS simulations at once (default: one per core); every run is seeded, so the
# table does not depend on JOBS.
set -euo pipefail
seconds=${1:-600}
seconds_big=${2:-20}
out=${OUT:-${CARGO_TARGET_DIR:-target}/election-table.jsonl}
cargo build --release -q -p timeoutd-sim --bin election-sim
sim=${CARGO_TARGET_DIR:-target}/release/election-sim
: >"$out"
jobs=${JOBS:-$(nproc)}
runs=$(mktemp -d)
trap 'rm -rf "$runs"' EXIT
n_run=0
# One run: its row name, then election-sim's arguments; queued in table order.
queue() {
  local name=$1
  shift
  n_run=$((n_run + 1))
  printf '%s\0' "$(printf '%05d' "$n_run")" "$name" "$@" >"$runs/$(printf '%05d' "$n_run").args"
}
# name | scenario | loss | jitter
rows=(
  "no faults|none|0|0ms"
  "1% loss, 50 ms jitter|loss|1%|50ms"
  "5% loss, 50 ms jitter|loss|5%|50ms"
  "rolling restarts|rolling-restart|1%|50ms"
  "partition of the lowest|partition-lowest|1%|50ms"
  "crash of the lowest|crash-lowest|1%|50ms"
)
for row in "${rows[@]}"; do
  IFS='|' read -r name scenario loss jitter <<<"$row"
  for n in 3 10 100 1000; do
    s=$seconds
    [ "$n" -ge 1000 ] && s=$seconds_big
    for rule in old new; do
      queue "$name" --nodes "$n" --rule "$rule" --scenario "$scenario" --loss "$loss" \
        --jitter "$jitter" --seconds "$s" --seed 1
    done
  done
done
# A rolling deploy: every node starts on the old rule and comes back on the new one.
for n in 3 10 100 1000; do
  s=$seconds
  [ "$n" -ge 1000 ] && s=$seconds_big
  queue "rolling deploy, old → new" --nodes "$n" --old-nodes "$n" --rule new \
    --scenario rolling-restart --loss 1% --jitter 50ms --seconds "$s" --seed 1
done
# N = 1000 under the new rule, as long as the small groups.
for row in "5% loss, 50 ms jitter|loss" "rolling restarts|rolling-restart" \
  "partition of the lowest|partition-lowest" "crash of the lowest|crash-lowest"; do
  IFS='|' read -r name scenario <<<"$row"
  loss=1%
  [ "$scenario" = loss ] && loss=5%
  queue "$name (long run)" --nodes 1000 --rule new --scenario "$scenario" --loss "$loss" \
    --jitter 50ms --seconds "$seconds" --seed 2
done
export sim runs
# Longest first (they are queued last); each writes its own file, read back in order.
# shellcheck disable=SC2016
ls -r "$runs"/*.args | xargs -P "$jobs" -I{} bash -c '
  mapfile -d "" -t a <{}
  "$sim" "${a[@]:2}" | jq -c --arg name "${a[1]}" ". + {row: \$name}" >"$runs/${a[0]}.json"'
cat "$runs"/*.json >"$out"
echo "| scenario | N | rule | s | 0 active | ≥2 active | longest 0 s | longest ≥2 s | deliveries / interval | per node / s | takeovers | p50 s | p99 s | max s |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
jq -r '"| \(.row) | \(.nodes) | \(if .old_nodes > 0 then "mixed" else .rule end) | \(.seconds) | \(.zero_active_fraction * 100 | . * 1000 | round / 1000)% | \(.multi_active_fraction * 100 | . * 1000 | round / 1000)% | \(.longest_zero_active_s * 100 | round / 100) | \(.longest_multi_active_s * 100 | round / 100) | \(.deliveries_per_interval | round) | \(.deliveries_per_node_per_s * 10 | round / 10) | \(.takeovers) | \(.takeover_p50_s * 100 | round / 100) | \(.takeover_p99_s * 100 | round / 100) | \(.takeover_max_s * 100 | round / 100) |"' "$out"
