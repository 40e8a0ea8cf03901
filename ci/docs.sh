#!/usr/bin/env bash
# Builds the documentation site with warnings as errors (mkdocs build --strict): a broken link,
# a page left out of the nav, a docstring mkdocstrings cannot read, or a convention page whose
# generated tables no longer build fails it. The site goes to a temporary directory, removed on
# exit; nothing is left in the checkout. Extra flags go to mkdocs build (e.g. --verbose).
# Installs meshsim first when it is missing (ci/install.sh), then the docs extra's requirements
# (read from pyproject.toml) with the installed torch pinned, so pip never swaps it. It does not
# reinstall meshsim: the environment keeps pointing at the checkout it was installed from.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/python.sh
if ! "$PYTHON" -c "import meshsim, torch" 2>/dev/null; then
    bash ci/install.sh
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PYTHON" -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > "$work/pin.txt"
"$PYTHON" - > "$work/docs.txt" <<'PY'
try:
    import tomllib
except ImportError:  # Python 3.10
    from pip._vendor import tomli as tomllib
with open("pyproject.toml", "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["docs"]))
PY
"$PYTHON" -m pip install --quiet --disable-pip-version-check -c "$work/pin.txt" -r "$work/docs.txt"
# Material's banner about MkDocs 2 is advice, not a warning about this site.
NO_MKDOCS_2_WARNING=1 "$PYTHON" -m mkdocs build --strict --site-dir "$work/site" "$@"
echo "docs: built $(find "$work/site" -name index.html | wc -l) pages"
