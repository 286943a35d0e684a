#!/usr/bin/env bash
# Puts the pinned llama.cpp source, with zipmoe's patches applied, in build/llama.cpp; with --stock, without them
# (stock llama.cpp, what tools/dev/build_stock.sh builds for the comparisons).
#
# llama.cpp comes from the llama-cpp-python sdist (its vendor/llama.cpp), checked by sha256; no
# third-party source is kept in this repository. Re-running is cheap: the tree is re-made only when
# the sdist or a patch changed (a stamp records what was applied).
# Applying prints, for each patch, whether it applied cleanly, at an offset or with fuzz (tools/dev/patch_drift.py);
# --check prints that for a tree without making anything: the pinned sdist's, or a newer llama.cpp's
# (docs/llama-integration.md, "Following llama.cpp").
#   bash tools/dev/fetch_llama.sh [--stock] [DEST]     default DEST: build/llama.cpp (--stock: build/llama-stock-src)
#   bash tools/dev/fetch_llama.sh --check [SRC]        SRC: a llama.cpp source tree (default: the pinned sdist's)
set -euo pipefail
cd "$(dirname "$0")/../.."

PATCHES=patches/*.patch
DEFAULT_DEST=build/llama.cpp
CHECK=
if [ "${1:-}" = "--stock" ]; then
    PATCHES=
    DEFAULT_DEST=build/llama-stock-src
    shift
elif [ "${1:-}" = "--check" ]; then
    CHECK=1
    shift
fi
PYTHON=${PYTHON:-python3}
if [ -n "$CHECK" ] && [ -n "${1:-}" ]; then
    exec "$PYTHON" tools/dev/patch_drift.py "$1"
fi

VERSION=0.3.36
SHA256=832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e
DEST=${1:-$DEFAULT_DEST}
CACHE=${ZIPMOE_SDIST_CACHE:-build/cache}
SDIST=$CACHE/llama_cpp_python-$VERSION.tar.gz

mkdir -p "$CACHE"
if [ ! -f "$SDIST" ] || ! echo "$SHA256  $SDIST" | sha256sum -c --status; then
    echo "fetching llama-cpp-python==$VERSION (sdist) ..."
    rm -f "$SDIST"
    # --no-binary for this package only and no build isolation: pip must not build cmake from
    # source to read the sdist's metadata (that takes many minutes)
    "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --no-build-isolation \
        --no-binary llama-cpp-python "llama-cpp-python==$VERSION" -d "$CACHE"
fi
if ! echo "$SHA256  $SDIST" | sha256sum -c --status; then
    echo "fetch_llama.sh: $SDIST does not have the pinned sha256 $SHA256; refusing to build it" >&2
    exit 1
fi

if [ -n "$CHECK" ]; then
    tmp=$(mktemp -d "$CACHE/check.XXXXXX")
    trap 'rm -rf "$tmp"' EXIT
    tar -xzf "$SDIST" -C "$tmp" "llama_cpp_python-$VERSION/vendor/llama.cpp"
    echo "patches/ against llama-cpp-python $VERSION's llama.cpp:"
    "$PYTHON" tools/dev/patch_drift.py "$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp"
    exit
fi

stamp=$( { echo "$SHA256"; cat $PATCHES /dev/null 2>/dev/null || true; } | sha256sum | cut -d' ' -f1)
if [ -f "$DEST/.zipmoe-stamp" ] && [ "$(cat "$DEST/.zipmoe-stamp")" = "$stamp" ]; then
    exit 0
fi

echo "extracting llama.cpp into $DEST${PATCHES:+ and applying patches/} ..."
tmp=$(mktemp -d "$CACHE/extract.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
tar -xzf "$SDIST" -C "$tmp" "llama_cpp_python-$VERSION/vendor/llama.cpp"
src=$tmp/llama_cpp_python-$VERSION/vendor/llama.cpp
if [ -n "$PATCHES" ]; then
    "$PYTHON" tools/dev/patch_drift.py --apply "$src" ||
        { echo "fetch_llama.sh: a patch does not apply (above)" >&2; exit 1; }
fi
# Files a patch touches now or touched before get a fresh mtime, so the build recompiles them; all
# others keep the sdist's mtimes and are not rebuilt.
patched=$( (sed -n 's|^+++ b/\([^[:space:]]*\).*|\1|p' $PATCHES /dev/null 2>/dev/null || true) | sort -u)
before=$(cat "$DEST/.zipmoe-patched" 2>/dev/null || true)
for f in $patched $before; do
    [ -f "$src/$f" ] && touch "$src/$f"
done
echo "$patched" > "$src/.zipmoe-patched"
echo "$stamp" > "$src/.zipmoe-stamp"
rm -rf "$DEST"
mv "$src" "$DEST"
