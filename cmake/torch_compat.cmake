# Everything that differs between the LibTorch versions nebula builds against lives here
# (Debian's libtorch-dev 1.13 on CPU; official LibTorch 2.x, CPU or CUDA, via -DTorch_DIR).
# C++ code does not test TORCH_VERSION anywhere; if a source difference appears, it goes in
# one header next to this note and nowhere else.
#
# 1. c10d's ProcessGroupGloo.hpp includes <gloo/...>. Debian ships those headers in
#    libgloo-dev, not in libtorch-dev; the official zips ship them under include/.
# 2. Debian's Caffe2 target exports USE_C10D_GLOO/USE_DISTRIBUTED; not every LibTorch build
#    does, and without them the Gloo process group is compiled out of the header.
find_path(GLOO_INCLUDE_DIR gloo/rendezvous/store.h HINTS ${TORCH_INCLUDE_DIRS} REQUIRED)

function(nebula_use_c10d target)
  target_include_directories(${target} PRIVATE ${GLOO_INCLUDE_DIR})
  target_compile_definitions(${target} PRIVATE USE_C10D_GLOO USE_DISTRIBUTED)
endfunction()
