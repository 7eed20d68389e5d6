#!/bin/sh
echo "This tool intentionally returns an error for testing" >&2
exit 1
