#!/usr/bin/env bash
# The fast loop (-m "not procs") on a copy of the tree that has no compiled extension: the
# Python fallbacks must pass alone. Copies what git tracks (and untracked files it does not
# ignore, so a local run tests local changes), never a built .so; tests/conftest.py puts
# the copy's src first on sys.path, for the tests and the processes they start.
# Usage: .ci/without_extensions.sh PYTHON [PYTEST ARGS...]
set -euo pipefail
cd "$(dirname "$0")/.."
py=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")  # a venv's python: keep the link
shift
dir=$(realpath "$(mktemp -d)")
trap 'rm -rf "$dir"' EXIT
git ls-files -z --cached --others --exclude-standard | tar --null --ignore-failed-read -T - -cf - 2>/dev/null | tar -xf - -C "$dir"
cd "$dir"
if find src -name '*.so' | grep -q .; then
    echo "a compiled extension was copied: $(find src -name '*.so')" >&2
    exit 1
fi
# the copy's modules are the ones imported, not the installed ones
PYTHONPATH="$dir/src" "$py" -c '
import os, sys, rankwise
assert rankwise.__file__.startswith(os.path.realpath(sys.argv[1])), rankwise.__file__
' "$dir"
"$py" -m pytest -q -p no:cacheprovider -m "not procs" "$@"
