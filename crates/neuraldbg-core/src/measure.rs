//! Tensor statistics computed straight over a tensor's elements: the kernels behind the
//! collector's CPU fast path.
//!
//! On a short CPU training step every framework op the collector adds costs far more than the
//! arithmetic of the small reductions it needs (the step has evicted the dispatcher's code from
//! the caches; figures in docs/performance.md). So the `PyTorch` collector hands the memory of contiguous CPU tensors to
//! these kernels (the Python bindings build the slices from `data_ptr()`; this crate stays free
//! of `unsafe`) and gets every statistic of a step from one call: gradient and parameter L2
//! norms, input `min, max, mean, std`, output magnitudes, the zero rows and columns of a
//! gradient, and the activation statistics of the engine's probes.
//!
//! Every kernel reads a slice of one [`Element`] type (`f32`, `f64`, [`half::f16`](struct@half::f16),
//! [`half::bf16`]), accumulates in `f64`, and propagates NaN the way the torch reductions it
//! replaces do (`amax`, `aminmax` and norms return NaN when any element is NaN). The hot loops
//! run over chunks of [`LANES`] elements into as many independent accumulators, which the
//! compiler turns into SIMD code even for the baseline x86-64 target (SSE2); `cargo test
//! --release -p neuraldbg-core --lib measure::tests::speed -- --ignored --nocapture` prints how
//! fast each kernel runs.

use half::{bf16, f16};

/// Independent accumulators per kernel loop (chunks of this many elements).
pub const LANES: usize = 8;

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A floating-point element type the kernels read: `f32`, `f64`, [`f16`](struct@f16), [`bf16`].
pub trait Element: Copy + sealed::Sealed {
    /// The exact value as `f64` (branch-free, so that loops over it vectorise).
    fn to_f64(self) -> f64;
    /// `v` rounded to the precision arithmetic on this type is done in (`f64` for `f64`, `f32`
    /// for the others): the saturation band compares `|x - center|` as the framework does.
    fn round(v: f64) -> f64;
}

impl Element for f32 {
    #[inline]
    fn to_f64(self) -> f64 {
        f64::from(self)
    }
    #[inline]
    fn round(v: f64) -> f64 {
        f64::from(v as f32)
    }
}

impl Element for f64 {
    #[inline]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline]
    fn round(v: f64) -> f64 {
        v
    }
}

impl Element for f16 {
    #[inline]
    fn to_f64(self) -> f64 {
        f16_bits_to_f64(self.to_bits())
    }
    #[inline]
    fn round(v: f64) -> f64 {
        f64::from(v as f32)
    }
}

impl Element for bf16 {
    #[inline]
    fn to_f64(self) -> f64 {
        f64::from(f32::from_bits(u32::from(self.to_bits()) << 16))
    }
    #[inline]
    fn round(v: f64) -> f64 {
        f64::from(v as f32)
    }
}

/// IEEE binary16 bits to `f64`, exactly, without branches (`half`'s own conversion detects the
/// CPU's F16C support per call, which keeps loops scalar) and without subnormal arithmetic
/// (which a flush-to-zero mode would zero).
#[inline]
fn f16_bits_to_f64(h: u16) -> f64 {
    // 32-bit integer lanes throughout (SSE2 compares them); every f16 is a normal f32.
    let em = u32::from(h & 0x7fff);
    let normal = f32::from_bits((em << 13) + ((127 - 15) << 23));
    let subnormal = f32::from(h & 0x3ff) * (1.0 / 16_777_216.0); // m * 2^-24, exact
    let special = f32::from_bits((em << 13) | 0x7f80_0000); // inf, NaN (payload kept)
    let v = if em < 0x400 {
        subnormal
    } else if em >= 0x7c00 {
        special
    } else {
        normal
    };
    f64::from(f32::from_bits(v.to_bits() | (u32::from(h & 0x8000) << 16)))
}

/// The larger of `m` and `v`, NaN as soon as either is NaN (sticky, like `torch.amax`).
#[inline]
fn nan_max(m: f64, v: f64) -> f64 {
    if v > m || v.is_nan() { v } else { m }
}

/// The larger of `m` and `v`, ignoring a NaN `v` (one `maxpd`); callers detect NaN apart.
#[inline]
fn fmax(m: f64, v: f64) -> f64 {
    if v > m { v } else { m }
}

/// The smaller of `m` and `v`, ignoring a NaN `v`.
#[inline]
fn fmin(m: f64, v: f64) -> f64 {
    if v < m { v } else { m }
}

