// The varlen chunk index (one small kernel).
#include "flashkda/chunk_index.cuh"
