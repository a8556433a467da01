#!/usr/bin/env bash
# No module in src over 500 lines (Python or C): a longer one is split by what it does.
set -uo pipefail
cd "$(dirname "$0")/.."
over=$(git ls-files -z --cached --others --exclude-standard -- 'src/*.py' 'src/*.c' \
    | xargs -0 wc -l | awk '$2 != "total" && $1 > 500 {print $2 " (" $1 " lines)"}')
if [ -n "$over" ]; then
    echo "modules over 500 lines:"
    echo "$over"
    exit 1
fi
echo "no module over 500 lines"
