#!/usr/bin/env bash
# The device tool brings back at most 8 files from $OUT: pack a result folder into FOLDER.tgz (and
# remove the folder) so that every run file comes back. Usage: bash benchmarks/device/pack.sh FOLDER
set -euo pipefail
d=${1%/}
tar czf "$d.tgz" -C "$(dirname "$d")" "$(basename "$d")" && rm -rf "$d"
echo "packed $d.tgz ($(du -h "$d.tgz" | cut -f1))"
