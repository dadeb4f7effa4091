#!/bin/sh
# No arguments or --version [--json]: say what is inside. Anything else: run it (the
# launcher's torchrun).
set -eu
if [ "$#" -eq 0 ]; then
    set -- --version
fi
if [ "$1" = "--version" ]; then
    shift
    exec python3 /usr/local/lib/torch-multinode/versions.py "$@"
fi
exec "$@"
