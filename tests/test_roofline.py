"""The roofline over a compiled step (jaxpar.planning.roofline): its arithmetic on a hand-made HLO
module, and its FLOP count on dots that XLA:TPU rewrites as dilated convolutions."""

import importlib.util

import pytest

from jaxpar.planning import roofline
from jaxpar.planning.hardware import Chip

# 100 TFLOP/s, 1 TB/s of HBM, 50 GB/s a link and direction: a kind with no data sheet, so every
# dtype runs at the one peak.
CHIP = Chip("test chip", 1e9, 100e12, 1e12, 50e9, 1, 2, "made up for the test")

MODULE = """HloModule roof, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  ROOT %s = f32[] add(%a, %b)
}

%fused_dot (p0: bf16[64,128], p1: bf16[128,256]) -> f32[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %d = f32[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%slice_row (i: s32[], s: f32[4,1024]) -> f32[1,1024] {
  %i = s32[] parameter(0)
  %s = f32[4,1024]{1,0} parameter(1)
  %zero = s32[] constant(0)
  ROOT %ds = f32[1,1024]{1,0} dynamic-slice(%s, %i, %zero), dynamic_slice_sizes={1,1024}
}

%fused_row (s0: f32[4,1024], i: s32[]) -> f32[1024] {
  %s0 = f32[4,1024]{1,0} parameter(0)
  %i = s32[] parameter(1)
  %ds = f32[1,1024]{1,0} fusion(%i, %s0), kind=kLoop, calls=%slice_row
  ROOT %b = f32[1024]{0} bitcast(%ds)
}

%cond (p: (s32[], f32[4,1024])) -> pred[] {
  %p = (s32[], f32[4,1024]) parameter(0)
  %j = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(4)
  ROOT %lt = pred[] compare(%j, %n), direction=LT
}

%body (p: (s32[], f32[4,1024])) -> (s32[], f32[4,1024]) {
  %p = (s32[], f32[4,1024]) parameter(0)
  %j = s32[] get-tuple-element(%p), index=0
  %stack = f32[4,1024]{1,0} get-tuple-element(%p), index=1
  %row = f32[1024]{0} fusion(%stack, %j), kind=kLoop, calls=%fused_row
  ROOT %t = (s32[], f32[4,1024]) tuple(%j, %stack)
}

%cheap (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  ROOT %n = f32[1024]{0} negate(%x)
}

%dear (x: f32[1024]) -> f32[1024] {
  %x = f32[1024]{0} parameter(0)
  %e = f32[1024]{0} exponential(%x)
  ROOT %e2 = f32[1024]{0} exponential(%e)
}

ENTRY %main (x: bf16[64,128], w: bf16[128,256], v: f32[1024], init: (s32[], f32[4,1024]), q: pred[]) -> f32[2048] {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %v = f32[1024]{0} parameter(2)
  %init = (s32[], f32[4,1024]) parameter(3)
  %q = pred[] parameter(4)
  %ars = f32[1024]{0} all-reduce-start(%v), replica_groups={{0,1}}, to_apply=%add
  %mm = f32[64,256]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_dot
  %ard = f32[1024]{0} all-reduce-done(%ars)
  %loop = (s32[], f32[4,1024]) while(%init), condition=%cond, body=%body
  %c = f32[1024]{0} conditional(%q, %v, %v), true_computation=%cheap, false_computation=%dear
  ROOT %ag = f32[2048]{0} all-gather(%ard), replica_groups={{0,1}}, dimensions={0}
}
"""


def test_roofline_arithmetic_on_a_hand_made_module():
    r = roofline.estimate(MODULE, CHIP, devices=2)
    dot_flops = 2 * 64 * 256 * 128
    dot_bytes = 64 * 128 * 2 + 128 * 256 * 2 + 64 * 256 * 4  # memory-bound: 147 KB at 1 TB/s
    row_bytes = 4 * (1024 + 1 + 1024)  # the slice a nested fusion reads (not the stack), the index, the row
    branch_bytes = 4 * 1024 * 4  # the dearer branch: two exponentials, each reads and writes
    all_reduce = 4096 * 1 / (2 * 50e9)  # 2(n-1)/n of 4 KiB over a ring of two links
    all_gather = 8192 * 0.5 / (2 * 50e9)  # synchronous: all of it exposed
    assert all_reduce < dot_bytes / 1e12  # so the fusion scheduled inside it hides it
    assert r["hlo_flops_per_chip"] == dot_flops
    assert r["hbm_bytes_per_chip"] == dot_bytes + 4 * row_bytes + branch_bytes
    assert r["comm_s"] == pytest.approx(all_reduce + all_gather)
    assert r["exposed_comm_s"] == pytest.approx(all_gather)
    assert r["compute_bound_s"] == 0
    assert r["step_s"] == pytest.approx((dot_bytes + 4 * row_bytes + branch_bytes) / 1e12 + all_gather)
    faster_memory = roofline.estimate(MODULE, Chip(**{**CHIP.__dict__, "hbm_bytes_per_s": 1e15}), devices=2)
    assert faster_memory["compute_bound_s"] == pytest.approx(dot_flops / 100e12)  # now the dot is FLOP-bound


