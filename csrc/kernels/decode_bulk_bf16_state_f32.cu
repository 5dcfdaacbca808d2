// One instantiation per translation unit so that the build runs in parallel.
#include "flashkda/decode/decode_bulk.cuh"

template cudaError_t flashkda::run_decode_bulk<__nv_bfloat16, float>(const flashkda::RecurrentParams&, cudaStream_t, bool&);
template bool flashkda::decode_bulk_serves<__nv_bfloat16, float>(const flashkda::RecurrentParams&);
