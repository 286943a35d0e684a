# CMake toolchain file: cross-compile for aarch64 Linux with Debian's cross toolchain (crossbuild-essential-arm64).
# Libraries of the target come from the multiarch paths (libzstd-dev:arm64) and the cross sysroot.
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=tools/dev/aarch64.cmake
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)

set(ZIPMOE_CROSS_PREFIX aarch64-linux-gnu)
set(CMAKE_C_COMPILER   ${ZIPMOE_CROSS_PREFIX}-gcc)
set(CMAKE_CXX_COMPILER ${ZIPMOE_CROSS_PREFIX}-g++)

# The target's libraries: the cross sysroot (libc, libstdc++, libgomp) and Debian's multiarch directory
# (libzstd-dev:arm64). Headers that do not depend on the architecture (xxhash.h) come from the host's /usr/include.
set(CMAKE_FIND_ROOT_PATH /usr/${ZIPMOE_CROSS_PREFIX})
set(CMAKE_LIBRARY_PATH /usr/lib/${ZIPMOE_CROSS_PREFIX})
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE BOTH)
set(CMAKE_FIND_ROOT_PATH_MODE_PACKAGE BOTH)

# Programs built here run under qemu-user (tools/dev/cross_arm64.sh) when CMake itself runs them.
find_program(ZIPMOE_QEMU qemu-aarch64)
if (ZIPMOE_QEMU)
    set(CMAKE_CROSSCOMPILING_EMULATOR ${ZIPMOE_QEMU};-L;/usr/${ZIPMOE_CROSS_PREFIX})
endif()
