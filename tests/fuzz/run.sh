#!/usr/bin/env bash
# run.sh BUILD_DIR SECONDS: each fuzz target built in BUILD_DIR (EMSA_BUILD_FUZZERS) first replays
# its regression inputs (tests/fuzz/regressions/TARGET/, inputs that once crashed it), then fuzzes
# for SECONDS from a seed corpus of examples/ and presets/, inputs up to 1 MiB. Exit 1 on any
# finding; libFuzzer writes the input to BUILD_DIR/fuzz-findings/.
set -euo pipefail
build=$(cd "$1" && pwd)
seconds=$2
root=$(cd "$(dirname "$0")/../.." && pwd)
work="$build/fuzz-work"
findings="$build/fuzz-findings"
rm -rf "$work"
mkdir -p "$work" "$findings"

# Seeds: every JSON file for the parsers; for MakePlan each example probe, a NUL, each profile.
seed() {  # seed TARGET FILE...: copied under names that keep their folder (h200.json is twice)
  local target=$1; shift
  mkdir -p "$work/seeds/$target"
  for f in "$@"; do cp "$f" "$work/seeds/$target/$(basename "$(dirname "$f")")-$(basename "$f")"; done
}
seed json "$root"/examples/*/*.json "$root"/presets/*/*.json
seed probe_record "$root"/examples/probes/*.json
seed profile "$root"/examples/profiles/*.json "$root"/presets/devices/*.json
seed model_config "$root"/presets/models/*.json
mkdir -p "$work/seeds/plan"
for probe in "$root"/examples/probes/*.json; do
  for profile in "$root"/examples/profiles/*.json "$root"/presets/devices/*.json; do
    out="$work/seeds/plan/$(basename "$probe" .json)+$(basename "$(dirname "$profile")")-$(basename "$profile")"
    { cat "$probe"; printf '\0'; cat "$profile"; } >"$out"
  done
done

status=0
for t in json probe_record profile model_config plan; do
  regressions="$root/tests/fuzz/regressions/$t"
  if [ -d "$regressions" ] && [ -n "$(ls -A "$regressions")" ]; then
    echo "== fuzz: $t, regression inputs"
    "$build/tests/fuzz/${t}_fuzz" "$regressions"/* || status=1
  fi
  echo "== fuzz: $t, ${seconds} s"
  mkdir -p "$work/corpus/$t"
  # -timeout: an input taking longer than this is a finding (a hang), not something to wait for.
  "$build/tests/fuzz/${t}_fuzz" -max_len=1048576 -max_total_time="$seconds" -timeout=30 \
    -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix="$findings/$t-" \
    "$work/corpus/$t" "$work/seeds/$t" 2>"$work/$t.log" || { status=1; tail -40 "$work/$t.log"; }
  grep -E "^stat::number_of_executed_runs|^#[0-9]+.*DONE" "$work/$t.log" | tail -2 || true
done
exit $status
