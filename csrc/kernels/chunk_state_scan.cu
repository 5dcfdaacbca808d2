// The chunked backward's scans over chunks (one small kernel).
#include "flashkda/backward/chunk_state_scan.cuh"
