"""Number formats (MODEL.md section 5) and the cache-write ops, checked bit for bit against
hand-derived values and the independent implementations in tests/naive.py."""
from __future__ import annotations

import math

import pytest
import torch

import naive
import v41graph.custom_ops  # noqa: F401  (importing registers torch.ops.v41graph.*)
from v41graph.custom_ops import codecs

ops = torch.ops.v41graph

E2M1_TABLE = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
              -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def _t(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype)


def _nextafter(x: float, toward: float) -> float:
    return torch.nextafter(_t([x]), _t([toward])).item()


# =============================================================================== E2M1
def test_e2m1_decode_table_all_16_codes():
    got = codecs.e2m1_decode(torch.arange(16, dtype=torch.uint8))
    want = _t(E2M1_TABLE)
    assert torch.equal(got, want)
    # the sign of the zero codes: code 8 is -0.0
    assert not torch.signbit(got[0]) and torch.signbit(got[8])


def test_e2m1_encode_decode_roundtrip_except_negative_zero():
    codes = torch.arange(16, dtype=torch.uint8)
    back = codecs.e2m1_encode(codecs.e2m1_decode(codes))
    for c in range(16):
        assert back[c].item() == (0 if c == 8 else c), c
    # nothing ever encodes to the -0 code
    xs = _t([-0.0, -1e-30, -0.1, -0.25])
    assert codecs.e2m1_encode(xs).tolist() == [0, 0, 0, 0]


TIES = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0), (5.0, 4.0)]


@pytest.mark.parametrize("x,want", TIES)
def test_e2m1_ties_round_half_to_even(x, want):
    for sign in (1.0, -1.0):
        got = codecs.e2m1_decode(codecs.e2m1_encode(_t([sign * x]))).item()
        assert got == sign * want or (want == 0.0 and got == 0.0), (sign * x, got)
        # and the naive encoder (nearest, ties to the even code) agrees
        assert naive.e2m1_value(naive.e2m1_code(sign * x)) == sign * want


@pytest.mark.parametrize("x,want", TIES)
def test_e2m1_just_off_the_tie_goes_to_the_nearer_value(x, want):
    lo = max(v for v in naive.E2M1_MAGNITUDES if v < x)
    hi = min(v for v in naive.E2M1_MAGNITUDES if v > x)
    above, below = _nextafter(x, math.inf), _nextafter(x, 0.0)
    enc = codecs.e2m1_decode(codecs.e2m1_encode(_t([above, below, -above, -below]))).tolist()
    assert enc == [hi, lo, -hi, -lo if lo else 0.0]


def test_e2m1_saturates_at_6():
    xs = _t([6.0, 6.5, 7.0, 100.0, 3e38, math.inf, -6.0, -7.0, -1e9, -math.inf])
    got = codecs.e2m1_decode(codecs.e2m1_encode(xs)).tolist()
    assert got == [6.0] * 6 + [-6.0] * 4


def test_e2m1_encode_matches_naive_nearest_on_a_dense_sweep():
    xs = torch.linspace(-8, 8, 4097)          # includes every tie point (step 1/256)
    got = codecs.e2m1_encode(xs).tolist()
    want = [naive.e2m1_code(v) for v in xs.tolist()]
    assert got == want


# =============================================================================== nibbles
def test_pack_nibble_order_element_2i_low():
    packed = codecs.pack_fp4(torch.tensor([[0x1, 0x2, 0xF, 0x0, 0x7, 0xA]], dtype=torch.uint8))
    assert packed.tolist() == [[0x21, 0x0F, 0xA7]]
    assert codecs.unpack_fp4(torch.tensor([0x21, 0x0F, 0xA7], dtype=torch.uint8)).tolist() == \
        [0x1, 0x2, 0xF, 0x0, 0x7, 0xA]


def test_pack_unpack_roundtrip_and_naive_layout():
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = codecs.pack_fp4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(codecs.unpack_fp4(packed), codes)
    assert packed[1, 2].tolist() == naive.pack_nibbles(codes[1, 2].tolist())
    # every byte value survives unpack -> pack
    allbytes = torch.arange(256, dtype=torch.uint8)
    assert torch.equal(codecs.pack_fp4(codecs.unpack_fp4(allbytes)), allbytes)


