#!/usr/bin/env bash
# The README's version matrix: the default suite on each torch x Python of the window, through
# `make compat` (side environments cached outside the repository), one markdown row each.
#   tools/matrix.sh                          # the whole window
#   tools/matrix.sh 2.14.1:3.11 2.11.0:3.12  # some cells
# Logs: build/matrix/torch-X-pyY.log.
set -uo pipefail
cd "$(dirname "$0")/.."
cells=("$@")
[ ${#cells[@]} -gt 0 ] || cells=(2.11.0:3.11 2.12.1:3.11 2.13.0:3.11 2.14.1:3.11 2.15.0:3.11 2.11.0:3.12 2.13.0:3.13)
mkdir -p build/matrix
echo "| torch | Python | passed | failed | skipped | xfailed | minutes | date |"
echo "|---|---|---|---|---|---|---|---|"
for cell in "${cells[@]}"; do
    torch=${cell%%:*} python=${cell##*:}
    log=build/matrix/torch-$torch-py$python.log
    start=$(date +%s)
    make --no-print-directory compat TORCH="$torch" PYTHON="$python" >"$log" 2>&1
    minutes=$(( ($(date +%s) - start + 30) / 60 ))
    summary=$(grep -E "^[0-9]+ (passed|failed)|^=+ .*(passed|failed)" "$log" | tail -1)
    count() { echo "$summary" | grep -oE "[0-9]+ $1" | grep -oE "[0-9]+" || echo 0; }
    echo "| $torch | $python | $(count passed) | $(count failed) | $(count skipped) | $(count xfailed) | $minutes | $(date +%F) |"
done
