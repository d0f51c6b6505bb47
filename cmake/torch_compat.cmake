# Everything that differs between the LibTorch versions nebula builds against lives here
# (Debian's libtorch-dev 1.13 on CPU; official LibTorch 2.x, CPU or CUDA, via -DTorch_DIR).
# C++ code does not test TORCH_VERSION anywhere; if a source difference appears, it goes in
# one header next to this note and nowhere else.
#
# 1. c10d's ProcessGroupGloo.hpp includes <gloo/...>. Debian ships those headers in
#    libgloo-dev, not in libtorch-dev; the official zips ship them under include/. Headers
#    shipped with LibTorch match the Gloo compiled into it, so look there first (before any
#    prefix in CMAKE_PREFIX_PATH), then fall back to libgloo-dev's (the pip wheels, e.g.
#    2.11.0+cu130, ship none: there Debian 12's libgloo-dev headers compile and the tests pass).
# 2. Debian's Caffe2 target exports USE_C10D_GLOO/USE_DISTRIBUTED; not every LibTorch build
#    does, and without them the Gloo process group is compiled out of the header.
# 3. CUDA builds of LibTorch (2.x wheels or zips) define the torch_cuda target; the GPU sanity
#    check (bench/gpu_sanity.cc, run by bench/gpu_check.sh) is built only then.
# 4. The pip wheels' libtorch_cpu.so exports a copy of libstdc++'s std::filesystem that it links
#    statically (pytorch/pytorch#133437). A program that uses std::filesystem and names
#    libtorch_cpu before libstdc++ among its needed libraries gets some of those functions from
#    torch's copy and the rest from the system's: seen on an H200 with 2.11.0+cu130, where every
#    test that made a temporary directory or read a path segfaulted (32 tests, bench/gpu_check.sh).
#    Every program here names libstdc++ first, so the dynamic linker finds the system's
#    definitions first; with Debian's 1.13 this changes nothing but the order. (Not yet run on a
#    2.x machine: the run that found it had no time left to check the fix.)
find_path(GLOO_INCLUDE_DIR gloo/rendezvous/store.h PATHS ${TORCH_INCLUDE_DIRS} NO_DEFAULT_PATH)
find_path(GLOO_INCLUDE_DIR gloo/rendezvous/store.h REQUIRED)

if(TARGET torch_cuda OR TORCH_CUDA_LIBRARIES)
  set(NEBULA_TORCH_CUDA ON)
else()
  set(NEBULA_TORCH_CUDA OFF)
endif()
message(STATUS "nebula: LibTorch ${Torch_VERSION} (CUDA: ${NEBULA_TORCH_CUDA}), Gloo headers in ${GLOO_INCLUDE_DIR}")

add_link_options("LINKER:--push-state,--no-as-needed" -lstdc++ "LINKER:--pop-state")

function(nebula_use_c10d target)
  target_include_directories(${target} PRIVATE ${GLOO_INCLUDE_DIR})
  target_compile_definitions(${target} PRIVATE USE_C10D_GLOO USE_DISTRIBUTED)
endfunction()
