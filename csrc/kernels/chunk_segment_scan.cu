// The segment scan of the chunked forward (one small kernel), and the chunked kernels' shared-memory
// need (api.h).
#include "flashkda/api.h"
#include "flashkda/prefill/chunk_prepare.cuh"
#include "flashkda/prefill/chunk_recurrence.cuh"
#include "flashkda/prefill/chunk_segment_scan.cuh"

#include <algorithm>

int flashkda::chunk_smem_bytes() {
  using namespace flashkda::chunk;
  return std::max({int(sizeof(PrepareSmem)), RecurrenceShape<kHeadDim>::kSmemBytes,
                   RecurrenceShape<kHeadDim / 2>::kSmemBytes, ScanLayout::kBytes});
}
