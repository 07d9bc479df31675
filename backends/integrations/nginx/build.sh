#!/bin/sh
# Builds ngx_http_toffload_module.so for Debian's stock nginx, against the sources
# and configure flags that the nginx-dev package ships (a dynamic module loads only
# into an nginx configured the same way), and libtoffload_accel.so of DIST.
#   backends/integrations/nginx/build.sh DIST OUTDIR
set -eu
dist=$(cd "$1" && pwd)
out=$2
here=$(cd "$(dirname "$0")" && pwd)
src=/usr/share/nginx/src
[ -f "$src/conf_flags" ] || { echo "nginx-dev is not installed ($src/conf_flags missing)" >&2; exit 3; }
mkdir -p "$out"
out=$(cd "$out" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$src/." "$work/"
cd "$work"
# conf_flags sets NGX_CONF_FLAGS, a bash array; read it without bash.
flags=$(sed -n 's/^NGX_CONF_FLAGS=( *\(.*\) *)$/\1/p' conf_flags)
# shellcheck disable=SC2086
./configure $flags --add-dynamic-module="$here" \
    --with-cc-opt="-I$dist/include -O2 -g -Wall -Werror" \
    --with-ld-opt="-L$dist/lib -Wl,-rpath,$dist/lib" >configure.log 2>&1 ||
    { tail -20 configure.log >&2; exit 1; }
make -f objs/Makefile modules >make.log 2>&1 || { tail -40 make.log >&2; exit 1; }
cp objs/ngx_http_toffload_module.so "$out/"
echo "$out/ngx_http_toffload_module.so"
