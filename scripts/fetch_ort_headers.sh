#!/usr/bin/env bash
# Fetch the ONNX Runtime C/C++ headers (Debian 13's libonnxruntime-dev) into a project-local folder.
#
# The onnxruntime pip wheels carry no headers. Debian 13 ("trixie") packages them; this machine may be
# Debian 12, so the .deb is fetched with apt through a private source list that names suite trixie at the
# same mirror as the machine's own sources, then unpacked with dpkg -x. Nothing is installed system-wide.
#
# Usage: scripts/fetch_ort_headers.sh DEST      (DEST/include/onnxruntime/onnxruntime_c_api.h on success)
set -euo pipefail

dest=${1:?usage: fetch_ort_headers.sh DEST}
if [ -f "$dest/include/onnxruntime/onnxruntime_c_api.h" ]; then
  exit 0
fi

sources=/etc/apt/sources.list.d/debian.sources
uri=""
if [ -f "$sources" ]; then
  uri=$(awk '/^URIs:/ {print $2; exit}' "$sources")
fi
if [ -z "$uri" ] && [ -f /etc/apt/sources.list ]; then
  uri=$(awk '/^deb / {print $2; exit}' /etc/apt/sources.list)
fi
if [ -z "$uri" ]; then
  echo "error: cannot find a Debian mirror in $sources or /etc/apt/sources.list" >&2
  exit 1
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/archives/partial" "$work/etc"
echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $uri trixie main" > "$work/etc/sources.list"
apt_opts=(
  -o "Dir::Etc::SourceList=$work/etc/sources.list"
  -o "Dir::Etc::SourceParts=-"
  -o "Dir::State::Lists=$work/lists"
  -o "Dir::Cache::Archives=$work/archives"
  -o "APT::Get::List-Cleanup=0"
  -o "Debug::NoLocking=1"
  -o "APT::Sandbox::User=root"
)
echo "fetching libonnxruntime-dev (Debian trixie) for the ONNX Runtime headers ..." >&2
apt-get "${apt_opts[@]}" -qq update >/dev/null
(cd "$work" && apt-get "${apt_opts[@]}" -qq download libonnxruntime-dev >/dev/null)
deb=$(ls "$work"/libonnxruntime-dev_*.deb | head -n 1)
mkdir -p "$work/x"
dpkg -x "$deb" "$work/x"
mkdir -p "$dest/include"
rm -rf "$dest/include/onnxruntime"
cp -r "$work/x/usr/include/onnxruntime" "$dest/include/onnxruntime"
basename "$deb" > "$dest/VERSION"
echo "ONNX Runtime headers: $dest/include/onnxruntime ($(cat "$dest/VERSION"))" >&2