/// `sum(x^2)` in `f64` (NaN if any element is NaN, inf if any is infinite and none NaN).
pub fn sum_squares<T: Element>(xs: &[T]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            let v = x.to_f64();
            *a += v * v;
        }
    }
    let mut s: f64 = acc.iter().sum();
    for x in rest {
        let v = x.to_f64();
        s += v * v;
    }
    s
}

/// The L2 norm: `sqrt` of the `f64` sum of squares (so `f32` values whose squares overflow
/// `f32` still give a finite norm). 0 for an empty slice.
pub fn l2_norm<T: Element>(xs: &[T]) -> f64 {
    sum_squares(xs).sqrt()
}

/// The largest element (NaN if any is NaN; `-inf` for an empty slice).
pub fn max<T: Element>(xs: &[T]) -> f64 {
    let mut acc = [f64::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, x) in acc.iter_mut().zip(c) {
            *a = nan_max(*a, x.to_f64());
        }
    }
    let m = acc.iter().fold(f64::NEG_INFINITY, |m, &a| nan_max(m, a));
    rest.iter().fold(m, |m, x| nan_max(m, x.to_f64()))
}

/// The largest magnitude `max |x|` (NaN if any element is NaN; 0 for an empty slice).
pub fn abs_max<T: Element>(xs: &[T]) -> f64 {
    let mut acc = [0.0f64; LANES];
    let mut l1 = [0.0f64; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for ((m, s), x) in acc.iter_mut().zip(l1.iter_mut()).zip(c) {
            let a = x.to_f64().abs();
            *m = fmax(*m, a);
            *s += a; // NaN detector: a sum of values >= 0 is NaN only on a NaN element
        }
    }
    let mut m = acc.iter().fold(0.0, |m, &a| fmax(m, a));
    let mut s: f64 = l1.iter().sum();
    for x in rest {
        let a = x.to_f64().abs();
        m = fmax(m, a);
        s += a;
    }
    if s.is_nan() { f64::NAN } else { m }
}

/// `min, max, mean, std` of a batch (the engine's input statistics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    /// Smallest element (NaN if any element is NaN).
    pub min: f64,
    /// Largest element (NaN if any element is NaN).
    pub max: f64,
    /// Mean.
    pub mean: f64,
    /// Population standard deviation (correction 0), from the squared deviations from the
    /// mean (a second pass: no cancellation).
    pub std: f64,
}

/// `min, max, mean, std` of the elements, in two passes; `None` for an empty slice.
pub fn stats<T: Element>(xs: &[T]) -> Option<Stats> {
    if xs.is_empty() {
        return None;
    }
    let mut lo = [f64::INFINITY; LANES];
    let mut hi = [f64::NEG_INFINITY; LANES];
    let mut sum = [0.0f64; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (((l, h), s), x) in lo.iter_mut().zip(hi.iter_mut()).zip(sum.iter_mut()).zip(c) {
            let v = x.to_f64();
            *l = fmin(*l, v);
            *h = fmax(*h, v);
            *s += v;
        }
    }
    let mut min = lo.iter().fold(f64::INFINITY, |m, &a| fmin(m, a));
    let mut max = hi.iter().fold(f64::NEG_INFINITY, |m, &a| fmax(m, a));
    let mut total: f64 = sum.iter().sum();
    for x in rest {
        let v = x.to_f64();
        min = fmin(min, v);
        max = fmax(max, v);
        total += v;
    }
    // The sum is NaN on a NaN element (or on +inf and -inf): only then look for a NaN.
    if total.is_nan() && xs.iter().any(|x| x.to_f64().is_nan()) {
        min = f64::NAN;
        max = f64::NAN;
    }
    let n = xs.len() as f64;
    let mean = total / n;
    let mut dev = [0.0f64; LANES];
    let chunks = xs.chunks_exact(LANES);
    for c in chunks {
        for (d, x) in dev.iter_mut().zip(c) {
            let e = x.to_f64() - mean;
            *d += e * e;
        }
    }
    let mut var: f64 = dev.iter().sum();
    for x in rest {
        let e = x.to_f64() - mean;
        var += e * e;
    }
    Some(Stats {
        min,
        max,
        mean,
        std: (var / n).sqrt(),
    })
}

