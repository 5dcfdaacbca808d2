// Compile-time dispatch helpers: turn a run-time value into a constexpr inside a lambda body, so
// that kernels are selected without if/else ladders at every call site.
#pragma once

// Head dimensions with compiled kernels (K == V). Keep in sync with KERNEL_HEAD_DIMS in
// flashkda/_constants.py.
#define FLASHKDA_HEAD_DIM_SWITCH(DIM, CONST_NAME, ...)            \
  [&] {                                                           \
    if ((DIM) == 64) {                                            \
      constexpr static int CONST_NAME = 64;                       \
      return __VA_ARGS__();                                       \
    } else {                                                      \
      constexpr static int CONST_NAME = 128;                      \
      return __VA_ARGS__();                                       \
    }                                                             \
  }()
