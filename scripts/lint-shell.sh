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
while IFS= read -r f; do
  # A pipe into grep whose options include q (-q, -Eq, -qx, --quiet, --silent).
  if grep -nE '(^|[^|])\|[[:space:]]*grep([[:space:]]+-[[:alnum:]]+)*[[:space:]]+(-[[:alpha:]]*q[[:alpha:]]*|--quiet|--silent)([[:space:]]|$)' "$f" |
    sed "s|^|$f:|"; then
    bad=1
  fi
done < <(git ls-files '*.sh' .ci/run scripts/target-dir)
if [ "$bad" = 1 ]; then
  echo "lint-shell: a pipe ends in 'grep -q' under pipefail (see the head of scripts/lint-shell.sh)"
  exit 1
fi
echo "lint-shell: ok"
