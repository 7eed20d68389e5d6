#!/bin/sh
# Renders: hello.sh --name NAME [--shout true|false]
name=world shout=false
while [ $# -gt 0 ]; do
  case "$1" in
    --name) name=$2; shift 2 ;;
    --shout) shout=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
greeting="Hello, $name!"
[ "$shout" = true ] && greeting=$(printf '%s' "$greeting" | tr '[:lower:]' '[:upper:]')
echo "$greeting"
