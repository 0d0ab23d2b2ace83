# Sourced by the build scripts: ccache keys its results by paths relative to
# the checkout (CCACHE_BASEDIR), so a fresh clone elsewhere, as CI makes,
# reuses what an earlier build compiled. Meson picks ccache up at setup when
# it is installed (scripts/install_deps.sh); without it nothing changes.
export CCACHE_BASEDIR="$PWD"
export CCACHE_NOHASHDIR=1
export CCACHE_DIR="${CCACHE_DIR:-$HOME/.cache/ccache}"
