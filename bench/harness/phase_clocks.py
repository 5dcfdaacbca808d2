"""Copy csrc/ to OUT_DIR and insert clock marks into chunk_prepare.cuh for prepare_harness.cu
(-DPHASE_CLOCKS): a mark before every line that starts with one of MARKS, and one at the kernel's end.

    python bench/harness/phase_clocks.py csrc /tmp/pc/csrc
"""

import shutil
import sys

MARKS = ["  // ---- Phase", "  __syncthreads();  // raw gate", "  // Per channel: sub-chunk totals",
         "  if (ts == 0) {", "  {\n    // Pivot of this sub-chunk", "  float* amat = s.qi;", "  if (wide_mask != 0)",
         "  // Off-diagonal blocks", "  // T = L diag"]
MACRO = ("#define FKDA_MARK { if (threadIdx.x == 0) { const long long now_ = clock64(); "
         "atomicAdd(&g_phase_cycles[fkda_phase++], (unsigned long long)(now_ - fkda_last)); fkda_last = now_; } }\n")


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    path = f"{dst}/flashkda/chunk_prepare.cuh"
    text = open(path).read()
    anchor = "PrepareSmem& s = *reinterpret_cast<PrepareSmem*>(smem_raw);\n"
    assert anchor in text
    text = text.replace(anchor, anchor + "  long long fkda_last = clock64(); int fkda_phase = 0;\n", 1)
    kernel_at = text.index("chunk_prepare_kernel(")
    end_at = text.index("template <typename Elem>\ncudaError_t launch_prepare")
    body = text[kernel_at:end_at]
    for m in MARKS:
        pos, out = 0, ""
        while (i := body.find("\n" + m, pos)) >= 0:
            out += body[pos:i + 1] + "  FKDA_MARK\n"
            pos = i + 1
        body = out + body[pos:]
    body = body[: body.rindex("}")] + "  FKDA_MARK\n}" + body[body.rindex("}") + 1:]
    text = MACRO + text[:kernel_at] + body + text[end_at:]
    open(path, "w").write(text)
    print("marks:", body.count("FKDA_MARK"))


if __name__ == "__main__":
    main()
