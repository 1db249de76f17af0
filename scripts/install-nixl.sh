#!/usr/bin/env bash
# Installs the NIXL transfer engine (the PD data plane) into the given interpreter's environment
# unless it imports already. The lean install: the Python bindings and their bundled UCX, without
# their CUDA dependencies (the CPU machines move bytes over UCX's TCP transport). Where no wheel
# fits the platform the install is skipped: PD falls back to torch.distributed, and the NIXL tests
# skip with the reason. The two packages are pinned as a pair: `nixl` loads the bindings of the
# `nixl-cu12` release of its own version, and unpinned they resolve to releases that differ.
set -uo pipefail
py="$1"
if "$py" -c "import nixl._api" >/dev/null 2>&1; then
    exit 0
fi
if ! "$py" -m pip install -q --no-deps nixl==1.5.1 nixl-cu12==1.5.1 2>/dev/null; then
    echo "install-nixl: no NIXL wheel for this platform; PD uses the torch.distributed data plane" >&2
fi
exit 0
