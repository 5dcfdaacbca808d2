// The varlen chunk index (one small kernel).
#include "flashkda/prefill/chunk_index.cuh"
