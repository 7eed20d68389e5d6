#!/usr/bin/env bash
# `make run`: serve the bundled example tool sets from a throwaway home, in the foreground.
# It prints the lines that point a second terminal at this daemon; the README's commands
# work as they are once those lines have been pasted.
set -euo pipefail
cd "$(dirname "$0")/.."
demo=$(mktemp -d "${TMPDIR:-/tmp}/toolsetd-demo.XXXXXX")
mkdir -p "$demo/home/tools" "$demo/workspace"
cp -R examples/tools/. "$demo/home/tools/"
sock="$demo/toolsetd.sock"
bin="$PWD/.venv/bin"
cat <<MSG
toolsetd demo: home $demo/home, workspace $demo/workspace
In another terminal, paste these lines:
  export PATH="$bin:\$PATH"
  export TOOLSETD_SOCKET="$sock"
  export CRYSTAL_HOME="$demo/home"
  cd "$demo/workspace"
then try:
  toolsetctl list
  toolsetctl invoke hello --args '{"name": "Ada"}'
  toolsetctl disable hello
  toolsetctl enable hello
Stop with Ctrl-C.
MSG
exec "$bin/toolsetd" --home "$demo/home" --socket "$sock" --log-format console
