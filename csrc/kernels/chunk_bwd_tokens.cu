// The chunked backward's per-token work: preprocessed inputs and the gradients back through them.
#include "flashkda/backward/chunk_bwd_tokens.cuh"