/// Whether every element is exactly zero (`-0.0` is zero, NaN is not).
fn all_zero<T: Element>(xs: &[T]) -> bool {
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        if c.iter().fold(false, |any, x| any | (x.to_f64() != 0.0)) {
            return false;
        }
    }
    rest.iter().all(|x| x.to_f64() == 0.0)
}

/// Of a C-contiguous `(rows, cols, inner)` tensor (a gradient of shape `(R, C, *rest)`): the
/// share of rows `r` whose whole slab `t[r, :, :]` is exactly zero, and the share of columns
/// `c` whose `t[:, c, :]` is. `scratch` is reused between calls. NaN for both when a dimension
/// is 0 or `xs.len() != rows * cols * inner`.
pub fn zero_shares<T: Element>(
    xs: &[T],
    rows: usize,
    cols: usize,
    inner: usize,
    scratch: &mut Vec<bool>,
) -> (f64, f64) {
    if rows == 0
        || cols == 0
        || inner == 0
        || rows.checked_mul(cols).and_then(|n| n.checked_mul(inner)) != Some(xs.len())
    {
        return (f64::NAN, f64::NAN);
    }
    scratch.clear();
    scratch.resize(cols, false); // whether column c has a nonzero element
    let mut zero_rows = 0usize;
    for slab in xs.chunks_exact(cols * inner) {
        let mut row_zero = true;
        if inner == 1 {
            for (nz, x) in scratch.iter_mut().zip(slab) {
                let z = x.to_f64() == 0.0;
                *nz |= !z;
                row_zero &= z;
            }
        } else {
            for (nz, block) in scratch.iter_mut().zip(slab.chunks_exact(inner)) {
                if !all_zero(block) {
                    *nz = true;
                    row_zero = false;
                }
            }
        }
        zero_rows += usize::from(row_zero);
    }
    let zero_cols = scratch.iter().filter(|nz| !**nz).count();
    (
        zero_rows as f64 / rows as f64,
        zero_cols as f64 / cols as f64,
    )
}

/// The mean slope of a bounded activation, estimated from its outputs `y`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Slope {
    /// `tanh`: `1 - mean(y^2)`.
    Tanh,
    /// `sigmoid`: `mean(y) - mean(y^2)`.
    Sigmoid,
    /// `softsign`: `mean((1 - |y|)^2)`.
    Softsign,
}

/// What to measure on one activation module's output (the engine's probe, resolved).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutputProbe {
    /// The unit axis the engine asked for (1: channels; resolved by [`unit_axis`]).
    pub unit_axis: i64,
    /// Centre of the saturation band.
    pub center: f64,
    /// Half-width of the saturation band; `None`: no saturation share.
    pub half: Option<f64>,
    /// `ReLU` family: the largest output and the share of dead units.
    pub death: bool,
    /// Mean slope to estimate, if any.
    pub slope: Option<Slope>,
}

/// The axis of a module output of `nd` dimensions (batch first) that indexes units: the
/// requested one, the last when channels are asked of a `(B, C)` output, the only axis of an
/// unbatched vector; 0 for a 0-d output (one unit).
pub fn unit_axis(requested: i64, nd: usize) -> usize {
    if nd < 2 {
        0
    } else if requested == 1 && nd < 3 {
        nd - 1
    } else {
        // `nd` is a tensor's dimension count (small): the conversions are exact.
        requested.rem_euclid(i64::try_from(nd).unwrap_or(i64::MAX)) as usize
    }
}

/// The statistics of one activation output (the engine's activation row).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ActivationRow {
    /// `max y` with `death` (outputs of the `ReLU` family are >= 0), else `max |y|`; NaN if any
    /// element is NaN.
    pub absmax: f64,
    /// Share of elements with `|y - center| > half` (NaN if any is NaN); with a band only.
    pub saturation: Option<f64>,
    /// Share of units whose maximum over all other dimensions is exactly 0 (a unit holding a
    /// NaN is not dead); with `death` only.
    pub dead: Option<f64>,
    /// The probe's mean slope estimate; with a slope only.
    pub slope: Option<f64>,
    /// Elements per unit: batch x spatial samples behind each death verdict.
    pub samples_per_unit: f64,
}

/// Global sums of one pass; `BAND`/`SUMS` select the optional accumulators at compile time.
struct Pass {
    absmax: f64,
    band: f64,
    sum: f64,
    sum_sq: f64,
    l1: f64,
}