def test_pack_rejects_odd_length():
    with pytest.raises(ValueError):
        codecs.pack_fp4(torch.zeros(3, dtype=torch.uint8))


# =============================================================================== E4M3
def test_e4m3_saturates_at_448():
    xs = _t([448.0, 449.0, 464.0, 480.0, 1e6, math.inf, -448.0, -500.0, -1e30])
    assert codecs.e4m3_round(xs).tolist() == [448.0] * 6 + [-448.0] * 3


def test_e4m3_round_matches_naive_table():
    g = torch.Generator().manual_seed(1)
    xs = torch.cat([torch.randn(2000, generator=g) * 10.0 ** torch.randint(-3, 3, (2000,), generator=g),
                    _t([v for v, _ in naive.E4M3_POSITIVE])])
    got = codecs.e4m3_round(xs).tolist()
    want = [naive.e4m3_round(v) for v in xs.tolist()]
    assert got == want


# =============================================================================== E8M0
def test_e8m0_to_float_is_two_to_the_e_minus_127():
    e = torch.arange(0, 255, dtype=torch.uint8)
    got = codecs.e8m0_to_float(e)
    assert got.dtype == torch.float32
    assert got.tolist() == [math.ldexp(1.0, k - 127) for k in range(255)]


def test_float_to_e8m0_on_powers_of_two_and_rounding_up():
    ks = list(range(-126, 128))
    pows = _t([math.ldexp(1.0, k) for k in ks])
    assert codecs.float_to_e8m0(pows).tolist() == [k + 127 for k in ks]
    assert codecs.float_to_e8m0(codecs.e8m0_to_float(torch.arange(1, 255, dtype=torch.uint8))).tolist() \
        == list(range(1, 255))
    # non powers of two round up
    assert codecs.float_to_e8m0(_t([1.5, 0.75, 3.0, 1.0000001])).tolist() == [128, 127, 129, 128]


def test_float_to_e8m0_smallest_scale_2_pow_minus_127():
    assert codecs.float_to_e8m0(codecs.e8m0_to_float(torch.tensor([0], dtype=torch.uint8))).tolist() == [0]


def test_ceil_log2_exact_at_and_around_powers_of_two():
    ks = list(range(-126, 128))
    at = _t([math.ldexp(1.0, k) for k in ks])
    above = torch.nextafter(at, _t([math.inf]))
    below = torch.nextafter(at, _t([0.0]))
    assert codecs.ceil_log2(at).tolist() == ks
    assert codecs.ceil_log2(above).tolist() == [k + 1 for k in ks]
    assert codecs.ceil_log2(below[1:]).tolist() == ks[1:]    # below 2^-126 is subnormal
    # a few non powers of two against frexp
    xs = [3.0, 5.0, 0.3, 1e-20, 123456.789, 7.0e30]
    assert codecs.ceil_log2(_t(xs)).tolist() == [naive.ceil_log2(naive.f32(x)) for x in xs]


# =============================================================================== block quantizers
# amax -> exponent of 2^ceil(log2(amax * fp32(1/448))), worked out by hand (fp32(1/448) =
# 1/448 * (1 + 3*2^-26), so 448 * fp32(1/448) rounds to exactly 1.0 in fp32).
FP8_SCALE_CASES = [(448.0, 0), (449.0, 1), (1.0, -8), (3.5, -7), (3.5 * (1 + 2 ** -20), -6),
                   (0.875, -9), (0.8751, -8), (1e-3, -18), (4096.0, 4)]


@pytest.mark.parametrize("amax,exp", FP8_SCALE_CASES)
def test_quant_fp8_ue8m0_scale_hand_examples(amax, exp):
    assert naive.ue8m0_exponent(amax, 448.0) == exp        # the hand derivation, double-checked
    x = torch.zeros(32)
    x[5] = -amax
    x[7] = amax / 3
    q, s = codecs.quant_fp8_ue8m0(x.unsqueeze(0), 32)
    assert s.dtype == torch.uint8 and s.tolist() == [[exp + 127]]
    scale = math.ldexp(1.0, exp)
    assert q.dtype == torch.float8_e4m3fn
    assert q.float()[0, 5].item() == naive.e4m3_round(-naive.f32(amax) / scale)
    assert q.float()[0, 7].item() == naive.e4m3_round(naive.f32(amax / 3) / scale)
    assert q.float()[0, 0].item() == 0.0
    assert abs(q.float()[0, 5].item()) <= 448.0


