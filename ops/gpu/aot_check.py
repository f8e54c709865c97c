"""Compile every Triton kernel for sm_90 without a GPU and report its resources.

Usage: ``python ops/gpu/aot_check.py [--arch 90] [--only NAME] [--json out.json] [--ptx DIR]``. Uses triton's bundled
ptxas/cuobjdump, so it runs on a CPU-only machine (not under TRITON_INTERPRET). Arguments get the
same 16-byte divisibility hints the JIT would derive from real tensors (pointers and the strides
that are multiples of 16 at Llama-8B shapes), so the code is the code the GPU will run. Prints one
line per kernel: registers, stack (spills), shared memory, 16-byte cp.async count, whether it
waits on the kernel before it (programmatic dependent launch, as served on sm_90), single-byte
shared loads (an e4m3 tile read a byte at a time); exit status 1
if a kernel fails to compile or a served (16-bit) kernel spills; float32 attention (a test path)
may spill and is only marked. ``--ptx DIR`` writes each kernel's instructions (no line or debug
info) to a file of its own: ``diff -r`` against another tree's DIR shows whether a refactor
changed the code at all.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine.kernels import activation_triton as act  # noqa: E402
from engine.kernels import attention_triton as att  # noqa: E402
from engine.kernels import fp8_triton as f8  # noqa: E402
from engine.kernels import kv_write_triton as kvw  # noqa: E402
from engine.kernels import moe_triton as moe  # noqa: E402
from engine.kernels import norm_triton as nrm  # noqa: E402
from engine.kernels import rope_triton as rop  # noqa: E402
from engine.kernels import sample_triton as smp  # noqa: E402

NO_HINT = {"s_bt", "NUM_SPLITS", "NUM_SEQS", "chunk", "V", "eps", "qk_scale", "M"}  # runtime values, not specialised


def attn_types(dt: str) -> dict:
    t = {n: "i32" for n in ("s_qn", "s_qh", "s_on", "s_oh", "s_kp", "s_kb", "s_kh", "s_vp", "s_vb", "s_vh",
                            "s_bt", "NUM_SPLITS", "NUM_SEQS", "chunk")}
    t.update(q_ptr=dt, kc_ptr=dt, vc_ptr=dt, out_ptr=dt, po_ptr="*fp32", plse_ptr="*fp32", qsl_ptr="*i32",
             sl_ptr="*i32", bt_ptr="*i32", lo_ptr="*i32", cpo_ptr="*fp32", cplse_ptr="*fp32", tiles_ptr="*i32",
             qk_scale="fp32")
    return t


# The 256-row prefill tiles spill and are still the fastest shapes: over 128 keys with packed
# probabilities (a 16-bit cache) 608 bytes a thread at triton 3.9 at G = 4, 680 at G = 7, 632 in float16,
# 453-465 TFLOP/s causal at 32k on the H100 against 426-433 for 64 keys (176 bytes) and 373 for
# the spill-free 128 x 128 (docs/perf.md, 2026-12-08; G = 7 not timed); over an e4m3 cache and
# with chunks the 64-key tile (120 and 248 bytes). Each bound sits a little above what was seen,
# so that growth shows.
SPILLS = {"prefill bf16 G=4 D=128 256-row": 640, "prefill bf16 G=7 D=128 256-row": 704,
          "prefill fp16 G=4 D=128 256-row": 656,
          "prefill fp8-kv G=4 D=128 256-row": 136, "prefill bf16 G=5 D=128 256-row chunked": 264}


def spill_bound(name: str) -> int:
    """The stack bytes a thread a served kernel may use: 16 (a frame, not a spill loop) but for
    the measured spills in ``SPILLS``."""
    return SPILLS.get(name, 16)


def specs(arch: int) -> list[tuple[str, object, dict, dict, dict]]:
    """(name, kernel, arg types, constexprs, launch options), the launch shapes as the engine
    picks them on ``arch``."""
    out = []
    cap = (arch // 10, arch % 10)
    for dt, prec in (("*bf16", "tf32"), ("*fp32", "ieee")):
        for g, hq, d in ((4, 32, 128), (7, 28, 128), (2, 4, 64)):
            bd = triton.next_power_of_2(d)
            bn = 32 if dt == "*fp32" else 64  # the launch shape paged_attention_triton picks
            for single in (True, False):
                out.append((f"decode {dt[1:]} G={g} D={d} single={single}", att._decode_kernel, attn_types(dt),
                            dict(HQ=hq, G=g, D=d, BLOCK_D=bd, BLOCK_SIZE=16, BLOCK_G=max(16, triton.next_power_of_2(g)),
                                 BLOCK_N=bn, SINGLE=single, DOT_PREC=prec, ASM_V=False, CS=att.CASCADE_SPLITS,
                                 CASC=False, CHUNKED=False),
                            dict(num_warps=4, num_stages=2)))
            # the launch shapes prefill_shape picks: a big step's, and a few chunks'
            for pm, pn, warps, stages in dict.fromkeys(att.prefill_shape(n, g, hq // g, dt == "*fp32", bd, 132,
                                                                             att.long_keys(cap, False, 0))
                                                       for n in (4096, 256)):
                pm = max(pm, triton.next_power_of_2(g))
                out.append((f"prefill {dt[1:]} G={g} D={d} {pm}-row", att._prefill_kernel, attn_types(dt),
                            dict(G=g, D=d, BLOCK_D=bd, BLOCK_SIZE=16, BLOCK_M=pm, BLOCK_N=pn, TPT=pm // g,
                                 DOT_PREC=prec, MIN_Q=2, ASM_V=False, CHUNKED=False,
                                 PACKED_EXP=att.packed_exp(pm, pn, torch.bfloat16 if dt == "*bf16" else torch.float32, cap)),
                            dict(num_warps=warps, num_stages=stages)))
        if dt == "*fp32":
            break
    # a float16 model's large tile: the packed exp in float16 (ex2.approx.f16x2)
    for pm, pn, warps, stages in dict.fromkeys([att.prefill_shape(4096, 4, 8, False, 128, 132, att.long_keys(cap, False, 0))]):
        out.append((f"prefill fp16 G=4 D=128 {pm}-row", att._prefill_kernel, attn_types("*fp16"),
                    dict(G=4, D=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=pm, BLOCK_N=pn, TPT=pm // 4, DOT_PREC="tf32",
                         MIN_Q=2, ASM_V=False, CHUNKED=False, PACKED_EXP=att.packed_exp(pm, pn, torch.float16, cap)),
                    dict(num_warps=warps, num_stages=stages)))
    fp8_kv = {**attn_types("*bf16"), "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"}
    out.append(("decode fp8-kv G=4 D=128", att._decode_kernel, fp8_kv,
                dict(HQ=32, G=4, D=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_N=64, SINGLE=False,
                     DOT_PREC="tf32", ASM_V=True, CS=att.CASCADE_SPLITS, CASC=False, CHUNKED=False),
                dict(num_warps=4, num_stages=2)))
    for pm, pn, warps, stages in dict.fromkeys(att.prefill_shape(n, 4, 8, False, 128, 132, att.long_keys(cap, True, 0))
                                               for n in (4096, 256)):
        out.append((f"prefill fp8-kv G=4 D=128 {pm}-row", att._prefill_kernel, fp8_kv,
                    dict(G=4, D=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=pm, BLOCK_N=pn, TPT=pm // 4, DOT_PREC="tf32",
                         MIN_Q=2, ASM_V=True, CHUNKED=False, PACKED_EXP=att.packed_exp(pm, pn, torch.bfloat16, cap)),
                    dict(num_warps=warps, num_stages=stages)))
    for single in (True, False):
        out.append((f"decode bf16 G=4 D=128 single={single} cascade", att._decode_kernel, attn_types("*bf16"),
                    dict(HQ=32, G=4, D=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_N=64, SINGLE=single,
                         DOT_PREC="tf32", ASM_V=False, CS=att.CASCADE_SPLITS, CASC=True, CHUNKED=False),
                    dict(num_warps=4, num_stages=2)))
    for name, types, asm_v, prec, bm in (("cascade bf16 G=4 D=128", attn_types("*bf16"), False, "tf32", 64),
                                         ("cascade fp8-kv G=4 D=128", fp8_kv, True, "tf32", 64),
                                         ("cascade fp32 G=4 D=128", attn_types("*fp32"), False, "ieee", 64)):
        out.append((name, att._cascade_kernel, types,
                    dict(HQ=32, G=4, D=128, BLOCK_D=128, BLOCK_SIZE=16, R=16, BLOCK_M=bm,
                         BLOCK_N=32 if prec == "ieee" else 64, CS=att.CASCADE_SPLITS, DOT_PREC=prec, ASM_V=asm_v),
                    dict(num_warps=4, num_stages=2)))
    out.append(("reduce", att._reduce_kernel, attn_types("*bf16"), dict(HQ=32, D=128, BLOCK_D=128, BLOCK_N=64, BLOCK_S=8, CS=att.CASCADE_SPLITS, CASC=True, CHUNKED=False),
                dict(num_warps=4)))
    # chunked local attention (Llama 4's attention_chunk_size): G = 5, head_dim 128 (Scout's 40 / 8 heads)
    for single in (True, False):
        out.append((f"decode bf16 G=5 D=128 single={single} chunked", att._decode_kernel, attn_types("*bf16"),
                    dict(HQ=40, G=5, D=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_N=64, SINGLE=single,
                         DOT_PREC="tf32", ASM_V=False, CS=att.CASCADE_SPLITS, CASC=False, CHUNKED=True),
                    dict(num_warps=4, num_stages=2)))
    for pm, pn, warps, stages in dict.fromkeys(att.prefill_shape(n, 5, 8, False, 128, 132, att.long_keys(cap, False, 8192))
                                               for n in (4096, 256)):
        pm = max(pm, 8)
        out.append((f"prefill bf16 G=5 D=128 {pm}-row chunked", att._prefill_kernel, attn_types("*bf16"),
                    dict(G=5, D=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_M=pm, BLOCK_N=pn, TPT=pm // 5, DOT_PREC="tf32",
                         MIN_Q=2, ASM_V=False, CHUNKED=True, PACKED_EXP=att.packed_exp(pm, pn, torch.bfloat16, cap)),
                    dict(num_warps=warps, num_stages=stages)))
    out.append(("reduce chunked", att._reduce_kernel, attn_types("*bf16"),
                dict(HQ=40, D=128, BLOCK_D=128, BLOCK_N=64, BLOCK_S=8, CS=att.CASCADE_SPLITS, CASC=False, CHUNKED=True),
                dict(num_warps=4)))
    st = dict(logits_ptr="*fp32", temp_ptr="*fp32", topk_ptr="*i32", topp_ptr="*fp32", minp_ptr="*fp32",
              seed_ptr="*i64", step_ptr="*i64", out_ptr="*i64", cand_ptr="*fp32", keep_ptr="*i8", s_row="i32",
              V="i32")
    out.append(("sample", smp._sample_kernel, st, dict(BLOCK=2048, BLOCK_P=256, NP=16, CAP=smp.CANDIDATE_CAP,
                                                      C_BITS=smp.CANDIDATE_P_BITS, WRITE_KEEP=False),
                dict(num_warps=8)))
    bf = "*bf16"
    for has in (False, True):
        for quant in (False, True):
            out.append((f"rms_norm res={has} fp8={quant}", nrm._rms_norm_kernel,
                        dict(x_ptr=bf, r_ptr=bf, w_ptr=bf, out_ptr="*fp8e4nv" if quant else bf, res_out_ptr=bf,
                             scale_ptr="*fp32", s_x="i32", s_r="i32", s_o="i32", s_ro="i32", eps="fp32"),
                        dict(H=4096, BLOCK=4096, HAS_RES=has, QUANT=quant), dict(num_warps=8)))
    out.append(("quantize_rows fp8", f8._quantize_rows_kernel,
                dict(x_ptr=bf, q_ptr="*fp8e4nv", s_ptr="*fp32", s_x="i32", s_q="i32"), dict(K=4096, BLOCK=4096),
                dict(num_warps=8)))
    out.append(("silu_and_mul fp8", act._silu_mul_quant_kernel,
                dict(x_ptr=bf, q_ptr="*fp8e4nv", s_ptr="*fp32", s_x="i32", s_q="i32"), dict(I=14336, BLOCK=16384),
                dict(num_warps=16)))
    for n, k, m in ((6144, 4096, 1), (4096, 14336, 1), (28672, 4096, 64), (4096, 14336, 64), (4096, 14336, 128)):
        cfg = f8.small_m_config(n, k, m)
        kps = triton.cdiv(triton.cdiv(k, cfg["split_k"]), cfg["block_k"]) * cfg["block_k"]
        for atomic in (False, True):
            out.append((f"fp8 small-M M={m} tile {cfg['block_m']} N={n} K={k} atomic={atomic}", f8._small_m_kernel,
                        dict(a_ptr="*fp8e4nv", as_ptr="*fp32", w_ptr="*fp8e4nv", ws_ptr="*fp32", b_ptr=bf,
                             y_ptr="*fp32" if atomic else bf, M="i32", N="i32", K="i32", s_a="i32", s_w="i32",
                             s_y="i32"),
                        dict(HAS_BIAS=False, ATOMIC=atomic, BLOCK_M=cfg["block_m"], BLOCK_N=cfg["block_n"], BLOCK_K=cfg["block_k"],
                             K_PER_SPLIT=kps), dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])))
    out.append(("rope", rop._rope_kernel, dict(q_ptr=bf, k_ptr=bf, pos_ptr="*i64", cs_ptr="*fp32", s_qn="i32",
                                              s_qh="i32", s_kn="i32", s_kh="i32", s_cs="i32"),
                dict(HQ=32, HK=8, HALF=64, BLOCK_HQ=32, BLOCK_HK=8, BLOCK_HALF=64, INTERLEAVED=False), dict(num_warps=4)))
    out.append(("rope interleaved", rop._rope_kernel, dict(q_ptr=bf, k_ptr=bf, pos_ptr="*i64", cs_ptr="*fp32",
                                                          s_qn="i32", s_qh="i32", s_kn="i32", s_kh="i32", s_cs="i32"),
                dict(HQ=40, HK=8, HALF=64, BLOCK_HQ=64, BLOCK_HK=8, BLOCK_HALF=64, INTERLEAVED=True), dict(num_warps=4)))
    out.append(("silu_and_mul", act._silu_mul_kernel, dict(x_ptr=bf, out_ptr=bf, s_x="i32", s_o="i32"),
                dict(I=14336, BLOCK=2048), dict(num_warps=4)))
    mt = dict(a_ptr=bf, w_ptr=bf, ws_ptr="*fp32", out_ptr=bf, pair_ids_ptr="*i32", tile_expert_ptr="*i32",
              weights_ptr="*fp32", num_pairs="i32", n_out="i32", k_in="i32", s_a="i32", s_we="i32", s_wn="i32", s_o="i32")
    # Qwen3-30B-A3B: 128 experts, top 8; gate-up (gated: two accumulators, 64 columns by default)
    # then down
    for per_pair in (False, True):
        for fp8_w in (False, True):  # FP8 experts: e4m3 weights widened in the kernel
            out.append((f"moe grouped gemm per_pair={per_pair}" + (" fp8" if fp8_w else ""), moe._grouped_gemm_kernel,
                        {**mt, "w_ptr": "*fp8e4nv"} if fp8_w else mt,
                        dict(TOP_K=8, PER_PAIR=per_pair, APPLY_WEIGHTS=per_pair, SCALED=fp8_w, WEIGH_INPUT=False,
                             GATED=not per_pair, BLOCK_M=16, BLOCK_N=128 if per_pair else 64, BLOCK_K=64),
                        dict(num_warps=4)))
    for per_pair in (False, True):  # prefill-sized steps: 64-row tiles (moe.tile_rows)
        out.append((f"moe grouped gemm per_pair={per_pair} tall", moe._grouped_gemm_kernel, mt,
                    dict(TOP_K=8, PER_PAIR=per_pair, APPLY_WEIGHTS=per_pair, SCALED=False, WEIGH_INPUT=False,
                         GATED=not per_pair, BLOCK_M=64, BLOCK_N=128 if per_pair else 64, BLOCK_K=64),
                    dict(num_warps=4)))
    from engine.kernels import moe_route_triton as mrt

    for e, k, softmax in ((128, 8, True), (8, 2, True), (16, 1, False)):  # Qwen3-30B-A3B, Mixtral, Llama 4
        out.append((f"moe route E={e} k={k}", mrt._route_kernel,
                    dict(logits_ptr=bf, weights_ptr="*fp32", experts_ptr="*i64", n_tokens="i32", s_l="i32"),
                    dict(E=e, TOP_K=k, SOFTMAX=softmax, RENORMALIZE=softmax, BLOCK_N=min(16, 4096 // e), BLOCK_E=e,
                         BLOCK_K=k), dict(num_warps=4)))
    from engine.kernels import moe_align_triton as mal

    for pairs, e in ((8, 128), (1024, 128), (4096, 128), (2, 8)):  # batch 1, 128, 512 of Qwen3-30B-A3B; 1 of Mixtral
        block_e, slots = triton.next_power_of_2(e), -(-(pairs + e * 15) // 16) * 16
        out.append((f"moe align pairs={pairs} E={e}", mal._align_kernel,
                    dict(experts_ptr="*i64", pair_ids_ptr="*i32", tile_expert_ptr="*i32", scratch_ptr="*i32", P="i32",
                         E="i32", SLOTS="i32", TILES="i32"),
                    dict(BLOCK_P=max(16, triton.next_power_of_2(pairs)), BLOCK_E=block_e,
                         BLOCK_T=triton.next_power_of_2(slots // 16), BLOCK_S=triton.next_power_of_2(slots), BLOCK_M=16,
                         SEARCH_STEPS=e.bit_length() + 1), dict(num_warps=mal.align_warps(pairs))))
    for fp8_w in (False, True):  # Llama 4 Scout's gate-up: 16 experts, top 1, the sigmoid score on the input
        out.append(("moe grouped gemm weigh_input" + (" fp8" if fp8_w else ""), moe._grouped_gemm_kernel,
                    {**mt, "w_ptr": "*fp8e4nv"} if fp8_w else mt,
                    dict(TOP_K=1, PER_PAIR=False, APPLY_WEIGHTS=False, SCALED=fp8_w, WEIGH_INPUT=True, GATED=True,
                         BLOCK_M=16, BLOCK_N=64, BLOCK_K=64), dict(num_warps=4)))
    kt = {n: "i32" for n in kvw._kv_write_kernel.arg_names}
    kt.update(k_ptr=bf, v_ptr=bf, kc_ptr=bf, vc_ptr=bf, slot_ptr="*i64")
    out.append(("write_kv", kvw._kv_write_kernel, kt, dict(H=8, D=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128,
                                                          FP8_CACHE=False), dict(num_warps=4)))
    out.append(("write_kv fp8-kv", kvw._kv_write_kernel, {**kt, "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv"},
                dict(H=8, D=128, BLOCK_SIZE=16, BLOCK_H=8, BLOCK_D=128, FP8_CACHE=True), dict(num_warps=4)))
    return out


def _waits_first(ptx: str) -> bool:
    """Whether the kernel's first global memory access comes after its first griddepcontrol.wait."""
    wait = ptx.find("griddepcontrol.wait")
    first = min((i for i in (ptx.find(op) for op in ("ld.global", "st.global", "atom.", "red.", "cp.async"))
                 if i >= 0), default=len(ptx))
    return 0 <= wait < first


