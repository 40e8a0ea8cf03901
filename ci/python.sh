# Sourced by the set-up scripts: picks the interpreter everything installs into and runs with,
# and exports it as PYTHON.
#
# PYTHON if set (a venv of yours, a matrix lane). Otherwise python3, unless it is a system
# Python that pip refuses to install into (PEP 668, "externally-managed-environment": Debian,
# Ubuntu 23.04+, Fedora, Homebrew): then a venv in .venv/ at the repository root, created once
# and reused, so the two README commands work there too without --break-system-packages.
if [ -z "${PYTHON:-}" ]; then
    PYTHON=python3
    managed=$("$PYTHON" -c 'import os, sys, sysconfig
stdlib = sysconfig.get_path("stdlib")
inside_venv = sys.prefix != sys.base_prefix
print(int(os.path.exists(os.path.join(stdlib, "EXTERNALLY-MANAGED")) and not inside_venv))')
    if [ "$managed" = "1" ]; then
        root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
        if [ ! -x "$root/.venv/bin/python" ]; then
            echo "ci: $PYTHON is externally managed (PEP 668); creating $root/.venv" >&2
            "$PYTHON" -m venv "$root/.venv"
        fi
        PYTHON="$root/.venv/bin/python"
    fi
fi
export PYTHON
