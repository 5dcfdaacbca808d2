// One instantiation per translation unit so that the build runs in parallel.
#include "flashkda/decode/decode_stream.cuh"

template cudaError_t flashkda::run_decode_stream<__half>(const flashkda::RecurrentParams&, cudaStream_t, bool&);
template bool flashkda::decode_stream_serves<__half>(const flashkda::RecurrentParams&);
