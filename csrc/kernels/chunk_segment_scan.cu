// The segment scan of the chunked forward (one small kernel).
#include "flashkda/chunk_segment_scan.cuh"
