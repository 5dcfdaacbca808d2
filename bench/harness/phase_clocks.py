"""Copy csrc/ to OUT_DIR and insert clock marks into one kernel for its harness (-DPHASE_CLOCKS): a
mark before every line of the kernel that starts with one of the target's marks, and one at the
kernel's end. Targets: prepare (chunk_prepare.cuh, prepare_harness.cu) and local_grad
(chunk_local_grad.cuh's gradients pass, local_grad_harness.cu).

    python bench/harness/phase_clocks.py csrc /tmp/pc/csrc [prepare|local_grad]
"""

import shutil
import sys

MACRO = ("#define FKDA_MARK { if (threadIdx.x == 0) { const long long now_ = clock64(); "
         "atomicAdd(&g_phase_cycles[fkda_phase++], (unsigned long long)(now_ - fkda_last)); fkda_last = now_; } }\n")

# Thread 0 takes the time, so other warps' work shows only where warp 0 waits for it at a barrier.
# Per target: the header, the line after which the clock starts, the kernel's first and the text
# after its end, and the lines before which a mark goes (none of them inside a loop).
TARGETS = {
    # warp 0: an off-diagonal block position of the A / M products, then the inverse
    "prepare": ("flashkda/prefill/chunk_prepare.cuh", "PrepareSmem& s = *reinterpret_cast<PrepareSmem*>(smem_raw);\n",
                "chunk_prepare_kernel(", "cudaError_t launch_prepare(",
                ["  // ---- Phase", "  // This slice's offsets", "  // Per channel, once",
                 "  const int wide_mask = s.wide_mask;", "  // Stage", "  // Off-diagonal blocks", "  // T = L diag"]),
    # warp 0: Γ's channels 0-31, a diagonal block of the solve, then rows 0-15 of every product
    "local_grad": ("flashkda/backward/chunk_local_grad.cuh", "  const SquareTile Lt = blk.template tile<SquareTile>(SmemLayout::kL);\n",
                   "chunk_local_grad_kernel(const ChunkBwdParams p)", "}  // namespace chunk_bwd",
                   ["  build_gram_operands();\n  __syncthreads();\n  gram_products", "  gram_products(blk",
                    "  // L and T (the solve", "  // k̂ e^Γ from", "    cute::cp_async_wait<0>();  // S and dO",
                    "    // e^{Γ_C} Σ_v S dS'", "    SquareAcc dM;", "    if constexpr (!kScalar) blk.copy_state_async(St", "    const ChunkTile dwt",
                    "    const SquareTile X1", "      SquareAcc y;", "      // G = −strict_tril", "    if constexpr (!kScalar) {  // the operands",
                    "    add_gram_grads(blk", "    if (raw_grads) {  // through", "    // dg: suffix sums"]),
}


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    header, anchor, kernel_start, after_kernel, marks = TARGETS[sys.argv[3] if len(sys.argv) > 3 else "prepare"]
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    path = f"{dst}/{header}"
    text = open(path).read()
    assert anchor in text
    text = text.replace(anchor, anchor + "  long long fkda_last = clock64(); int fkda_phase = 0;\n", 1)
    kernel_at = text.index(kernel_start)
    end_at = text.index(after_kernel)
    if after_kernel.startswith("cudaError_t"):  # the launcher's template line ends the kernel body
        end_at = text.rindex("template <", 0, end_at)
    body = text[kernel_at:end_at]
    for m in marks:
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
