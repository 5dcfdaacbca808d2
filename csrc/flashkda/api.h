// Entry points of the kernel library: one explicit instantiation per translation unit
// (csrc/kernels/*.cu). Errors come back as cudaError_t; nothing here aborts the process.
#pragma once

#include <cuda_runtime.h>

#include "recurrent_params.h"

namespace flashkda {

// Token-by-token recurrence (decode, speculative verification, short prefill).
// Elem: element type of q, k, v and o (float, __nv_bfloat16 or __half). D: head dim (K == V).
template <typename Elem, int D>
cudaError_t run_recurrent(const RecurrentParams& params, cudaStream_t stream);

}  // namespace flashkda