def instructions(ptx: str) -> str:
    """A kernel's PTX without what moves with the source's line numbers (``.loc``/``.file`` lines,
    the debug labels, the DWARF sections): two trees' outputs are equal when their code is."""
    body = ptx.split("\t.section\t.debug", 1)[0]
    return "\n".join(ln for ln in body.splitlines() if not ln.lstrip().startswith((".loc", ".file", "$L__tmp")))


def compile_one(kernel, types: dict, consts: dict, opts: dict, arch: int) -> dict:
    names = kernel.arg_names
    if "PDL" in names and "PDL" not in consts:  # as the launcher runs them: PDL from sm_90
        consts = {**consts, "PDL": arch >= 90}
        opts = {**opts, "launch_pdl": True} if arch >= 90 else opts
    sig = {n: ("constexpr" if n in consts else types[n]) for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in consts and n not in NO_HINT and (sig[n].startswith("*") or sig[n] == "i32")}
    src = ASTSource(fn=kernel, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=opts)
    ptx = k.asm["ptx"]
    res = {"shared": k.metadata.shared,
           "cp_async_16B": len(re.findall(r"cp\.async\.c[ag]\.shared\.global[^;]*0x10", ptx)),
           "griddep_wait": ptx.count("griddepcontrol.wait"),
           "waits_first": _waits_first(ptx),
           "ld_shared_b8": ptx.count("ld.shared.b8"), "code": instructions(ptx)}
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True, check=False).stdout
    for key in ("REG", "STACK", "LOCAL"):
        m = re.search(rf"\b{key}:(\d+)", usage)
        res[key.lower()] = int(m.group(1)) if m else None
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ptx", type=Path, help="folder: each kernel's instructions (instructions()), one file a "
                                              "spec, to diff against another tree's (a refactor that must not "
                                              "change code)")
    ap.add_argument("--only", default="", help="compile only the specs whose name contains this")
    args = ap.parse_args()
    if args.ptx:
        args.ptx.mkdir(parents=True, exist_ok=True)
    rows, bad = [], 0
    for name, kernel, types, consts, opts in specs(args.arch):
        if args.only not in name:
            continue
        try:
            r = compile_one(kernel, types, consts, opts, args.arch)
            r["spill_bound"] = spill_bound(name)
            r["ok"] = (r.get("stack") or 0) <= r["spill_bound"] or "fp32" in name  # float32: a test path
        except Exception as e:  # report every kernel, not just the first failure
            r = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        r["kernel"] = name
        code = r.pop("code", None)
        if args.ptx and code is not None:
            (args.ptx / (re.sub(r"\W+", "_", name).strip("_") + ".ptx")).write_text(code)
        bad += not r["ok"]
        rows.append(r)
        print(f"{name:40s} " + (f"regs {r['reg']:>3} stack {r['stack']:>4} shared {r['shared']:>6} "
                                f"cp.async16 {r['cp_async_16B']:>3} pdl {r['griddep_wait']} ld.b8 {r['ld_shared_b8']:>3}" if "error" not in r else r["error"])
              + ("" if r["ok"] else "  <-- FAIL")
              + (f"  (spills: {'fp32 test path' if 'fp32' in name else 'bounded, see spill_bound'})"
                 if r["ok"] and (r.get("stack") or 0) > 16 else ""),
              flush=True)
    if args.json:
        args.json.write_text(json.dumps({"arch": args.arch, "triton": triton.__version__, "rows": rows}, indent=2))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