fn pass<T: Element, const BAND: bool, const SUMS: bool>(xs: &[T], center: f64, half: f64) -> Pass {
    let mut am = [0.0f64; LANES];
    let mut band = [0u64; LANES];
    let mut sum = [0.0f64; LANES];
    let mut sq = [0.0f64; LANES];
    let mut l1 = [0.0f64; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..LANES {
            let v = c[j].to_f64();
            let a = v.abs();
            am[j] = fmax(am[j], a);
            // Sum of magnitudes: always, it is the NaN detector (a sum of values >= 0 turns
            // NaN only on a NaN element).
            l1[j] += a;
            if BAND {
                band[j] += u64::from(T::round(v - center).abs() > half); // branch-free count
            }
            if SUMS {
                sum[j] += v;
                sq[j] += v * v;
            }
        }
    }
    let mut p = Pass {
        absmax: am.iter().fold(0.0, |m, &a| fmax(m, a)),
        band: band.iter().sum::<u64>() as f64,
        sum: sum.iter().sum(),
        sum_sq: sq.iter().sum(),
        l1: l1.iter().sum(),
    };
    for x in rest {
        let v = x.to_f64();
        let a = v.abs();
        p.absmax = fmax(p.absmax, a);
        p.l1 += a;
        if BAND && T::round(v - center).abs() > half {
            p.band += 1.0;
        }
        p.sum += v;
        p.sum_sq += v * v;
    }
    if p.l1.is_nan() {
        p.absmax = f64::NAN;
    }
    p
}

/// The statistics the probe asks of one module output `xs` of shape `shape` (C-contiguous,
/// batch first; `[]` for a 0-d output). `scratch` (per-unit maxima) is reused between calls.
///
/// # Panics
/// If `shape` does not multiply to `xs.len()`.
pub fn activation<T: Element>(
    xs: &[T],
    shape: &[usize],
    probe: &OutputProbe,
    scratch: &mut Vec<f64>,
) -> ActivationRow {
    assert_eq!(
        shape.iter().product::<usize>(),
        xs.len(),
        "shape and element count differ"
    );
    let n = xs.len() as f64;
    let nd = shape.len();
    // Elements are (outer, units, inner) in memory: a unit's values are `inner` in a row.
    let (units, inner) = if nd == 0 {
        (1, 1)
    } else {
        let axis = unit_axis(probe.unit_axis, nd);
        (shape[axis], shape[axis + 1..].iter().product::<usize>())
    };
    let samples_per_unit = n / units.max(1) as f64;
    let mut dead = None;
    let mut top = None;
    if probe.death {
        scratch.clear();
        scratch.resize(units, f64::NEG_INFINITY);
        if units > 0 && inner > 0 {
            for slab in xs.chunks_exact(units * inner) {
                if inner == 1 {
                    for (m, x) in scratch.iter_mut().zip(slab) {
                        *m = nan_max(*m, x.to_f64());
                    }
                } else {
                    for (m, block) in scratch.iter_mut().zip(slab.chunks_exact(inner)) {
                        *m = nan_max(*m, max(block));
                    }
                }
            }
        }
        let zero = scratch.iter().filter(|m| **m == 0.0).count();
        dead = Some(zero as f64 / units as f64);
        top = Some(
            scratch
                .iter()
                .fold(f64::NEG_INFINITY, |m, &a| nan_max(m, a)),
        );
    }
    let sums = probe.slope.is_some();
    let band = probe.half.is_some();
    let need_pass = !probe.death || band || sums;
    let p = if need_pass {
        let (c, h) = (T::round(probe.center), T::round(probe.half.unwrap_or(0.0)));
        Some(match (band, sums) {
            (false, false) => pass::<T, false, false>(xs, c, h),
            (true, false) => pass::<T, true, false>(xs, c, h),
            (false, true) => pass::<T, false, true>(xs, c, h),
            (true, true) => pass::<T, true, true>(xs, c, h),
        })
    } else {
        None
    };
    let absmax = top.or(p.as_ref().map(|p| p.absmax)).unwrap_or(f64::NAN);
    let any_nan = absmax.is_nan();
    let saturation = match (&p, band) {
        (Some(p), true) => Some(if any_nan { f64::NAN } else { p.band / n }),
        _ => None,
    };
    let slope = match (&p, probe.slope) {
        (Some(p), Some(s)) => {
            let (m, sq, l1) = (p.sum / n, p.sum_sq / n, p.l1 / n);
            Some(match s {
                Slope::Tanh => 1.0 - sq,
                Slope::Sigmoid => m - sq,
                Slope::Softsign => 1.0 - 2.0 * l1 + sq,
            })
        }
        _ => None,
    };
    ActivationRow {
        absmax,
        saturation,
        dead,
        slope,
        samples_per_unit,
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp)] // the kernels' results are checked exactly where they must be exact
mod tests {
    use super::*;