def test_a_multi_line_attribute_stays_with_its_instruction():
    text = MODULE.replace("kind=kOutput, calls=%fused_dot", 'kind=kOutput, calls=%fused_dot, '
                          'frontend_attributes={kernel_metadata={\n"xprof":"{}"\n}}')
    assert roofline.estimate(text, CHIP, 2) == roofline.estimate(MODULE, CHIP, 2)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None, reason="libtpu is not installed (the tpu extra)")
@pytest.mark.parametrize("spec, shapes", [
    ("bhtd,bhsd->bhts", [(2, 4, 32, 8), (2, 4, 32, 8)]),  # attention's scores at the tiny shape
    ("bhts,bhsd->bhtd", [(2, 4, 32, 32), (2, 4, 32, 8)]),
    ("nc,cf->nf", [(64, 32), (32, 128)]),
    ("nc,cshd->nshd", [(64, 32), (32, 3, 4, 8)]),
])
def test_dots_counted_exactly_when_xla_tpu_writes_them_as_convolutions(spec, shapes):
    import jax
    import jax.numpy as jnp

    from jaxpar.planning.hardware import parse_target, target_devices
    device = target_devices(parse_target("tpu:v5e-8"))[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16, sharding=sharding) for s in shapes]
    f = jax.jit(lambda a, b: jnp.einsum(spec, a, b, preferred_element_type=jnp.float32))
    text = f.lower(*args).compile().as_text()
    letters = dict(zip(spec.split("->")[0].replace(",", ""), [d for s in shapes for d in s]))
    expected = 2 * jax.numpy.prod(jnp.array([letters[c] for c in set(letters)])).item()
    assert roofline.estimate(text, CHIP, 1)["hlo_flops_per_chip"] == expected


def test_megablox_kernels_count_their_grouped_flops():
    """gmm (rows by groups of matrices) and tgmm (each group's weight gradient), as XLA:TPU names
    their custom calls: 2 m k n each, over the rows they are given, in their operands' dtype."""
    from jaxpar.planning.hlo_ops import op_flops, parse
    text = """ENTRY %main (g: s32[4], x: bf16[512,64], w: bf16[4,64,96], d: f32[512,96]) -> bf16[4,64,96] {
  %g = s32[4]{0} parameter(0)
  %x = bf16[512,64]{1,0} parameter(1)
  %w = bf16[4,64,96]{2,1,0} parameter(2)
  %d = f32[512,96]{1,0} parameter(3)
  %gmm.1 = f32[512,96]{1,0} custom-call(%g, %x, %w), custom_call_target="tpu_custom_call"
  ROOT %tgmm.1 = bf16[4,64,96]{2,1,0} custom-call(%g, %x, %d), custom_call_target="tpu_custom_call"
}
"""
    comps, _, entry = parse(text)
    ops = {o.name: o for o in comps[entry]}
    shapes = {o.name: o.shape for o in comps[entry]}
    assert op_flops(ops["gmm.1"], comps, shapes) == {"bf16": 2 * 512 * 64 * 96}
    assert op_flops(ops["tgmm.1"], comps, shapes) == {"bf16": 2 * 512 * 64 * 96}


