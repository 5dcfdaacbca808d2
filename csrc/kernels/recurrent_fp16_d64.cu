// One instantiation per translation unit so that the build runs in parallel.
#include "flashkda/decode/recurrent_kernel.cuh"

template cudaError_t flashkda::run_recurrent<__half, 64>(const flashkda::RecurrentParams&, cudaStream_t);
