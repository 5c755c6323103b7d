"""TensorReader (the Rust extension reading CPU tensors' memory) gives what the torch
computations it replaces give (python/neuraldbg/_measure.py), and refuses, without raising,
every tensor it cannot read."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from neuraldbg._measure import Measurer, NormPlan, Probe, activation_group, input_stats, samples_per_unit
from neuraldbg._native import TensorReader

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
SHAPES = [(), (1,), (7,), (3, 5), (4, 3, 2), (2, 3, 4, 5), (17, 9), (64, 33), (0,), (3, 0)]


# How the reader learns a tensor's layout: by asking torch for each property, from torch's
# DLPack exporter in one call, or (what the collector uses) through DLPack 1.3's exchange API,
# a view of a torch.Tensor without a capsule (torch >= 2.10; the exporter for the rest). Every
# test runs all three ways.
_TO_DLPACK = getattr(torch._C, "_to_dlpack", None)
_EXCHANGE = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
EXPORTERS = {"attributes": (None, None), "dlpack": (_TO_DLPACK, None), "exchange": (_TO_DLPACK, _EXCHANGE)}
_EXPORT: list = [(None, None)]


@pytest.fixture(autouse=True, params=sorted(EXPORTERS))
def layout_source(request: pytest.FixtureRequest) -> str:
    if request.param == "dlpack" and _TO_DLPACK is None:
        pytest.skip("this torch has no torch._C._to_dlpack")
    if request.param == "exchange" and (_TO_DLPACK is None or _EXCHANGE is None):
        pytest.skip("this torch has no DLPack exchange API")
    _EXPORT[0] = EXPORTERS[request.param]
    if request.param == "exchange":
        assert reader().views
    return str(request.param)


def reader() -> TensorReader:
    return TensorReader(
        (torch.Tensor, torch.nn.Parameter), torch.float32, torch.float64, torch.float16, torch.bfloat16, *_EXPORT[0]
    )


def tol(dtype: torch.dtype) -> dict:
    """float32 results: rtol 1e-5 for float32/float64 inputs; the half types' torch paths
    compute in half precision."""
    return dict(rtol=1e-5, atol=1e-6) if dtype in (torch.float32, torch.float64) else dict(rtol=1e-2, atol=1e-2)


def with_specials(t: torch.Tensor, kind: str) -> torch.Tensor:
    t = t.clone()
    if t.numel() == 0 or kind == "plain":
        return t
    flat = t.view(-1)
    if kind == "nan":
        flat[flat.numel() // 2] = float("nan")
    elif kind == "inf":
        flat[0] = float("inf")
    elif kind == "-inf":
        flat[-1] = float("-inf")
    elif kind == "nan+inf":
        flat[0] = float("inf")
        flat[-1] = float("nan")
    return t


SPECIALS = ["plain", "nan", "inf", "-inf", "nan+inf"]


def assert_close(got: float, want: float, **kw: float) -> None:
    if math.isnan(want):
        assert math.isnan(got), (got, want)
    elif math.isinf(want):
        assert got == want, (got, want)
    else:
        np.testing.assert_allclose(got, want, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_norms_match_torch(dtype):
    g = torch.Generator().manual_seed(0)
    r = reader()
    tensors = []
    for shape in SHAPES:
        for kind in SPECIALS:
            tensors.append(with_specials(torch.randn(shape, generator=g).to(dtype) * 3, kind))
    out = np.full(len(tensors), 123.0, dtype=np.float32)
    assert r.norms(tensors, out)
    for t, got in zip(tensors, out):
        want = torch.linalg.vector_norm(t.double()).float().item()
        assert_close(float(got), want, rtol=1e-5)
        # The torch computation the collector runs today (CPU: stacked or _foreach_norm).
        torch_norm = torch.stack(torch._foreach_norm([t])).float().item() if t.numel() else 0.0
        assert_close(float(got), torch_norm, **tol(dtype))


def test_norms_of_the_collector_norm_plan():
    g = torch.Generator().manual_seed(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Linear(32, 1)
    )
    model(torch.randn(8, 16, generator=g)).pow(2).sum().backward()
    params = list(model.parameters())
    grads = [p.grad for p in params]
    parts: list = []
    plan = NormPlan(grads, 1 << 16)
    plan(grads, parts)
    want = np.empty(len(grads), np.float32)
    want[plan.order] = torch.cat(parts).numpy()
    r = reader()
    out = np.empty(len(params), np.float32)
    assert r.norms(params, out, "grad")
    np.testing.assert_allclose(out, want, rtol=1e-5)
    assert r.norms(params, out)
    np.testing.assert_allclose(out, [p.detach().norm().item() for p in params], rtol=1e-5)
    # Missing gradients: `missing`.
    params[1].grad = None
    assert r.norms(params, out, "grad")
    assert out[1] == -1.0 and out[0] == pytest.approx(want[0], rel=1e-5)
    assert r.norms(params, out, "grad", -2.5)
    assert out[1] == -2.5
    two = np.empty(2, np.float32)
    assert r.norms([None, params[0]], two, None, 7.0)
    assert two[0] == 7.0 and two[1] == pytest.approx(params[0].detach().norm().item(), rel=1e-5)


def test_norm_of_values_whose_squares_overflow_float32_is_finite():
    r = reader()
    out = np.empty(2, np.float32)
    assert r.norms([torch.full((100,), 1e30), torch.full((9,), 6e4, dtype=torch.float16)], out)
    np.testing.assert_allclose(out, [1e31, 1.8e5], rtol=1e-5)
    assert np.isfinite(out).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_stats_match_input_stats(dtype):
    g = torch.Generator().manual_seed(2)
    r = reader()
    for shape in SHAPES + [(5000,), (20000,)]:  # both input_stats branches
        for kind in SPECIALS:
            x = with_specials((torch.randn(shape, generator=g) * 2 + 0.5).to(dtype), kind)
            got = r.stats(x)
            if x.numel() == 0:
                assert got is None
                continue
            assert got is not None
            want = input_stats(x).tolist()
            exact = x.double()
            ref = [exact.min().item(), exact.max().item(), exact.mean().item(), exact.std(correction=0).item()]
            for gv, wv, rv in zip(got, want, ref):
                assert_close(gv, rv, rtol=1e-9, atol=1e-12)
                if math.isinf(gv) and math.isnan(wv):
                    continue  # torch.std_mean (Welford) turns an infinite mean into NaN
                assert_close(gv, wv, rtol=1e-5, atol=1e-5)


def test_scalar():
    r = reader()
    for dtype in DTYPES:
        assert r.scalar(torch.tensor(2.5, dtype=dtype)) == 2.5
        assert r.scalar(torch.tensor([[[-0.75]]], dtype=dtype)) == -0.75
        assert math.isnan(r.scalar(torch.tensor(float("nan"), dtype=dtype)))
    assert r.scalar(torch.tensor(0.1)) == float(np.float32(0.1))
    assert r.scalar(torch.tensor(0.1, dtype=torch.float64)) == 0.1
    assert r.scalar(torch.ones(2)) is None
    assert r.scalar(torch.ones(0)) is None
    assert r.scalar(torch.arange(10.0)[3:4]) == 3.0  # storage offset
    assert r.scalar(torch.tensor(3)) is None
    assert r.scalar(1.5) is None


@pytest.mark.parametrize("dtype", DTYPES)
def test_absmax_matches_torch(dtype):
    g = torch.Generator().manual_seed(3)
    r = reader()
    tensors = [with_specials(torch.randn(s, generator=g).to(dtype), k) for s in SHAPES for k in SPECIALS]
    out = np.empty(len(tensors), np.float32)
    assert r.absmax(tensors, out)
    for t, got in zip(tensors, out):
        want = 0.0 if t.numel() == 0 else t.abs().max().float().item()
        assert_close(float(got), want, rtol=0)
    nonempty = [t for t in tensors if t.numel()]
    want = torch.stack(torch._foreach_norm(nonempty, float("inf"))).float().numpy()
    got = np.empty(len(nonempty), np.float32)
    assert r.absmax(nonempty, got)
    np.testing.assert_array_equal(got, want)
    assert not r.absmax([tensors[0], None], np.empty(2, np.float32))
    # What an empty tensor reads can be chosen (the collector's output maxima: NaN, not measured).
    assert r.absmax(tensors, out, np.nan)
    for t, got in zip(tensors, out):
        if t.numel() == 0:
            assert np.isnan(got), t
        else:
            assert_close(float(got), t.abs().max().float().item(), rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_shares_match_grad_zero_shares(dtype):
    g = torch.Generator().manual_seed(4)
    grads = []
    for shape in [(5,), (4, 6), (8, 3, 3, 3), (6, 4, 5), (1, 1), (3, 0), (7, 9)]:
        t = torch.randn(shape, generator=g).to(dtype)
        if t.dim() >= 2 and t.numel():
            t[::2] = 0.0
            t[:, 1::3] = -0.0
        grads.append(t)
    grads[-1][1, 0] = float("nan")  # NaN is not zero
    grads[-1][3] = 0.0
    grads[-1][3, 2] = float("nan")
    grads.insert(2, None)
    r = reader()
    rows = np.empty(len(grads), np.float32)
    cols = np.empty(len(grads), np.float32)
    assert r.zero_shares(grads, rows, cols)
    vec, index = Measurer().grad_zero_shares(grads)
    k = len(index)
    want_rows = np.full(len(grads), np.nan, np.float32)
    want_cols = np.full(len(grads), np.nan, np.float32)
    want_rows[index] = vec[:k].numpy()
    want_cols[index] = vec[k:].numpy()
    np.testing.assert_allclose(rows, want_rows, rtol=1e-6)
    np.testing.assert_allclose(cols, want_cols, rtol=1e-6)

    class Holder:
        def __init__(self, grad):
            self.grad = grad

    assert r.zero_shares([Holder(t) for t in grads], rows, cols, "grad")
    np.testing.assert_allclose(rows, want_rows, rtol=1e-6)


def probe(row, sat=None, death=False, slope=None, unit_axis=1):
    d = {"module": row, "death": death}
    if sat is not None:
        d["saturation"] = sat
    if slope is not None:
        d["slope"] = slope
    return Probe(row, d, unit_axis)


SLOPES = {None: 0, "tanh": 1, "sigmoid": 2, "softsign": 3}


def probe_tuple(p: Probe):
    return (p.row, p.unit_axis, p.center, p.half, p.death, SLOPES[p.slope])


def expected_table(probes, outs):
    table = np.full(5 * len(outs), np.nan, np.float32)
    for p in probes:
        y = outs[p.row]
        if y is None or y.numel() == 0:
            continue
        # activation_group cannot take float64 outputs with a slope (vector_norm to float32
        # narrows): it gets them as float32.
        yy = y.float() if y.dtype == torch.float64 else y
        vals = activation_group(p, yy.unsqueeze(0))[0].float().numpy()
        for c, v in zip(p.cols, vals):
            table[5 * p.row + c] = v
        if p.half is not None and bool(torch.isnan(y).any()):
            # The reader's contract: the saturation share is NaN when an output is NaN
            # (hardshrink counts a NaN as inside the band).
            table[5 * p.row + 1] = np.nan
        if y.dim() >= 2 and p.unit_axis >= y.dim():
            # samples_per_unit does not wrap an axis past the last (activation_group does).
            table[5 * p.row + 4] = y.numel() / y.shape[p.unit_axis % y.dim()]
        else:
            table[5 * p.row + 4] = samples_per_unit(p, y.shape)
    return table


@pytest.mark.parametrize("dtype", DTYPES)
def test_activations_match_activation_group(dtype):
    g = torch.Generator().manual_seed(5)
    shapes = [(), (6,), (8, 5), (4, 6, 3), (3, 4, 5, 5), (2, 3, 2, 2, 2), (16, 32), (0, 4)]
    kinds = [
        dict(death=True),  # ReLU
        dict(sat=(0.0, 0.9), slope="tanh"),  # Tanh
        dict(sat=(0.5, 0.45), slope="sigmoid"),  # Sigmoid
        dict(slope="softsign"),
        dict(sat=(3.0, 3.0), death=True),  # ReLU6-like
        dict(),
        dict(death=True, unit_axis=2),
        dict(death=True, unit_axis=-1),
    ]
    outs, probes = [], []
    for shape in shapes:
        for kind in kinds:
            for special in ["plain", "relu", "nan", "inf"]:
                y = torch.randn(shape, generator=g)
                if special == "relu" or kind.get("death"):
                    y = torch.relu(y - 0.3)
                    if y.dim() >= 2 and y.shape[0]:
                        y[:, : y.shape[1] // 2] = 0.0  # some dead units
                y = with_specials(y.to(dtype), special if special in ("nan", "inf") else "plain")
                kw = dict(kind)
                probes.append(probe(len(outs), kw.pop("sat", None), unit_axis=kw.pop("unit_axis", 1), **kw))
                outs.append(y)
    outs.append(None)
    probes.append(probe(len(outs) - 1, death=True))
    r = reader()
    table = np.full(5 * len(outs), np.nan, np.float32)
    assert r.activations(outs, [probe_tuple(p) for p in probes], table)
    want = expected_table(probes, outs)
    t = tol(dtype)
    for i, p in enumerate(probes):
        np.testing.assert_allclose(
            table[5 * i : 5 * i + 5], want[5 * i : 5 * i + 5], equal_nan=True, err_msg=f"{outs[i]} {p.key()}", **t
        )


def test_activations_skip_none_and_leave_unasked_cells():
    r = reader()
    y = torch.relu(torch.randn(4, 3))
    table = np.full(10, np.nan, np.float32)
    assert r.activations([None, y], [(0, 1, 0.0, None, True, 0), (1, 1, 0.0, None, True, 0)], table)
    assert np.isnan(table[:5]).all()
    assert np.isnan(table[6]) and np.isnan(table[8])
    assert table[9] == 4.0


class Sub(torch.Tensor):
    pass


def unreadable():
    dense = torch.randn(4, 5)
    return [
        dense.t(),  # not contiguous
        dense[:, ::2],
        dense.to_sparse(),  # is_contiguous raises
        torch.randn(2, 3, device="meta"),  # not CPU
        torch.arange(6),  # integer
        torch.randn(3, dtype=torch.complex64),
        torch.randn(4, 3).as_subclass(Sub),  # a subclass (like DTensor, FakeTensor)
        dense.numpy(),
        [1.0, 2.0],
        "tensor",
        torch.randn(2, 3, 4, 4).to(memory_format=torch.channels_last),
    ]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_norms_and_what_they_hold(dtype):
    """grad_norms reads each parameter's gradient (-1 where there is none) like norms(..,
    "grad"), and says what the norms hold: bit 1 a non-finite one, 2 an exact zero, 4 a missing
    gradient; norm() reads one."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 3).to(dtype)) for _ in range(4)]
    r = reader()
    out, want = np.empty(4, np.float32), np.empty(4, np.float32)

    def grads(*gs):
        for p, g in zip(params, gs):
            p.grad = None if g is None else g.to(dtype)

    cases = [
        ((torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 3), torch.randn(5, 3)), 0),
        ((torch.randn(5, 3), None, torch.randn(5, 3), torch.randn(5, 3)), 4),
        ((torch.randn(5, 3), torch.zeros(5, 3), torch.randn(5, 3), torch.randn(5, 3)), 2),
        ((with_specials(torch.randn(5, 3), "nan"), torch.randn(5, 3), torch.zeros(5, 3), None), 1 | 2 | 4),
        ((torch.randn(5, 3), torch.randn(5, 3), with_specials(torch.randn(5, 3), "inf"), torch.randn(5, 3)), 1),
    ]
    for gs, flags in cases:
        grads(*gs)
        assert r.grad_norms(params, out) == flags, gs
        assert r.norms(params, want, "grad") is True
        np.testing.assert_array_equal(out, want)
        for p, v in zip(params, want):
            assert_close(r.norm(p, "grad"), float(v), rtol=1e-6)
    assert r.norm(params[0]) == pytest.approx(float(torch.linalg.vector_norm(params[0].detach().double())), rel=1e-5)
    # The zero shares read in the same pass are zero_shares' (NaN for the missing gradient).
    grads(torch.randn(5, 3), torch.zeros(5, 3), torch.randn(5, 3), None)
    with torch.no_grad():
        params[0].grad[1] = 0.0
        params[2].grad[:, 2] = 0.0
    rows, cols, want_rows, want_cols = (np.empty(4, np.float32) for _ in range(4))
    assert r.grad_norms(params, out, -1.0, rows, cols) == 2 | 4
    assert r.zero_shares(params, want_rows, want_cols, "grad") is True
    np.testing.assert_array_equal(rows, want_rows)
    np.testing.assert_array_equal(cols, want_cols)
    assert (rows[0], cols[2], rows[1], cols[1]) == (pytest.approx(1 / 5), pytest.approx(1 / 3), 1.0, 1.0)
    with pytest.raises(ValueError):
        r.grad_norms(params, out, -1.0, rows, None)
    params[1].grad = torch.randn(3, 5).to(dtype).t()  # not contiguous: unreadable
    assert r.grad_norms(params, out) == -1
    assert r.norm(params[1], "grad") is None
    with pytest.raises(ValueError):
        r.grad_norms(params, np.empty(3, np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gradient_norms_of_many_sizes_in_one_pass(dtype):
    """grad_norms takes every gradient first and reads each with the next one's view already
    taken (and its memory prefetched): gradients of every size (empty, scalar, one larger than
    the prefetched span), missing ones between them, and an unreadable one anywhere."""
    torch.manual_seed(1)
    shapes = [(300, 200), (7,), (), (0, 4), (64, 64), (1,), (129, 33), (5, 3)]
    params = [torch.nn.Parameter(torch.randn(s).to(dtype)) for s in shapes]
    for i, p in enumerate(params):
        p.grad = None if i in (1, 5) else torch.randn(p.shape).to(dtype)
    r = reader()
    out = np.full(len(params), np.nan, np.float32)
    assert r.grad_norms(params, out, -2.0) == 2 | 4  # (the empty one: an exact zero)
    for p, v in zip(params, out):
        if p.grad is None:
            assert v == -2.0
        else:
            want = float(torch.linalg.vector_norm(p.grad.double()))
            assert_close(float(v), want, rtol=1e-5, atol=0.0)
    for bad in (0, 4, 7):  # first, in the middle, last
        kept = params[bad].grad
        params[bad].grad = torch.randn(*reversed(kept.shape)).to(dtype).t()  # not contiguous
        assert r.grad_norms(params, out) == -1
        params[bad].grad = kept
    assert r.grad_norms(params, out) == 2 | 4


def test_unreadable_tensors_fall_back_without_raising():
    r = reader()
    for t in unreadable():
        assert r.stats(t) is None, t
        assert r.scalar(t) is None, t
        for items in ([t], [torch.ones(3), t]):
            assert r.norms(items, np.empty(len(items), np.float32)) is False, t
            assert r.absmax(items, np.empty(len(items), np.float32)) is False, t
            assert r.zero_shares(items, np.empty(len(items), np.float32), np.empty(len(items), np.float32)) is False
            table = np.full(5 * len(items), np.nan, np.float32)
            probes = [(i, 1, 0.0, None, True, 0) for i in range(len(items))]
            assert r.activations(items, probes, table) is False, t

    class Raising:
        @property
        def grad(self):
            raise RuntimeError("no")

    assert r.norms([Raising()], np.empty(1, np.float32), "grad") is False
    assert r.norms([object()], np.empty(1, np.float32), "grad") is False
    # A reader that accepts only torch.Tensor refuses Parameters.
    only_tensor = TensorReader(
        (torch.Tensor,), torch.float32, torch.float64, torch.float16, torch.bfloat16, *_EXPORT[0]
    )
    assert only_tensor.norms([torch.nn.Parameter(torch.ones(2))], np.empty(1, np.float32)) is False
    assert only_tensor.stats(torch.ones(2)) is not None


def test_views_with_a_storage_offset_are_read_from_their_own_start():
    r = reader()
    base = torch.arange(24.0).reshape(4, 6)
    view = base[2:]  # contiguous, storage offset 12
    assert r.stats(view) == (12.0, 23.0, 17.5, pytest.approx(view.std(correction=0).item()))
    out = np.empty(1, np.float32)
    assert r.norms([view], out)
    assert out[0] == pytest.approx(view.norm().item(), rel=1e-6)


def test_misuse_raises():
    r = reader()
    ts = [torch.ones(3), torch.ones(2)]
    with pytest.raises(ValueError):
        r.norms(ts, np.empty(3, np.float32))
    with pytest.raises(TypeError):
        r.norms(ts, np.empty(2, np.float64))
    with pytest.raises(ValueError):
        r.norms(ts, np.empty(4, np.float32)[::2])
    ro = np.empty(2, np.float32)
    ro.flags.writeable = False
    with pytest.raises((ValueError, TypeError)):
        r.norms(ts, ro)
    with pytest.raises(ValueError):
        r.absmax(ts, np.empty(1, np.float32))
    with pytest.raises(ValueError):
        r.zero_shares(ts, np.empty(2, np.float32), np.empty(1, np.float32))
    with pytest.raises(ValueError):
        r.activations(ts, [(1, 1, 0.0, None, True, 0)], np.empty(5, np.float32))
    with pytest.raises(ValueError):
        r.activations(ts, [(0, 1, 0.0, None, True, 7)], np.empty(10, np.float32))


def test_results_do_not_depend_on_grad_mode():
    r = reader()
    w = torch.nn.Parameter(torch.randn(10, 10))
    out = np.empty(1, np.float32)
    assert r.norms([w], out)
    with torch.no_grad():
        out2 = np.empty(1, np.float32)
        assert r.norms([w], out2)
    assert out[0] == out2[0] == pytest.approx(w.detach().norm().item(), rel=1e-6)


def test_an_output_array_may_share_memory_with_the_tensors_it_reads():
    """Results are written once every tensor was read: an output array that is itself a
    measured tensor's memory gives the norms of its values before the call."""
    r = reader()
    out = np.array([3.0, 4.0], np.float32)
    t = torch.from_numpy(out)  # the same memory
    assert r.norms([t, t[:1]], out)
    np.testing.assert_array_equal(out, [5.0, 3.0])
    table = np.array([0.0, 2.0, 0.0, 1.0, np.nan], np.float32)
    shared = torch.from_numpy(table)[:4].reshape(1, 4)  # one sample of 4 ReLU units, in the table
    assert r.activations([shared], [(0, 1, 0.0, None, True, 0)], table)
    assert table[0] == 2.0 and table[2] == pytest.approx(0.5) and table[4] == 1.0


def test_output_maxima_read_each_output_and_table_them_per_engine_module():
    """OutputMaxima (called by the layer-class wrapper on sampled steps) reads max |x| of each
    output as it comes, keeps what it cannot read for the torch path, and tables the values
    per engine module as np.fmax would: the largest per module (a module called twice keeps
    its larger output), NaN where none, a NaN giving way to a number, no entry for a module
    without a rank."""
    from neuraldbg._native import OutputMaxima

    kept: list = []
    maxima = OutputMaxima(reader(), kept)
    g = torch.Generator().manual_seed(0)
    outs = {1: torch.randn(8, 4, generator=g), 2: torch.randn(3, generator=g) * 5, 4: torch.randn(2, 2, generator=g)}
    odd = torch.randn(4, 4, generator=g).t()  # not compact row-major: not readable
    maxima(1, outs[1])
    maxima(2, outs[2])
    maxima(2, outs[2] * 0.5)  # the same module again, smaller
    maxima(3, odd)
    maxima(4, outs[4])
    maxima(5, torch.tensor([float("nan")]))
    assert len(maxima) == 5 and len(kept) == 1 and kept[0][0] == 3 and kept[0][1] is odd and kept[0][2] is None
    rank = np.array([-1, 0, 2, 1, -1, 3], dtype=np.int64)  # module 4 has no engine module
    base_values = np.array([7.0, np.nan], dtype=np.float32)
    base_ranks = np.array([1, 0], dtype=np.int64)
    table = maxima.table(rank, 5, base_values, base_ranks)
    expected = np.full(5, np.nan, dtype=np.float32)
    expected[0] = outs[1].abs().max()
    expected[2] = outs[2].abs().max()
    expected[1] = 7.0
    expected[3] = np.nan  # only a NaN was read for it
    np.testing.assert_array_equal(table, expected)
    assert len(maxima) == 0 and maxima.table(rank, 5) is None  # forgotten once tabled
    maxima(4, outs[4])
    assert maxima.table(rank, 5) is None  # no engine module
    with pytest.raises(ValueError):
        maxima.table(rank, 5, base_values)
    maxima(2, outs[2])
    with pytest.raises(ValueError):
        maxima.table(rank, 2)  # a rank past the end
