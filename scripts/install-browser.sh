#!/usr/bin/env bash
# Install what tests/web needs: Debian's Chromium (apt) and Playwright's Python package (pip).
# Never runs `playwright install`: the tests launch /usr/bin/chromium through executable_path,
# and Playwright's bundled node driver needs no download.
set -euo pipefail

if [[ ! -x /usr/bin/chromium ]]; then
    echo "install-browser: installing Chromium (apt-get)"
    "$(dirname "$0")/apt-install.sh" chromium chromium-driver fonts-dejavu-core
fi

PYTHON="${PYTHON:-python3}"
if [[ -x "${VIRTUAL_ENV:-}/bin/python" ]]; then
    PYTHON="$VIRTUAL_ENV/bin/python"
elif [[ -x .venv/bin/python ]]; then
    PYTHON=.venv/bin/python
fi
if ! "$PYTHON" -c "import playwright" 2>/dev/null; then
    # Outside a virtualenv Debian's Python refuses pip installs (PEP 668) unless told.
    if "$PYTHON" -c "import sys; sys.exit(sys.prefix != sys.base_prefix)"; then
        export PIP_BREAK_SYSTEM_PACKAGES=1
    fi
    "$PYTHON" -m pip install --quiet "playwright>=1.40"
fi

/usr/bin/chromium --version 2>/dev/null
"$PYTHON" -c "import importlib.metadata as m; print('playwright', m.version('playwright'))"
