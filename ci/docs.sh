#!/usr/bin/env bash
# Builds the documentation site with warnings as errors (mkdocs build --strict): a broken link,
# a page left out of the nav, a docstring mkdocstrings cannot read, or a convention page whose
# generated tables no longer build fails it. The site goes to site/ at the repository root
# (open site/index.html, or run `mkdocs serve` to browse), or to the directory
# given with --site-dir DIR / -d DIR (relative to where you run this); the page count printed
# at the end is that directory's. Other flags go to mkdocs build (e.g. --verbose).
# Installs meshsim first when it is missing (ci/install.sh), then the docs extra's requirements
# (read from pyproject.toml) with the installed torch pinned, so pip never swaps it. It does not
# reinstall meshsim: the environment keeps pointing at the checkout it was installed from.
set -euo pipefail
here=$PWD
cd "$(dirname "$0")/.."
# The site directory: the last --site-dir/-d given (as mkdocs reads them), made absolute from
# the caller's directory; every other argument goes to mkdocs build as it is.
site=$PWD/site
args=()
while [ $# -gt 0 ]; do
    case "$1" in
        --site-dir | -d)
            if [ $# -lt 2 ] || [ -z "$2" ]; then
                echo "ci/docs.sh: $1 needs a directory" >&2
                exit 2
            fi
            site=$2
            shift 2
            ;;
        --site-dir=*) site=${1#--site-dir=}; shift ;;
        -d?*) site=${1#-d}; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
case "$site" in
    "") echo "ci/docs.sh: --site-dir needs a directory" >&2; exit 2 ;;
    /*) ;;
    *) site=$here/$site ;;
esac
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
NO_MKDOCS_2_WARNING=1 "$PYTHON" -m mkdocs build --strict --site-dir "$site" ${args[@]+"${args[@]}"}
echo "docs: built $(find "$site" -name index.html | wc -l) pages in $site"