def test_quant_fp8_ue8m0_random_blocks_match_naive():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 96, generator=g) * _t([0.01, 0.3, 1.0, 7.0, 300.0, 5000.0]).unsqueeze(-1)
    q, s = codecs.quant_fp8_ue8m0(x, 32)
    for r in range(x.shape[0]):
        bits, scales = naive.quant_fp8_ue8m0(x[r].tolist(), 32)
        assert q[r].view(torch.uint8).tolist() == bits, r
        assert s[r].tolist() == scales, r
    dq = codecs.qdq_fp8_ue8m0(x, 32)
    assert dq.tolist() == [naive.dequant_fp8_ue8m0(*naive.quant_fp8_ue8m0(row, 32), 32) for row in x.tolist()]


FP4_E4M3_SCALE_CASES = [(6.0, 1.0), (0.0, 2.0 ** -9), (3.0, 0.5), (7.0, 1.125), (1000.0, 160.0),
                        (0.01, 2.0 ** -9), (0.02, 2 * 2.0 ** -9), (12.0, 2.0)]


@pytest.mark.parametrize("amax,scale", FP4_E4M3_SCALE_CASES)
def test_quant_fp4_e4m3_scale_hand_examples(amax, scale):
    """scale = e4m3(max(amax, 6*2^-9) / 6): e.g. 7/6 = 1.1667 -> 1.125 (E4M3 step 1/8 in [1,2));
    1000/6 = 166.7 -> 160 (step 16 in [128,256)); 0.02/6 = 0.00333 -> 2*2^-9 (subnormal)."""
    x = torch.zeros(16)
    x[3] = amax
    x[4] = -amax / 2
    packed, s = codecs.quant_fp4_e4m3(x.unsqueeze(0), 16)
    assert s.dtype == torch.float8_e4m3fn and s.float().tolist() == [[scale]]
    dq = codecs.dequant_fp4_e4m3(packed, s, 16)[0]
    grid = {v * scale for v in E2M1_TABLE}
    assert all(v in grid for v in dq.tolist())
    assert dq[3].item() == naive.e2m1_value(naive.e2m1_code(naive.f32(naive.f32(amax) / scale))) * scale
    assert dq[0].item() == 0.0


