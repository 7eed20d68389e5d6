#!/bin/sh
echo "This is a simple text response for testing."
