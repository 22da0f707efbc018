#!/usr/bin/env bash
# Carry a llama-cpp-python build from one device call to the next instead of rebuilding it (the CUDA build
# takes 190-270 s of a 10-minute call):
#
#   scripts/llamacpp_bundle.sh pack DIR PREFIX     # DIR (a --target install) -> PREFIX00, PREFIX01, ... (xz, 15 MiB
#                                                  # parts: a device call brings back files of 16 MiB at most)
#   scripts/llamacpp_bundle.sh unpack PREFIX DIR   # the parts -> DIR; exit 1 unless `import llama_cpp` works there
#
# pack turns identical files into symbolic links first, which keeps the bundle to one copy of each library.
# The build only runs where it was made (same device image: CUDA, driver, Python): unpack checks the import.
set -euo pipefail

usage() { sed -n '2,11p' "$0" >&2; exit 2; }
[[ $# -eq 3 ]] || usage
PY="${PYTHON:-python3}"

case "$1" in
  pack)
    dir=$2 prefix=$3
    [[ -d "$dir" ]] || { echo "no directory $dir" >&2; exit 1; }
    # Identical copies become relative links to one of them: pip copies each library under its three names,
    # and the CMake install puts a second copy of every library in lib/ beside llama_cpp/lib/ (48 MB each for
    # libggml-cuda: without this the bundle is 55 MB, over what a call can carry with the wheels).
    declare -A first=()
    while IFS= read -r -d '' f; do
      sum=$(sha1sum "$f" | cut -d' ' -f1)
      if [[ -n "${first[$sum]:-}" ]]; then ln -sfr "${first[$sum]}" "$f"; else first[$sum]=$f; fi
    done < <(find "$dir" -type f -size +64k -print0 | sort -rz)  # llama_cpp/lib keeps the real files
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
