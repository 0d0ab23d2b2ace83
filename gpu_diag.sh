#!/usr/bin/env bash
# temporary diagnosis of the first GPU run's failures (2)
set -uo pipefail
source .devdeps/device-env.sh
meson setup build-gpu --buildtype=debugoptimized -Dcuda=enabled -Dgpu_arch='90' -Dtests=false > /tmp/build.log 2>&1
ninja -C build-gpu bagua_core.cpython-312-x86_64-linux-gnu.so >> /tmp/build.log 2>&1 || { tail -30 /tmp/build.log; exit 1; }
export PYTHONPATH=$PWD/py:$PWD/build-gpu
M=$(ls build-gpu/bagua_core*.so)
echo "== NEEDED"; readelf -d $M | grep NEEDED
echo "== std:: defined in module"; nm -D --defined-only $M | c++filt | grep -E " std::" | head -8
nm -C $M | grep -E "do_unshift|_M_insert<long>" | head -4
echo "== link command"; grep -E "bagua_core.cpython.*\.so" build-gpu/build.ninja | head -3
ninja -C build-gpu -t commands bagua_core.cpython-312-x86_64-linux-gnu.so | tail -1 | cut -c1-1500
TL=$(python3 -c "import torch, os; print(os.path.dirname(torch.__file__)+'/lib')")
echo "== torch exports gloo: $(nm -D --defined-only $TL/libtorch_cpu.so | grep -c _ZN4gloo)"
echo "== dlopen flags"; python3 -c "import sys; print(sys.getdlopenflags()); import torch; print(sys.getdlopenflags())"
echo "== maps"; python3 -c "import torch, bagua_core; print(''.join(sorted({l.split()[-1]+chr(10) for l in open('/proc/self/maps') if 'stdc++' in l or 'gloo' in l or 'gcc_s' in l})))"
echo "== bindings crossing libraries"
LD_DEBUG=bindings python3 -c "import torch, bagua_core; c = bagua_core.gloo_communicator(bagua_core._testing.hash_store(), 0, 1, prefix='x'); print('ok')" 2>&1 | grep "normal symbol" | grep -E "gloo|_M_insert|codecvt|locale" | awk '{print $4, "->", $7, $NF}' | sed 's#/opt/torch/.venv/lib/python3.12/site-packages/##g' | awk '$1 != $3' | sort | uniq -c | sort -rn | head -40
echo "== bagua_core alone"
python3 -c "import bagua_core; c = bagua_core.gloo_communicator(bagua_core._testing.hash_store(), 0, 1, prefix='x'); print('created'); import torch; print('torch imported'); d = bagua_core.gloo_communicator(bagua_core._testing.hash_store(), 0, 1, prefix='y'); print('second created')" 2>&1 | tail -5
echo "== backtrace"
timeout 120 cuda-gdb -q -batch -ex 'set pagination off' -ex run -ex 'bt 12' --args python3 -c "import torch, bagua_core; c = bagua_core.gloo_communicator(bagua_core._testing.hash_store(), 0, 1, prefix='x'); print('created')" 2>&1 | grep -E "^#|signal" | cut -c1-300 | head -n 30
