#!/usr/bin/env bash
# SPDX-License-Identifier: MIT
# Fetches ONNX Runtime's C/C++ API headers from Debian's libonnxruntime-dev package with apt's
# own tools, without installing it: a private apt configuration (its own sources list, package
# lists and cache, nothing under /etc or /var touched) downloads the .deb and dpkg-deb unpacks
# it into DEST. Prints the include directory on its last line.
#
#   tools/fetch-ort-headers.sh [DEST]        default DEST: <repo>/.cache/ort-headers
#   ORT_OPS_DEBIAN_SUITE=sid tools/fetch-ort-headers.sh   a newer ORT than trixie's 1.21
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dest=${1:-$here/.cache/ort-headers}
suite=${ORT_OPS_DEBIAN_SUITE:-trixie}
mirror=${ORT_OPS_DEBIAN_MIRROR:-http://deb.debian.org/debian}
keyring=${ORT_OPS_DEBIAN_KEYRING:-/usr/share/keyrings/debian-archive-keyring.gpg}
inc="$dest/usr/include/onnxruntime"
if [ -f "$inc/onnxruntime_cxx_api.h" ]; then
  echo "$inc"
  exit 0
fi
command -v apt-get >/dev/null || { echo "fetch-ort-headers: apt-get not found; set ORT_INCLUDE_DIR to a directory holding onnxruntime_cxx_api.h" >&2; exit 1; }
[ -f "$keyring" ] || { echo "fetch-ort-headers: Debian archive keyring $keyring not found (apt-get install debian-archive-keyring), or set ORT_INCLUDE_DIR" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/cache/archives/partial" "$work/deb"
echo "deb [signed-by=$keyring] $mirror $suite main" > "$work/sources.list"
apt_opts=(-o "Dir::Etc::SourceList=$work/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
          -o "Dir::State::Lists=$work/lists" -o "Dir::Cache=$work/cache" -o "Debug::NoLocking=1"
          -o "APT::Sandbox::User=$(id -un)" -q)
echo "fetch-ort-headers: apt-get update ($suite)" >&2
apt-get "${apt_opts[@]}" update >&2
(cd "$work/deb" && apt-get "${apt_opts[@]}" download libonnxruntime-dev >&2)
deb=$(ls "$work"/deb/libonnxruntime-dev_*.deb)
mkdir -p "$dest"
dpkg-deb -x "$deb" "$dest"
basename "$deb" > "$dest/PACKAGE"
[ -f "$inc/onnxruntime_cxx_api.h" ] || { echo "fetch-ort-headers: $deb holds no onnxruntime_cxx_api.h" >&2; exit 1; }
echo "fetch-ort-headers: unpacked $(cat "$dest/PACKAGE") into $dest" >&2
echo "$inc"