GROUPED = """ENTRY %main (g: s32[4], x: bf16[512,64], w: bf16[4,64,96], d: f32[512,96], v: bf16[64,96]) -> f32[512,96] {
  %g = s32[4]{0} parameter(0)
  %x = bf16[512,64]{1,0} parameter(1)
  %w = bf16[4,64,96]{2,1,0} parameter(2)
  %d = f32[512,96]{1,0} parameter(3)
  %v = bf16[64,96]{1,0} parameter(4)
  %gmm.1 = f32[512,96]{1,0} custom-call(%g, %x, %w), custom_call_target="tpu_custom_call"
  %tgmm.1 = bf16[4,64,96]{2,1,0} custom-call(%g, %x, %d), custom_call_target="tpu_custom_call"
  %ragged-dot-none.2 = f32[512,96]{1,0} custom-call(%g, %x, %w), custom_call_target="tpu_custom_call"
  %rd = f32[512,96]{1,0} ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}
  ROOT %dense = f32[512,96]{1,0} dot(%x, %v), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""


def test_grouped_gemms_are_charged_at_the_routed_rows():
    """A dispatch's buffer of ep x the routed rows (here 8): the grouped GEMMs (Megablox's gmm and
    tgmm, XLA:TPU's ragged-dot kernel, an HLO ragged-dot) are charged an eighth of its FLOPs and
    of their rows' bytes, the groups' matrices whole; a dense dot is charged all of its own."""
    one = 2 * 512 * 64 * 96
    fast = Chip(**{**CHIP.__dict__, "hbm_bytes_per_s": 1e18})  # every op FLOP-bound
    whole, routed = (roofline.estimate(GROUPED, fast, 1, routed_share=share) for share in (1.0, 1 / 8))
    assert whole["hlo_flops_per_chip"] == 5 * one and whole["unrouted_flops_per_chip"] == 0
    assert routed["hlo_flops_per_chip"] == pytest.approx(4 * one / 8 + one)
    assert routed["unrouted_flops_per_chip"] == pytest.approx(4 * one * 7 / 8)
    assert routed["step_s"] == pytest.approx((4 * one / 8 + one) / 100e12)
    rows = 512 * 64 * 2 + 512 * 96 * 4  # gmm: x in, its result out
    gmm_bytes = 16 + rows / 8 + 4 * 64 * 96 * 2
    by_share = {share: roofline.Roofline(GROUPED, fast, 1, share) for share in (1.0, 1 / 8)}
    gmm = next(o for o in by_share[1.0].comps[by_share[1.0].entry] if o.name == "gmm.1")
    shapes = {o.name: o.shape for o in by_share[1.0].comps[by_share[1.0].entry]}
    assert by_share[1.0].op_cost(gmm, shapes).bytes == 16 + rows + 4 * 64 * 96 * 2
    assert by_share[1 / 8].op_cost(gmm, shapes).bytes == pytest.approx(gmm_bytes)


def test_the_dispatch_buffer_is_ep_times_the_routed_rows_or_what_a_capacity_leaves():
    from conftest import tiny_config

    from jaxpar.planning.estimate import dispatch_rows_factor
    m = tiny_config("tiny_moe").model  # 4 experts, 2 a token, 32 tokens a sequence
    assert dispatch_rows_factor(m, "local", 1) == 1
    assert dispatch_rows_factor(m, "ragged", 4) == dispatch_rows_factor(m, "replicated", 4) == 4
    capped = tiny_config("tiny_moe", **{"model.moe_capacity_factor": 2.0}).model
    # room: 1 expert a device x capacity ceil(2 x 32 x 2 / 4) = 32 rows a sequence, of its 64 assignments
    assert dispatch_rows_factor(capped, "ragged", 4) == 4 * 32 / 64
    assert dispatch_rows_factor(tiny_config().model, "local", 1) == 1  # no experts


# A dispatch over ep=4 chips, each with 256 routed rows (its tokens x k) of 64: the dispatch's
# receive buffer has room for 4 x 256 (every source's, dropless), the combine sends its rows back.
RAGGED = """%ragged_comp (p0: bf16[256,64], p1: bf16[1024,64], p2: s32[4]) -> bf16[1024,64] {
  %p0 = bf16[256,64]{1,0} parameter(0)
  %p1 = bf16[1024,64]{1,0} parameter(1)
  %p2 = s32[4]{0} parameter(2)
  ROOT %r = bf16[1024,64]{1,0} ragged-all-to-all(%p0, %p1, %p2, %p2, %p2, /*index=5*/%p2), replica_groups={{0,1,2,3}}
}

