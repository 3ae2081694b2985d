#!/usr/bin/env bash
# Build Icarus Verilog 12.0, the version VerilogEval v2 requires, into PREFIX (once; later runs return at once).
#
#   tools/build_iverilog.sh [PREFIX]      default PREFIX: ${GEMMA_TPU_TOOLS:-$HOME/.cache/gemma-tpu}/iverilog-12
#   tools/build_iverilog.sh --deps-only [PREFIX]   only the apt part (when a build is needed), so `make setup` can
#                                                  run apt alone, then the compile beside pip
#
# Debian 12 and Ubuntu 22.04 ship iverilog 11, PyPI has none. The source is Debian's iverilog_12.0.orig.tar.gz
# (the upstream v12_0 tag), from the machine's own Debian mirror (read from /etc/apt/sources.list*) or
# deb.debian.org, checked against a pinned SHA-256. Build dependencies come from apt. It compiles with -O1 and no
# debug information unless CFLAGS/CXXFLAGS say otherwise: 95 s alone on 2 cores (AMD EPYC), against 141 s with
# autoconf's default -g -O2, and 7 MB installed instead of 65 MB; the simulations of the evaluation are tiny either way
# (the 28 shipped problems: 1.0 s with both builds). `make setup` runs it beside pip, which fills the two venvs.
# PREFIX lives outside the clone, so CI and fresh clones reuse it; the course puts it first on PATH
# (course/config/paths.py, iverilog_prefix).
set -euo pipefail

VERSION=12.0
TARBALL=iverilog_${VERSION}.orig.tar.gz
SHA256=a68cb1ef7c017ef090ebedb2bc3e39ef90ecc70a3400afb4aa94303bc3beaa7d
POOL=pool/main/i/iverilog
BUILD_DEPS="gperf bison flex zlib1g-dev libbz2-dev libreadline-dev g++ make autoconf"

DEPS_ONLY=""
if [ "${1:-}" = "--deps-only" ]; then DEPS_ONLY=yes; shift; fi
PREFIX=${1:-${GEMMA_TPU_TOOLS:-$HOME/.cache/gemma-tpu}/iverilog-12}

if [ -x "$PREFIX/bin/iverilog" ] && [ -x "$PREFIX/bin/vvp" ] \
   && "$PREFIX/bin/iverilog" -V 2>/dev/null | head -1 | grep -q "version $VERSION "; then
  exit 0  # already built
fi
if command -v iverilog >/dev/null \
   && iverilog -V 2>/dev/null | head -1 | grep -q "version 12\."; then
  exit 0  # the iverilog on PATH is already a 12.x (Ubuntu 24.04, conda-forge): nothing to build
fi

say() { echo "build_iverilog: $*" >&2; }
[ -n "$DEPS_ONLY" ] || say "building Icarus Verilog $VERSION into $PREFIX (about 2 minutes on 2 cores, once)"

# Build dependencies (apt; sudo when not root).
SUDO=""
[ "$(id -u)" = 0 ] || SUDO=sudo
missing=""
for pkg in $BUILD_DEPS; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing="$missing $pkg"
done
if [ -n "$missing" ]; then
  say "installing build dependencies:$missing"
  $SUDO apt-get update -qq
  $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null
fi
[ -z "$DEPS_ONLY" ] || exit 0

# The machine's own Debian mirror (first deb.* URI that is not the security archive), else deb.debian.org.
mirror() {
  local files uri
  files=$(ls /etc/apt/sources.list /etc/apt/sources.list.d/*.list /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$files" ] || { echo "http://deb.debian.org/debian"; return; }
  uri=$(grep -hoE '(URIs:[[:space:]]*|^deb(-src)?[[:space:]]+(\[[^]]*\][[:space:]]+)?)https?://[^[:space:]]+' $files \
        | grep -oE 'https?://[^[:space:]]+' | sed 's:/*$::' | grep -E '/debian$' | grep -v security | head -1 || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/iverilog-build.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

fetched=""
for base in "$(mirror)" http://deb.debian.org/debian; do
  url="$base/$POOL/$TARBALL"
  say "downloading $url"
  if python3 - "$url" "$TARBALL" <<'EOF'
import sys, urllib.request
url, out = sys.argv[1], sys.argv[2]
try:
    with urllib.request.urlopen(url, timeout=120) as r, open(out, "wb") as f:
        f.write(r.read())
except Exception as e:
    sys.exit(f"build_iverilog: {url}: {e}")
EOF
  then
    if echo "$SHA256  $TARBALL" | sha256sum -c --quiet - 2>/dev/null; then
      fetched=yes
      break
    fi
    say "$url: SHA-256 differs from the pinned $SHA256; trying the next source"
  fi
done
if [ -z "$fetched" ]; then
  say "could not download $TARBALL. Fix: download it by hand from any Debian mirror ($POOL/$TARBALL,"
  say "SHA-256 $SHA256) or from https://github.com/steveicarus/iverilog (tag v12_0), unpack it, and run"
  say "sh autoconf.sh && ./configure --prefix=$PREFIX && make -j2 && make install"
  exit 1
fi

tar xzf "$TARBALL"
cd iverilog-12_0
start=$(date +%s)
sh autoconf.sh >build.log 2>&1
CFLAGS=${CFLAGS:--O1} CXXFLAGS=${CXXFLAGS:--O1} ./configure --prefix="$PREFIX" >>build.log 2>&1
# Installed into a staging folder beside PREFIX, then renamed: an interrupted build never leaves a half prefix.
mkdir -p "$(dirname "$PREFIX")"
STAGE=$(mktemp -d "$(dirname "$PREFIX")/.iverilog-stage.XXXXXX")
trap 'rm -rf "$WORK" "$STAGE"' EXIT
if ! { make -j"$(nproc)" && make install DESTDIR="$STAGE"; } >>build.log 2>&1; then
  tail -40 build.log >&2
  say "the build failed (log above). Fix: install $BUILD_DEPS and run this script again"
  exit 1
fi
rm -rf "$PREFIX"
mv "$STAGE$PREFIX" "$PREFIX"
"$PREFIX/bin/iverilog" -V 2>/dev/null | head -1 | grep -q "version $VERSION " \
  || { say "$PREFIX/bin/iverilog does not report version $VERSION"; exit 1; }
say "built $("$PREFIX/bin/iverilog" -V 2>/dev/null | head -1) in $(( $(date +%s) - start )) s into $PREFIX"
