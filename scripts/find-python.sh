#!/bin/sh
# Print a Python >= 3.12 interpreter (mitmproxy 12 needs it; on 3.11 pip
# silently installs mitmproxy 11). Looks on PATH, then in pyenv's versions.
for c in python3.12 python3.13 python3; do
  p=$(command -v "$c" 2>/dev/null) || continue
  if "$p" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
    echo "$p"; exit 0
  fi
done
for p in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3 "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.13*/bin/python3; do
  if [ -x "$p" ]; then echo "$p"; exit 0; fi
done
echo "error: no Python >= 3.12 found (apt install python3.12, or pyenv install 3.12)" >&2
exit 1
