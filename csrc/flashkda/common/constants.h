// Numerical constants of the contract, shared by the kernels and the binding. Mirrored in
// flashkda/_constants.py (tests/test_api.py, test_cuda_constants_match_python, checks that they agree).
#pragma once

namespace flashkda {

// q / sqrt(sum(q^2) + kL2NormEps) under use_qk_l2norm_in_kernel.
constexpr float kL2NormEps = 1e-6f;
// softplus(x) = x above this threshold, log1p(exp(x)) below it.
constexpr float kSoftplusThreshold = 20.0f;
// lower_bound of the sigmoid gate lies in [kLowerBoundMin, 0).
constexpr double kLowerBoundMin = -5.0;

}  // namespace flashkda
