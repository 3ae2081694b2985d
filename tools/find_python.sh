#!/usr/bin/env bash
# The Python that builds the venvs: 3.11 or later (google-tunix 0.1.7 needs it). Used by the Makefile.
#   tools/find_python.sh            print the first of python3, python3.13, python3.12, python3.11 on PATH that is one
#   tools/find_python.sh --why CMD  print why CMD (or, if empty, every candidate) cannot be used, as one line
# Prints nothing and exits 1 when none is found. A stock TPU VM (Ubuntu 22.04) has only Python 3.10.
CANDIDATES=(python3 python3.13 python3.12 python3.11)

version() {  # "3.10.12", or nothing when $1 is not a Python
  command -v "$1" >/dev/null 2>&1 && "$1" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null
}

new_enough() {  # 3.11 or later
  local major minor
  IFS=. read -r major minor _ <<<"$1"
  [ -n "$minor" ] && { [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge 11 ]; }; }
}

if [ "${1:-}" = "--why" ]; then
  if [ -n "${2:-}" ]; then
    v=$(version "$2")
    found="PYTHON=$2 is ${v:+Python $v}${v:-not a Python on PATH}"
  else
    found="none of ${CANDIDATES[*]} on PATH is"
    v=$(version python3) && found="$found (python3 is $v)"
  fi
  echo "the venvs need Python 3.11 or later, and $found: install one and run \`make PYTHON=python3.11 ...\`," \
       "or run \`make tpu-venv\` (it builds .venv on a uv-managed Python 3.12)"
  exit 0
fi

if [ -n "${1:-}" ]; then  # check the one given
  v=$(version "$1") && new_enough "$v" && { echo "$1"; exit 0; }
  exit 1
fi
for p in "${CANDIDATES[@]}"; do
  v=$(version "$p") && new_enough "$v" && { echo "$p"; exit 0; }
done
exit 1
