#!/usr/bin/env bash
# Shell pitfalls that made checks fail at random, found in the project's own scripts.
# - `... | grep -q` under `set -o pipefail`: grep -q exits at its first match, so the command
#   before it may die of SIGPIPE while still writing, and the pipeline fails although the line
#   was there (the soft-RoCE log check failed so on 66 KB of logs, 19 times in 200). Write
#   `grep -q PATTERN FILE...`, or `| grep PATTERN >/dev/null` (which reads to the end).
#   Checked in every script, with pipefail or not: a file may be sourced by one that sets it.
# Prints each offending line as FILE:LINE and exits 1 if there is one.
set -uo pipefail
cd "$(dirname "$0")/.."
bad=0
# A line continued with a trailing `|` or `\` is joined to the next before the match; comment
# lines are skipped. Prints FILE:LINE: the joined line.
check() {
  awk -v f="$1" '
    /^[[:space:]]*#/ && held == "" { next }
    { if (held == "") start = FNR; line = held $0 }
    /(\||\\)[[:space:]]*$/ { sub(/\\[[:space:]]*$/, "", line); held = line " "; next }
    {
      held = ""
      if (line ~ /(^|[^|])\|[[:space:]]*(command[[:space:]]+)?e?grep([[:space:]]+-[[:alnum:]-]+(=[^[:space:]]*)?)*[[:space:]]+(-[[:alpha:]]*q[[:alpha:]]*|--quiet|--silent)([[:space:]]|$)/)
        { print f ":" start ": " line; found = 1 }
    }
    END { exit found ? 3 : 0 }
  ' "$1"
}
while IFS= read -r f; do
  check "$f"
  case $? in
    0) ;;
    3) bad=1 ;;
    *) echo "lint-shell: cannot read $f"; bad=1 ;;
  esac
done < <(git ls-files '*.sh' .ci/run scripts/target-dir)
if [ "$bad" = 1 ]; then
  echo "lint-shell: a pipe ends in 'grep -q' under pipefail (see the head of scripts/lint-shell.sh)"
  exit 1
fi
echo "lint-shell: ok"
