#!/usr/bin/env bash
# Make .bench-carry/ (git-ignored) for running bench/remote.py on a machine with no network and no
# redis-server: the redis-server binary (Debian 12's 7.0), every shared library it links except
# glibc's own and the C++ runtime (liblzf and libjemalloc are missing on a generic Ubuntu; libssl3,
# libsystemd, libcap, libgcrypt, lz4, zstd, lzma usually are, but copies cost little), and the
# redis client wheel. It needs glibc >= 2.34 (Ubuntu >= 22.04, RHEL >= 9). Run it here, then carry
# .bench-carry; bench/remote.py puts the binary's folder on LD_LIBRARY_PATH for the server only.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.bench-carry
rm -rf "$out" && mkdir -p "$out/wheels"
bin=$(command -v redis-server)
cp -L "$bin" "$out/redis-server"
ldd "$bin" | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | while read -r name path; do
    case "$name" in
        libc.so.*|libm.so.*|libgcc_s.so.*|libstdc++.so.*|ld-linux*) ;;  # the host's own
        *) cp -L "$path" "$out/" ;;
    esac
done
python3 -m pip download -q --no-deps --only-binary=:all: -d "$out/wheels" 'redis>=5'
echo "glibc needed: $(objdump -T "$bin" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -1)"
echo "libraries the binary links:"; ldd "$bin" | awk '{print "  " $1}'
du -sh "$out"; ls -l "$out" "$out/wheels"