ENTRY %main (x: bf16[256,64], buffer: bf16[1024,64], y: bf16[1024,64], back: bf16[256,64], o: s32[4]) -> bf16[256,64] {
  %x = bf16[256,64]{1,0} parameter(0)
  %buffer = bf16[1024,64]{1,0} parameter(1)
  %y = bf16[1024,64]{1,0} parameter(2)
  %back = bf16[256,64]{1,0} parameter(3)
  %o = s32[4]{0} parameter(4)
  %dispatch = bf16[1024,64]{1,0} ragged-all-to-all(%x, %buffer, %o, %o, %o, /*index=5*/%o), channel_id=1, replica_groups={{0,1,2,3}}
  %start = ((bf16[256,64]{1,0}, bf16[1024,64]{1,0}, s32[4]{0}), bf16[1024,64]{1,0}) async-start(%x, %buffer, %o), calls=%ragged_comp
  %done = bf16[1024,64]{1,0} async-done(%start)
  ROOT %combine = bf16[256,64]{1,0} ragged-all-to-all(%y, %back, %o, %o, %o, /*index=5*/%o), channel_id=1, replica_groups={{0,1,2,3}}
}
"""


def test_ragged_all_to_alls_are_timed_at_the_routed_rows():
    """The dispatch (as XLA:TPU writes it, and as an async computation, as XLA:GPU does) and the
    combine each move a chip's 256 routed rows, not the 1024-row receive buffer: 3/4 of them leave
    the chip, over a ring of two links. The collectives' listing keeps the buffers' bytes."""
    from jaxpar.parallel import hlo
    routed = 256 * 64 * 2 * (3 / 4) / (2 * 50e9)
    r = roofline.estimate(RAGGED, CHIP, devices=4)
    assert r["comm_s"] == pytest.approx(3 * routed)
    assert r["exposed_comm_s"] == pytest.approx(3 * routed)  # nothing scheduled inside the async pair
    assert r["comm_s"] != pytest.approx((2 * 1024 + 256) / 256 * routed)  # the buffers' time, before
    listed = hlo.totals(hlo.collective_ops(RAGGED))["ragged-all-to-all"]
    assert listed["bytes"] == (2 * 1024 + 256) * 64 * 2


def test_a_capacity_below_the_fair_share_fills_its_buffer():
    """capacity_factor 0.5 on tiny_moe at ep=4: room for ceil(0.5 x 32 x 2 / 4) = 8 rows a sequence
    from each source, 4 x 8 = 32 of a sequence's 64 assignments; balanced routing fills all of it,
    so the grouped GEMMs are charged the whole buffer (a factor of 1, not 0.5: never more rows
    than the buffer holds)."""
    from conftest import tiny_config

    from jaxpar.planning.estimate import dispatch_rows_factor
    half = tiny_config("tiny_moe", **{"model.moe_capacity_factor": 0.5}).model
    assert dispatch_rows_factor(half, "ragged", 4) == 1
    assert dispatch_rows_factor(half, "all_to_all", 2) == 1
    quarter_more = tiny_config("tiny_moe", **{"model.moe_capacity_factor": 1.25}).model  # 20 rows, fair share 16
    assert dispatch_rows_factor(quarter_more, "ragged", 4) == 4 * 20 / 64


# An FP8 step's pieces (issue 73): a quantize pass (bf16 -> f8e4m3fn, by its scale), a cuBLASLt f8
# call (XLA:GPU with Triton GEMMs off) and a Triton GEMM fusion of f8 operands (e5m2 x e4m3, a
# backward's), beside a bf16 dot. Each GEMM is 64 x 256 x 128.
FP8_MODULE = """HloModule fp8, is_scheduled=true

%quantize (x: bf16[64,128], s: f32[]) -> f8e4m3fn[64,128] {
  %x = bf16[64,128]{1,0} parameter(0)
  %s = f32[] parameter(1)
  %c = f32[64,128]{1,0} convert(%x)
  %b = f32[64,128]{1,0} broadcast(%s), dimensions={}
  %m = f32[64,128]{1,0} multiply(%c, %b)
  ROOT %q = f8e4m3fn[64,128]{1,0} convert(%m)
}

