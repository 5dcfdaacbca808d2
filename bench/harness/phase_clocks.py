"""Copy csrc/ to OUT_DIR and insert clock marks into chunk_prepare.cuh for prepare_harness.cu
(-DPHASE_CLOCKS): a mark before every line that starts with one of MARKS, and one at the kernel's end.

    python bench/harness/phase_clocks.py csrc /tmp/pc/csrc
"""

import shutil
import sys

# Lines before which a mark goes; thread 0 (warp 0: an off-diagonal block position of the A / M
# products, then the inverse) takes the time, so other warps' work shows only where warp 0 waits for
# it at a barrier.
MARKS = ["  // ---- Phase", "  // This slice's offsets", "  // Per channel, once",
         "  const int wide_mask = s.wide_mask;", "  // Stage", "  // Off-diagonal blocks", "  // T = L diag"]
MACRO = ("#define FKDA_MARK { if (threadIdx.x == 0) { const long long now_ = clock64(); "
         "atomicAdd(&g_phase_cycles[fkda_phase++], (unsigned long long)(now_ - fkda_last)); fkda_last = now_; } }\n")


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    path = f"{dst}/flashkda/prefill/chunk_prepare.cuh"
    text = open(path).read()
    anchor = "PrepareSmem& s = *reinterpret_cast<PrepareSmem*>(smem_raw);\n"
    assert anchor in text
    text = text.replace(anchor, anchor + "  long long fkda_last = clock64(); int fkda_phase = 0;\n", 1)
    kernel_at = text.index("chunk_prepare_kernel(")
    launch_at = text.index("cudaError_t launch_prepare(")
    end_at = text.rindex("template <", 0, launch_at)  # the launcher's template line ends the kernel body
    body = text[kernel_at:end_at]
    for m in MARKS:
        pos, out = 0, ""
        while (i := body.find("\n" + m, pos)) >= 0:
            out += body[pos:i + 1] + "  FKDA_MARK\n"
            pos = i + 1
        body = out + body[pos:]
    body = body[: body.rindex("}")] + "  FKDA_MARK\n}" + body[body.rindex("}") + 1:]
    # The phase each mark closes, in the order of the source (the harness prints them by index).
    labels, at = [], 0
    while (i := body.find("FKDA_MARK", at)) >= 0:
        nxt = body.find("\n", i + len("FKDA_MARK") + 1)
        labels.append(body[i + len("FKDA_MARK\n"):nxt].strip()[:60] if nxt > 0 else "end")
        at = i + 1
    text = MACRO + text[:kernel_at] + body + text[end_at:]
    open(path, "w").write(text)
    print("marks:", body.count("FKDA_MARK"))
    for n, label in enumerate(labels):
        print(f"  phase {n:2d} ends before: {label}")


if __name__ == "__main__":
    main()
