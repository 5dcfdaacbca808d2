// One instantiation per translation unit so that the build runs in parallel.
#include "flashkda/decode/decode_stream_tc.cuh"

template cudaError_t flashkda::run_decode_stream_tc<float>(const flashkda::RecurrentParams&, cudaStream_t, bool&);
template bool flashkda::decode_stream_tc_serves<float>(const flashkda::RecurrentParams&);