    /// Deterministic pseudo-random values in [-scale, scale).
    fn values(n: usize, seed: u64, scale: f64) -> Vec<f64> {
        let mut s = seed
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6_364_136_223_846_793_005)
                    .wrapping_add(1_442_695_040_888_963_407);
                ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
            })
            .collect()
    }

    fn conv<T: Element>(v: &[f64], f: impl Fn(f64) -> T) -> (Vec<T>, Vec<f64>) {
        let xs: Vec<T> = v.iter().map(|&x| f(x)).collect();
        let exact = xs.iter().map(|x| x.to_f64()).collect();
        (xs, exact)
    }

    /// Equal, or both NaN, or within a relative tolerance.
    fn close(a: f64, b: f64) -> bool {
        (a.is_nan() && b.is_nan())
            || a == b
            || (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1e-300)
    }

    fn naive_max(v: &[f64]) -> f64 {
        if v.iter().any(|x| x.is_nan()) {
            f64::NAN
        } else {
            v.iter().copied().fold(f64::NEG_INFINITY, f64::max)
        }
    }

    fn naive_min(v: &[f64]) -> f64 {
        if v.iter().any(|x| x.is_nan()) {
            f64::NAN
        } else {
            v.iter().copied().fold(f64::INFINITY, f64::min)
        }
    }

    /// Data sets of every length class (empty, below a chunk, chunks plus remainder) with
    /// NaN, +/-inf and huge values planted.
    fn cases() -> Vec<Vec<f64>> {
        let mut out = Vec::new();
        for (i, n) in [0usize, 1, 3, 7, 8, 9, 16, 33, 100, 1001]
            .into_iter()
            .enumerate()
        {
            let v = values(n, i as u64, 3.0);
            out.push(v.clone());
            if n > 0 {
                for special in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0] {
                    let mut w = v.clone();
                    w[n / 2] = special;
                    out.push(w);
                }
                let mut both = v.clone();
                both[0] = f64::INFINITY;
                both[n - 1] = f64::NEG_INFINITY;
                out.push(both);
                out.push(vec![0.0; n]);
            }
        }
        out
    }

    fn check_all<T: Element>(f: impl Fn(f64) -> T + Copy) {
        for case in cases() {
            let (xs, v) = conv(&case, f);
            let ss: f64 = v.iter().map(|x| x * x).sum();
            assert!(close(sum_squares(&xs), ss), "{v:?}");
            assert!(close(l2_norm(&xs), ss.sqrt()));
            assert!(close(max(&xs), naive_max(&v)), "{v:?}");
            let am = if v.is_empty() {
                0.0
            } else {
                naive_max(&v.iter().map(|x| x.abs()).collect::<Vec<_>>())
            };
            assert!(close(abs_max(&xs), am), "{v:?}");
            match stats(&xs) {
                None => assert!(v.is_empty()),
                Some(s) => {
                    let n = v.len() as f64;
                    let mean = v.iter().sum::<f64>() / n;
                    let std = (v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n).sqrt();
                    assert!(close(s.min, naive_min(&v)), "{v:?} {s:?}");
                    assert!(close(s.max, naive_max(&v)), "{v:?} {s:?}");
                    assert!(
                        (s.mean - mean).abs() <= 1e-12 * (1.0 + mean.abs()) || close(s.mean, mean),
                        "{s:?} {mean}"
                    );
                    assert!(
                        (s.std - std).abs() <= 1e-12 * (1.0 + std.abs()) || close(s.std, std),
                        "{s:?} {std}"
                    );
                }
            }
        }
    }

    #[test]
    fn kernels_match_naive_references_for_every_element_type() {
        check_all::<f64>(|x| x);
        check_all::<f32>(|x| x as f32);
        check_all::<f16>(f16::from_f64);
        check_all::<bf16>(bf16::from_f64);
    }

    #[test]
    fn half_conversions_are_exact_for_every_bit_pattern() {
        for bits in 0..=u16::MAX {
            let (a, b) = (
                f16::from_bits(bits).to_f64(),
                Element::to_f64(f16::from_bits(bits)),
            );
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{bits:#x}: {a} vs {b}"
            );
            let (a, b) = (
                bf16::from_bits(bits).to_f64(),
                Element::to_f64(bf16::from_bits(bits)),
            );
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{bits:#x}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn norms_of_values_whose_squares_overflow_f32_are_finite() {
        for n in [1usize, 5, 8, 1000] {
            let xs = vec![1e30f32; n];
            let norm = l2_norm(&xs);
            assert!(norm.is_finite());
            let want = f64::from(1e30f32) * (n as f64).sqrt();
            assert!((norm - want).abs() <= 1e-12 * want, "{norm} vs {want}");
            assert!((norm as f32).is_finite());
        }
        // f16 max (65504) squared overflows f16 and barely fits f32; f64 has room.
        let xs = vec![f16::MAX; 9];
        assert!((l2_norm(&xs) - 65504.0 * 3.0).abs() < 1e-9);
        let xs = vec![bf16::MAX; 4];
        assert!((l2_norm(&xs) - bf16::MAX.to_f64() * 2.0).abs() <= 1e-12 * bf16::MAX.to_f64());
    }

    #[test]
    fn nan_wins_over_inf_in_norms_and_maxima() {
        let xs = [
            1.0f32,
            f32::INFINITY,
            f32::NAN,
            2.0,
            f32::NEG_INFINITY,
            0.0,
            1.0,
            1.0,
            1.0,
        ];
        assert!(l2_norm(&xs).is_nan());
        assert!(abs_max(&xs).is_nan());
        assert!(max(&xs).is_nan());
        let s = stats(&xs).unwrap();
        assert!(s.min.is_nan() && s.max.is_nan() && s.mean.is_nan() && s.std.is_nan());
        let xs = [1.0f32, f32::INFINITY, 2.0];
        assert_eq!(l2_norm(&xs), f64::INFINITY);
        assert_eq!(abs_max(&[1.0f32, f32::NEG_INFINITY]), f64::INFINITY);
        assert_eq!(abs_max::<f32>(&[]), 0.0);
        assert_eq!(l2_norm::<f32>(&[]), 0.0);
        assert_eq!(stats::<f32>(&[]), None);
    }

    fn naive_zero_shares(v: &[f64], r: usize, c: usize, k: usize) -> (f64, f64) {
        let at = |i: usize, j: usize, l: usize| v[(i * c + j) * k + l];
        let zr = (0..r)
            .filter(|&i| (0..c).all(|j| (0..k).all(|l| at(i, j, l) == 0.0)))
            .count();
        let zc = (0..c)
            .filter(|&j| (0..r).all(|i| (0..k).all(|l| at(i, j, l) == 0.0)))
            .count();
        (zr as f64 / r as f64, zc as f64 / c as f64)
    }

    #[test]
    fn zero_shares_match_a_naive_count() {
        let mut scratch = Vec::new();
        for (seed, (r, c, k)) in [
            (3, 4, 1),
            (5, 2, 9),
            (1, 1, 1),
            (7, 3, 17),
            (2, 16, 1),
            (4, 4, 3),
        ]
        .into_iter()
        .enumerate()
        {
            for nan in [false, true] {
                let mut v = values(r * c * k, seed as u64, 1.0);
                // Zero out some rows and columns (and plant -0.0 and a NaN).
                for i in 0..r {
                    for j in 0..c {
                        for l in 0..k {
                            if i % 2 == 0 || j % 3 == 1 {
                                v[(i * c + j) * k + l] = if l % 2 == 0 { 0.0 } else { -0.0 };
                            }
                        }
                    }
                }
                if nan {
                    v[0] = f64::NAN;
                }
                let want = naive_zero_shares(&v, r, c, k);
                for got in [
                    zero_shares(&conv(&v, |x| x as f32).0, r, c, k, &mut scratch),
                    zero_shares(&v, r, c, k, &mut scratch),
                    zero_shares(&conv(&v, f16::from_f64).0, r, c, k, &mut scratch),
                    zero_shares(&conv(&v, bf16::from_f64).0, r, c, k, &mut scratch),
                ] {
                    assert_eq!(got, want, "{r}x{c}x{k} nan={nan}");
                }
            }
        }
        let (a, b) = zero_shares::<f32>(&[], 0, 3, 1, &mut scratch);
        assert!(a.is_nan() && b.is_nan());
        let (a, b) = zero_shares(&[1.0f32, 2.0], 3, 1, 1, &mut scratch);
        assert!(a.is_nan() && b.is_nan());
    }

    /// The activation row computed the slow way, from the definitions.
    fn naive_activation(
        v: &[f64],
        shape: &[usize],
        p: &OutputProbe,
        round: impl Fn(f64) -> f64,
    ) -> ActivationRow {
        let n = v.len() as f64;
        let any_nan = v.iter().any(|x| x.is_nan());
        let nd = shape.len();
        let (axis, units) = if nd == 0 {
            (0, 1)
        } else {
            let a = unit_axis(p.unit_axis, nd);
            (a, shape[a])
        };
        let inner: usize = if nd == 0 {
            1
        } else {
            shape[axis + 1..].iter().product()
        };
        let unit_of = |i: usize| if nd == 0 { 0 } else { (i / inner) % units };
        let absmax = if p.death {
            naive_max(v)
        } else {
            naive_max(&v.iter().map(|x| x.abs()).collect::<Vec<_>>())
        };
        let dead = p.death.then(|| {
            let d = (0..units)
                .filter(|&u| {
                    let vals: Vec<f64> = (0..v.len())
                        .filter(|&i| unit_of(i) == u)
                        .map(|i| v[i])
                        .collect();
                    naive_max(&vals) == 0.0
                })
                .count();
            d as f64 / units as f64
        });
        let saturation = p.half.map(|h| {
            if any_nan {
                f64::NAN
            } else {
                let c = round(p.center);
                v.iter().filter(|&&x| round(x - c).abs() > round(h)).count() as f64 / n
            }
        });
        let (m, sq, l1) = (
            v.iter().sum::<f64>() / n,
            v.iter().map(|x| x * x).sum::<f64>() / n,
            v.iter().map(|x| x.abs()).sum::<f64>() / n,
        );
        let slope = p.slope.map(|s| match s {
            Slope::Tanh => 1.0 - sq,
            Slope::Sigmoid => m - sq,
            Slope::Softsign => 1.0 - 2.0 * l1 + sq,
        });
        ActivationRow {
            absmax,
            saturation,
            dead,
            slope,
            samples_per_unit: n / units as f64,
        }
    }

    fn close_opt(a: Option<f64>, b: Option<f64>) -> bool {
        match (a, b) {
            (None, None) => true,
            (Some(a), Some(b)) => close(a, b) || (a - b).abs() < 1e-12,
            _ => false,
        }
    }

    fn check_activation<T: Element>(f: impl Fn(f64) -> T + Copy) {
        let mut scratch = Vec::new();
        let shapes: [&[usize]; 7] = [
            &[],
            &[5],
            &[4, 3],
            &[2, 3, 4],
            &[3, 2, 5, 5],
            &[9, 17],
            &[2, 1, 3],
        ];
        let probes = [
            OutputProbe {
                unit_axis: 1,
                center: 0.0,
                half: None,
                death: true,
                slope: None,
            },
            OutputProbe {
                unit_axis: -1,
                center: 0.0,
                half: Some(0.9),
                death: false,
                slope: Some(Slope::Tanh),
            },
            OutputProbe {
                unit_axis: 1,
                center: 0.5,
                half: Some(0.45),
                death: false,
                slope: Some(Slope::Sigmoid),
            },
            OutputProbe {
                unit_axis: 1,
                center: 0.0,
                half: None,
                death: false,
                slope: Some(Slope::Softsign),
            },
            OutputProbe {
                unit_axis: 2,
                center: 3.0,
                half: Some(3.0),
                death: true,
                slope: None,
            },
            OutputProbe {
                unit_axis: 1,
                center: 0.0,
                half: None,
                death: false,
                slope: None,
            },
        ];
        for (seed, shape) in shapes.iter().enumerate() {
            let n: usize = shape.iter().product();
            for variant in 0..4 {
                let mut v = values(n, seed as u64 + 100, 1.0);
                match variant {
                    1 => v.iter_mut().step_by(2).for_each(|x| *x = x.max(0.0)), // ReLU-like
                    2 => v[n / 2] = f64::NAN,
                    3 => v
                        .iter_mut()
                        .for_each(|x| *x = x.max(0.0) * f64::from(u8::from(*x > 0.5))),
                    _ => {}
                }
                let (xs, exact) = conv(&v, f);
                for p in &probes {
                    let got = activation(&xs, shape, p, &mut scratch);
                    let want = naive_activation(&exact, shape, p, T::round);
                    assert!(
                        close(got.absmax, want.absmax),
                        "{shape:?} {p:?} {got:?} {want:?}"
                    );
                    assert!(
                        close_opt(got.saturation, want.saturation),
                        "{shape:?} {p:?} {got:?} {want:?}"
                    );
                    assert!(
                        close_opt(got.dead, want.dead),
                        "{shape:?} {p:?} {got:?} {want:?}"
                    );
                    assert!(
                        close_opt(got.slope, want.slope),
                        "{shape:?} {p:?} {got:?} {want:?}"
                    );
                    assert!(
                        close(got.samples_per_unit, want.samples_per_unit),
                        "{shape:?} {p:?}"
                    );
                }
            }
        }
    }

    #[test]
    fn activation_rows_match_the_definitions() {
        check_activation::<f32>(|x| x as f32);
        check_activation::<f64>(|x| x);
        check_activation::<f16>(f16::from_f64);
        check_activation::<bf16>(bf16::from_f64);
    }

    #[test]
    fn unit_axis_follows_the_collector() {
        assert_eq!(unit_axis(1, 0), 0);
        assert_eq!(unit_axis(1, 1), 0);
        assert_eq!(unit_axis(1, 2), 1);
        assert_eq!(unit_axis(1, 4), 1);
        assert_eq!(unit_axis(-1, 3), 2);
        assert_eq!(unit_axis(5, 3), 2);
    }

    /// Speed of the main kernels in this build (`cargo test --release -p neuraldbg-core --lib
    /// measure::tests::speed -- --nocapture --ignored`); printed, not asserted.
    #[test]
    #[ignore = "timing, run by hand"]
    #[allow(clippy::print_stdout)]
    fn speed() {
        use std::hint::black_box;
        use std::time::Instant;
        let v: Vec<f32> = values(1 << 20, 7, 1.0)
            .into_iter()
            .map(|x| x as f32)
            .collect();
        let h: Vec<bf16> = v.iter().map(|&x| bf16::from_f32(x)).collect();
        let g: Vec<f16> = v.iter().map(|&x| f16::from_f32(x)).collect();
        let probe = OutputProbe {
            unit_axis: 1,
            center: 0.0,
            half: Some(0.9),
            death: false,
            slope: Some(Slope::Tanh),
        };
        let relu = OutputProbe {
            unit_axis: 1,
            center: 0.0,
            half: None,
            death: true,
            slope: None,
        };
        let mut scratch = Vec::new();
        let time = |name: &str, f: &mut dyn FnMut() -> f64| {
            let mut best = f64::INFINITY;
            for _ in 0..30 {
                let t = Instant::now();
                black_box(f());
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!(
                "{name:<40} {:8.1} us  ({:.2} ns/element)",
                best * 1e6,
                best * 1e9 / v.len() as f64
            );
        };
        time("l2_norm f32 (1M)", &mut || l2_norm(black_box(&v)));
        time("l2_norm bf16 (1M)", &mut || l2_norm(black_box(&h)));
        time("l2_norm f16 (1M)", &mut || l2_norm(black_box(&g)));
        time("abs_max f32 (1M)", &mut || abs_max(black_box(&v)));
        time("stats f32 (1M)", &mut || {
            stats(black_box(&v)).map_or(0.0, |s| s.std)
        });
        time("zero_shares f32 (1024x1024)", &mut || {
            zero_shares(black_box(&v), 1024, 1024, 1, &mut Vec::new()).0
        });
        time("activation tanh band+slope f32 (1M)", &mut || {
            activation(black_box(&v), &[1024, 1024], &probe, &mut scratch).absmax
        });
        let band_only = OutputProbe {
            slope: None,
            ..probe
        };
        let slope_only = OutputProbe {
            half: None,
            ..probe
        };
        time("activation band f32 (1M)", &mut || {
            activation(black_box(&v), &[1024, 1024], &band_only, &mut scratch).absmax
        });
        time("activation slope f32 (1M)", &mut || {
            activation(black_box(&v), &[1024, 1024], &slope_only, &mut scratch).absmax
        });
        time("activation relu death f32 (1024x1024)", &mut || {
            activation(black_box(&v), &[1024, 1024], &relu, &mut scratch).absmax
        });
        time("activation relu death f32 (64x256x8x8)", &mut || {
            activation(black_box(&v), &[64, 256, 8, 8], &relu, &mut scratch).absmax
        });
    }
}
