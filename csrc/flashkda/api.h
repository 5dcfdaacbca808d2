// Entry points of the kernel library: one explicit instantiation per translation unit
// (csrc/kernels/*.cu). Errors come back as cudaError_t; nothing here aborts the process.
#pragma once

#include <cuda_runtime.h>

#include "flashkda/backward/chunk_bwd_params.h"
#include "flashkda/common/recurrent_params.h"
#include "flashkda/prefill/chunk_params.h"

namespace flashkda {

// Token-by-token recurrence (decode, speculative verification, short prefill).
// Elem: element type of q, k, v and o (float, __nv_bfloat16 or __half). D: head dim (K == V).
template <typename Elem, int D>
cudaError_t run_recurrent(const RecurrentParams& params, cudaStream_t stream);

// Head dim (K == V) of the persistent decode kernels (run_decode_stream, run_decode_stream_tc,
// run_decode_bulk).
constexpr int kDecodeBulkHeadDim = 128;

// sm_90 and sm_80 (A100) shared memory per SM and the part the hardware reserves per resident
// block (the occupancy arithmetic of decode_bulk.cuh and chunk_prepare.cuh).
constexpr int kSm90SmemPerSm = 228 * 1024;
constexpr int kSm80SmemPerSm = 164 * 1024;
constexpr int kSmemReservedPerBlock = 1024;

// Decode step for fp32 V-first states (decode_stream.cuh), any sm_80+ device. Sets `launched` to
// false, and launches nothing, when the case is not covered; the caller then tries the next kernel.
template <typename Elem>
cudaError_t run_decode_stream(const RecurrentParams& params, cudaStream_t stream, bool& launched);

// Decode step for bf16 V-first states with one token per sequence (decode_stream_tc.cuh), any
// sm_80+ device. Sets `launched` to false, and launches nothing, when the case is not covered.
template <typename Elem>
cudaError_t run_decode_stream_tc(const RecurrentParams& params, cudaStream_t stream, bool& launched);

// Decode step on sm_90 (decode_bulk.cuh), for the V-first cases it covers: StateT (float or
// __nv_bfloat16) is the element type of every state tensor given. Sets `launched` to false, and
// launches nothing, when the case is not covered or the current device has no sm_90 code of the
// kernel; the caller then runs run_recurrent's own kernel.
template <typename Elem, typename StateT>
cudaError_t run_decode_bulk(const RecurrentParams& params, cudaStream_t stream, bool& launched);

// Whether run_decode_stream, run_decode_stream_tc and run_decode_bulk would launch for these params
// (the case covered, the kernel resident on the current device): the facts run_recurrent's
// selector decides on (decode/decode_select.h).
template <typename Elem>
bool decode_stream_serves(const RecurrentParams& params);
template <typename Elem>
bool decode_stream_tc_serves(const RecurrentParams& params);
template <typename Elem, typename StateT>
bool decode_bulk_serves(const RecurrentParams& params);

// Chunked forward (prefill), K == V == chunk::kHeadDim. Launch order on one stream:
// run_chunk_index (varlen only), run_chunk_prepare, then run_chunk_recurrence with
// recurrence_pass kWhole, or with segments: run_chunk_recurrence (kSegmentLocal),
// run_chunk_segment_scan, run_chunk_recurrence (kSegmentOutput). Elem: __nv_bfloat16 or __half.
// kBlockV: value columns per block of chunk_recurrence (64 or 128).
cudaError_t run_chunk_index(const ChunkParams& params, cudaStream_t stream);
template <typename Elem>
cudaError_t run_chunk_prepare(const ChunkParams& params, cudaStream_t stream);
template <typename Elem, int kBlockV>
cudaError_t run_chunk_recurrence(const ChunkParams& params, cudaStream_t stream);
cudaError_t run_chunk_segment_scan(const ChunkParams& params, cudaStream_t stream);
// Dynamic shared memory (bytes) per block that the chunked kernels ask for, the largest of
// chunk_prepare, chunk_recurrence (either value split, both families) and chunk_segment_scan. A
// device with a smaller opt-in limit per block (sm_86, sm_89: 99 KB) cannot run them. The
// recurrence adds about 1 KB of static shared memory and alignment: 162 KB + 1 KB is the A100's
// limit, and no GPU has one in between.
int chunk_smem_bytes();

// Chunked backward: the per-chunk pass ChunkBwdParams::pass (chunk_local_grad.cuh), one block per
// (chunk, value head), K == V == chunk::kHeadDim; kScalarGate: g and dg [rows, HV] (GDN's gate, the
// gradients pass only). Its dynamic shared memory per block (bytes): devices with a smaller opt-in
// limit (sm_80: 163 KB) cannot run it.
template <chunk_bwd::Pass kPass, bool kScalarGate = false>
cudaError_t run_chunk_local_grad(const ChunkBwdParams& params, cudaStream_t stream);
int chunk_local_grad_smem_bytes();
// The gradients pass in value halves (chunk_local_grad_split.cuh), two blocks per (chunk, value head)
// of chunk_local_grad_split_smem_bytes() each (sm_80 has room): dq, dk, dg and dbeta must be
// zero-filled, each half adds its share.
template <bool kScalarGate>
cudaError_t run_chunk_local_grad_split(const ChunkBwdParams& params, cudaStream_t stream);
int chunk_local_grad_split_smem_bytes();
// The gradients of the states at chunk boundaries, walking each sequence's chunks backwards on the
// records of a chunked forward run with the same params (chunk_state_grad.cuh: the fields it reads
// in place of the forward's), any device that runs the chunked forward. Elem and kBlockV as
// run_chunk_recurrence's.
template <typename Elem, int kBlockV>
cudaError_t run_chunk_state_grad(const ChunkParams& params, cudaStream_t stream);
// The chunked backward's scans over chunks (chunk_state_scan.cuh), any sm_80+ device.
cudaError_t run_chunk_state_scan(const ChunkScanParams& params, cudaStream_t stream);
// The chunked backward's per-token work (chunk_bwd_tokens.cuh), D == chunk::kHeadDim, any sm_80+
// device.
cudaError_t run_chunk_bwd_tokens(const ChunkBwdTokenParams& params, ChunkBwdTokenPass pass, cudaStream_t stream);

// cudaSuccess when the current device can run this build's kernels, else the error of loading one
// (cudaErrorNoKernelImageForDevice: neither machine code for the device nor PTX it can compile).
// Every translation unit is built for the same architectures, so one kernel answers for all.
cudaError_t kernel_image_status();

}  // namespace flashkda
