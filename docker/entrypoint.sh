#!/bin/sh
# No arguments or --version: say what is inside. Anything else: run it (the launcher's torchrun).
set -eu
if [ "$#" -eq 0 ] || [ "$1" = "--version" ]; then
    exec python3 -m cluster.versions
fi
exec "$@"
