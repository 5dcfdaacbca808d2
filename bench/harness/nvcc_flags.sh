# Sourced by the harness scripts: $flags, the nvcc flags of a harness build for sm_90a, with the
# CuTe/CUTLASS headers from where setup.py finds them (CUTLASS_HOME, third_party/cutlass, the wheel).
cutlass=$(python3 -c "import setup; print(setup.find_cutlass_include())") || exit 1
flags="-std=c++17 -O3 -I$cutlass -gencode arch=compute_90a,code=sm_90a --expt-relaxed-constexpr"
