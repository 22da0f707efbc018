#!/usr/bin/env bash
# Carry a llama-cpp-python build from one device call to the next instead of rebuilding it (the CUDA build
# takes 190-270 s of a 10-minute call):
#
#   scripts/llamacpp_bundle.sh pack DIR PREFIX     # DIR (a --target install) -> PREFIX00, PREFIX01, ... (xz, 15 MiB
#                                                  # parts: a device call brings back files of 16 MiB at most)
#   scripts/llamacpp_bundle.sh unpack PREFIX DIR   # the parts -> DIR; exit 1 unless `import llama_cpp` works there
#
# `pip install --target` copies each shared library under its three names (libX.so, .so.0, .so.0.25.3);
# pack turns identical copies into symbolic links first, which keeps the bundle to one copy of each.
# The build only runs where it was made (same device image: CUDA, driver, Python): unpack checks the import.
set -euo pipefail

usage() { sed -n '2,11p' "$0" >&2; exit 2; }
[[ $# -eq 3 ]] || usage
PY="${PYTHON:-python3}"

case "$1" in
  pack)
    dir=$2 prefix=$3
    [[ -d "$dir" ]] || { echo "no directory $dir" >&2; exit 1; }
    # Identical copies of a library become links to the longest name (the real file, libX.so.0.25.3).
    while IFS= read -r real; do
      base=${real%%.so*}.so
      for alias in "$base" "$base".[0-9]; do
        if [[ -f "$alias" && ! -L "$alias" && "$alias" != "$real" ]] && cmp -s "$alias" "$real"; then
          ln -sf "$(basename "$real")" "$alias"
        fi
      done
    done < <(find "$dir" -type f -name '*.so.[0-9]*.[0-9]*')
    mkdir -p "$(dirname "$prefix")"
    rm -f "$prefix"[0-9][0-9]
    tar -C "$dir" -cf - . | xz -T0 -6 | split -b 15M -d - "$prefix"
    ls -l "$prefix"[0-9][0-9]
    ;;
  unpack)
    prefix=$2 dir=$3
    compgen -G "$prefix[0-9][0-9]" >/dev/null || { echo "no parts $prefix[0-9][0-9]" >&2; exit 1; }
    mkdir -p "$dir"
    cat "$prefix"[0-9][0-9] | xz -d | tar -C "$dir" -xf -
    PYTHONPATH="$dir" "$PY" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__, 'unpacked in $dir')"
    ;;
  *) usage ;;
esac