%gemm_fusion_f8 (p0: f8e5m2[64,128], p1: f8e4m3fn[256,128]) -> f32[64,256] {
  %p0 = f8e5m2[64,128]{1,0} parameter(0)
  %p1 = f8e4m3fn[256,128]{1,0} parameter(1)
  %t = f8e4m3fn[128,256]{0,1} transpose(%p1), dimensions={1,0}
  ROOT %d = f32[64,256]{1,0} dot(%p0, %t), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_bf16_dot (p0: bf16[64,128], p1: bf16[128,256]) -> f32[64,256] {
  %p0 = bf16[64,128]{1,0} parameter(0)
  %p1 = bf16[128,256]{1,0} parameter(1)
  ROOT %d = f32[64,256]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (x: bf16[64,128], w: bf16[128,256], s: f32[], g: f8e5m2[64,128], wq: f8e4m3fn[256,128], a: f8e4m3fn[128,256]) -> f32[64,256] {
  %x = bf16[64,128]{1,0} parameter(0)
  %w = bf16[128,256]{1,0} parameter(1)
  %s = f32[] parameter(2)
  %g = f8e5m2[64,128]{1,0} parameter(3)
  %wq = f8e4m3fn[256,128]{1,0} parameter(4)
  %a = f8e4m3fn[128,256]{1,0} parameter(5)
  %xq = f8e4m3fn[64,128]{1,0} fusion(%x, %s), kind=kLoop, calls=%quantize
  %cublas = (f32[64,256]{1,0}, s8[1024]{0}) custom-call(%xq, %a, %s, %s), custom_call_target="__cublas$lt$matmul$f8", backend_config={"gemm_backend_config":{"dot_dimension_numbers":{"lhs_contracting_dimensions":["1"],"rhs_contracting_dimensions":["0"],"lhs_batch_dimensions":[],"rhs_batch_dimensions":[]}}}
  %triton = f32[64,256]{1,0} fusion(%g, %wq), kind=kCustom, calls=%gemm_fusion_f8, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %bf = f32[64,256]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused_bf16_dot
}
"""


def test_fp8_gemms_run_at_the_chips_fp8_peak_and_the_others_at_bf16s():
    """With memory out of the way, the cuBLASLt f8 call and the Triton GEMM of f8 operands take
    their FLOPs at the FP8 peak (here 4x bf16's), the bf16 dot at bf16's. Control: on a chip with
    no FP8 peak (a TPU, say) all three run at the compute dtype's."""
    gemm = 2 * 64 * 256 * 128
    fast = Chip(**{**CHIP.__dict__, "hbm_bytes_per_s": 1e18, "fp8_peak_flops": 400e12})
    r = roofline.estimate(FP8_MODULE, fast, devices=1)
    assert r["hlo_flops_per_chip"] == 3 * gemm
    assert r["compute_bound_s"] == pytest.approx(2 * gemm / 400e12 + gemm / 100e12)
    no_fp8 = roofline.estimate(FP8_MODULE, Chip(**{**fast.__dict__, "fp8_peak_flops": None}), devices=1)
    assert no_fp8["compute_bound_s"] == pytest.approx(3 * gemm / 100e12)
    assert r["compute_bound_s"] < no_fp8["compute_bound_s"]


def test_a_quantize_pass_is_charged_by_its_bytes():
    """The quantize fusion has no dot: it reads the bf16 operand and its scale, writes one byte an
    element, and takes those bytes' time at HBM bandwidth."""
    roof = roofline.Roofline(FP8_MODULE, Chip(**{**CHIP.__dict__, "fp8_peak_flops": 400e12}), 1)
    ops = roof.comps[roof.entry]
    shapes = {o.name: o.shape for o in ops}
    cost = roof.op_cost(next(o for o in ops if o.name == "xq"), shapes)
    assert cost.flops == 0 and cost.bytes == 64 * 128 * 2 + 4 + 64 * 128
    assert cost.seconds == pytest.approx(cost.bytes / 1e12)


def test_the_fp8_peak_is_the_data_sheets_where_the_chip_has_fp8_units():
    """H100 and H200 SXM: 1,979 TFLOP/s dense FP8, twice bf16's; no TPU target has FP8 units, nor
    has a chip whose data sheet is not in the table. MFU's peak stays model.dtype's."""
    from jaxpar.models.flops import FP8, datasheet_peak
    from jaxpar.planning.hardware import CHIPS, chip_for, parse_target
    assert CHIPS["h100"].fp8_peak_flops == CHIPS["h200"].fp8_peak_flops == 1979e12
    assert {CHIPS[k].fp8_peak_flops for k in ("v4", "v5e", "v5p", "v6e")} == {None}
    assert datasheet_peak("TPU v5 lite", FP8) is None and datasheet_peak("made up", FP8) is None
    h100 = chip_for(parse_target("gpu:h100-8"), [], "bfloat16")
    assert (h100.peak_flops, h100.fp8_peak_flops) == (989e12, 1979e12)