def test_quant_fp4_e4m3_random_rows_match_naive_and_stay_on_grid():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 64, generator=g) * _t([0.001, 0.1, 1.0, 20.0, 400.0]).unsqueeze(-1)
    packed, s = codecs.quant_fp4_e4m3(x, 16)
    assert packed.shape == (5, 32) and s.shape == (5, 4)
    dq = codecs.dequant_fp4_e4m3(packed, s, 16)
    for r in range(5):
        codes, sbits = naive.quant_fp4_e4m3(x[r].tolist(), 16)
        assert codecs.unpack_fp4(packed[r]).tolist() == codes, r
        assert s[r].view(torch.uint8).tolist() == sbits, r
        for i, v in enumerate(dq[r].tolist()):
            sc = naive.e4m3_value(sbits[i // 16])
            assert v / sc in {abs(t) for t in E2M1_TABLE} | {-abs(t) for t in E2M1_TABLE}
            assert abs(v - x[r, i].item()) <= naive.fp4_error_bound(x[r, i].item(), sc)
    assert torch.equal(codecs.qdq_fp4_e4m3(x, 16), dq)


def test_quant_fp4_ue8m0_random_rows_match_naive():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 128, generator=g) * _t([0.02, 1.0, 6.0, 90.0]).unsqueeze(-1)
    packed, s = codecs.quant_fp4_ue8m0(x, 32)
    for r in range(4):
        codes, scales = naive.quant_fp4_ue8m0(x[r].tolist(), 32)
        assert codecs.unpack_fp4(packed[r]).tolist() == codes, r
        assert s[r].tolist() == scales, r
    # a block whose amax is exactly 6 * 2^k gets scale 2^k and keeps the max exactly
    y = torch.zeros(1, 32)
    y[0, 9] = 12.0
    p, s2 = codecs.quant_fp4_ue8m0(y, 32)
    assert s2.tolist() == [[128]] and codecs.dequant_fp4_ue8m0(p, s2, 32)[0, 9].item() == 12.0


# =============================================================================== cache-write ops
def _sentinel(shape, seed):
    return torch.randint(0, 256, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)


def _kv(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * (0.5 + 3 * torch.rand(n, 1, generator=g))


def _window_expected(kv):
    rows, srows = [], []
    for r in kv.tolist():
        bits, sc = naive.quant_fp8_ue8m0(r, 32)
        rows.append(bits)
        srows.append(sc)
    return rows, srows


def _global_expected(kv):
    rows, srows = [], []
    for r in kv.tolist():
        codes, sbits = naive.quant_fp4_e4m3(r, 16)
        rows.append(naive.pack_nibbles(codes))
        srows.append(sbits)
    return rows, srows


def _index_expected(k):
    rows, srows = [], []
    for r in k.tolist():
        codes, sc = naive.quant_fp4_ue8m0(r, 32)
        rows.append(naive.pack_nibbles(codes))
        srows.append(sc)
    return rows, srows


# (op, cache shape, scale shape, value width, expected-row builder)
WRITE_OPS = {
    "window": (lambda: ops.window_kv_write, (3, 4, 64), (3, 4, 2), 64, _window_expected),
    "global": (lambda: ops.global_kv_write, (3, 4, 32), (3, 4, 4), 64, _global_expected),
    "index": (lambda: ops.index_k_write, (3, 4, 16), (3, 4, 1), 32, _index_expected),
}

SLOT_CASES = {
    "mixed": [7, -1, 0, 11, -1],
    "all_skipped": [-1, -1, -1],
    "skips_around_duplicate": [-1, 5, -1, 2, 2, -1, -1],   # rows 3 and 4 carry equal values
    "last_row_and_first_row": [0, -1, 11],
}


@pytest.mark.parametrize("case", list(SLOT_CASES))
@pytest.mark.parametrize("kind", list(WRITE_OPS))
def test_cache_write_ops_write_exactly_the_mapped_rows(kind, case):
    get_op, cshape, sshape, width, expected = WRITE_OPS[kind]
    slots = SLOT_CASES[case]
    cache, scale = _sentinel(cshape, 10), _sentinel(sshape, 11)
    cache0, scale0 = cache.clone(), scale.clone()
    kv = _kv(len(slots), width, 12)
    if case == "skips_around_duplicate":
        kv[4] = kv[3]
    get_op()(cache, scale, kv, torch.tensor(slots, dtype=torch.int64))
    want_rows, want_scales = expected(kv)
    flat_c, flat_s = cache.view(-1, cshape[-1]), scale.view(-1, sshape[-1])
    flat_c0, flat_s0 = cache0.view(-1, cshape[-1]), scale0.view(-1, sshape[-1])
    written = {}
    for i, slot in enumerate(slots):
        if slot >= 0:
            written[slot] = i      # duplicates carry equal values
    for row in range(flat_c.shape[0]):
        if row in written:
            i = written[row]
            assert flat_c[row].tolist() == want_rows[i], (row, i)
            assert flat_s[row].tolist() == want_scales[i], (row, i)
        else:
            assert torch.equal(flat_c[row], flat_c0[row]), f"row {row} was touched"
            assert torch.equal(flat_s[row], flat_s0[row]), f"scale row {row} was touched"


def test_cache_write_roundtrip_equals_qdq():
    """What the caches hold dequantizes to exactly the fake-quant (QDQ) values."""
    from v41graph.custom_ops import reference
    kv = _kv(4, 64, 13)
    rows = torch.tensor([3, 0, 2, 1])
    c, s = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    ops.window_kv_write(c, s, kv, rows)
    assert torch.equal(reference.gather_window_kv(c, s, rows, torch.float32), codecs.qdq_fp8_ue8m0(kv, 32))
    c, s = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 4, dtype=torch.uint8)
    ops.global_kv_write(c, s, kv, rows)
    assert torch.equal(reference.gather_global_kv(c, s, rows, torch.float32), codecs.qdq_fp4_e4m3(kv, 16))
    c, s = torch.zeros(4, 32, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8)
    ops.index_k_write(c, s, kv, rows)
    assert torch.equal(reference.gather_index_k(c, s, rows, torch.float32), codecs.qdq_fp4_ue8m0(kv, 32))
