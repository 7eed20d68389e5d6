#!/usr/bin/env bash
# `make run`: serve the bundled example tool sets from a throwaway home, in the foreground.
set -euo pipefail
cd "$(dirname "$0")/.."
demo=$(mktemp -d "${TMPDIR:-/tmp}/toolsetd-demo.XXXXXX")
mkdir -p "$demo/home/tools" "$demo/workspace"
cp -R examples/tools/. "$demo/home/tools/"
sock="$demo/toolsetd.sock"
bin="$PWD/.venv/bin"
cat <<MSG
toolsetd demo: home $demo/home, workspace $demo/workspace
In another terminal, try:
  $bin/toolsetctl --socket $sock --workspace $demo/workspace list
  $bin/toolsetctl --socket $sock --workspace $demo/workspace invoke hello --args '{"name": "Ada"}'
Stop with Ctrl-C.
MSG
exec "$bin/toolsetd" --home "$demo/home" --socket "$sock" --log-format console
