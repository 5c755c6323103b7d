//! Per-series history for plots, in bounded memory however long training runs.
//!
//! A [`History`] holds many series that share one timeline. Each bucket keeps, per series, the
//! minimum and maximum finite value and the last value seen. When `capacity` buckets are full,
//! neighbours are merged pairwise and each bucket then covers twice as many observations: the
//! newest data is as fine as the oldest, memory is `capacity x series x 12` bytes forever, and
//! a non-finite value is never averaged away (it poisons its bucket's maximum to NaN).

/// One bucket of one series.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Cell {
    min: f32,
    max: f32,
    last: f32,
}

const EMPTY: Cell = Cell {
    min: f32::INFINITY,
    max: f32::NEG_INFINITY,
    last: f32::NAN,
};

impl Cell {
    fn is_empty(&self) -> bool {
        self.min == f32::INFINITY && self.max == f32::NEG_INFINITY && self.last.is_nan()
    }

    #[inline]
    fn record(&mut self, v: f32) {
        if v.is_finite() {
            self.min = self.min.min(v);
            if !self.max.is_nan() {
                self.max = self.max.max(v);
            }
        } else {
            self.max = f32::NAN;
        }
        self.last = v;
    }

    fn merge(a: Cell, b: Cell) -> Cell {
        if b.is_empty() {
            return a;
        }
        Cell {
            min: a.min.min(b.min),
            max: if a.max.is_nan() || b.max.is_nan() {
                f32::NAN
            } else {
                a.max.max(b.max)
            },
            last: b.last,
        }
    }
}

/// One stored bucket of one series, as [`History::buckets`] reads it back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bucket {
    /// Smallest finite value; `+inf` when the bucket held only non-finite values.
    pub min: f32,
    /// Largest finite value, or NaN once the bucket held a NaN or an infinity.
    pub max: f32,
    /// The last value recorded.
    pub last: f32,
}

impl Bucket {
    /// The bucket held a NaN or an infinity.
    pub fn non_finite(&self) -> bool {
        self.max.is_nan()
    }

    /// The bucket covering both, `later` after `self`.
    #[must_use]
    pub fn merge(self, later: Bucket) -> Bucket {
        let c = Cell::merge(
            Cell {
                min: self.min,
                max: self.max,
                last: self.last,
            },
            Cell {
                min: later.min,
                max: later.max,
                last: later.last,
            },
        );
        Bucket {
            min: c.min,
            max: c.max,
            last: c.last,
        }
    }
}

/// The cells of the current observation (see [`History::row`]).
#[derive(Debug)]
pub(crate) struct Row<'a>(&'a mut [Cell]);

impl Row<'_> {
    #[inline]
    pub(crate) fn record(&mut self, series: usize, value: f32) {
        self.0[series].record(value);
    }
}

/// How a bucket is summarised when read back.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reduce {
    /// The last value observed in the bucket (a real sample).
    Last,
    /// The smallest finite value.
    Min,
    /// The largest value; NaN when the bucket held a non-finite value.
    Max,
}

impl Reduce {
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "last" => Some(Reduce::Last),
            "min" => Some(Reduce::Min),
            "max" => Some(Reduce::Max),
            _ => None,
        }
    }
}

/// Many series on one shared, self-coarsening timeline.
#[derive(Clone, Debug)]
pub struct History {
    capacity: usize,
    series: usize,
    /// Observations per bucket (a power of two).
    stride: u64,
    /// Observations in the newest bucket.
    fill: u64,
    /// Last step covered by each bucket.
    steps: Vec<u64>,
    /// `steps.len() x series` cells, bucket-major.
    cells: Vec<Cell>,
}

impl History {
    /// Bytes one bucket of one series takes.
    pub const CELL_BYTES: usize = std::mem::size_of::<Cell>();

    /// A history of `series` series keeping between `capacity / 2` and `capacity` buckets.
    /// The full size is reserved at once (pages are only touched as buckets fill): growing by
    /// doubling would copy everything and could overshoot the budget by half.
    pub fn new(series: usize, capacity: usize) -> Self {
        let capacity = capacity.max(2) & !1;
        Self {
            capacity,
            series,
            stride: 1,
            fill: 0,
            steps: Vec::with_capacity(capacity),
            cells: Vec::with_capacity(capacity * series),
        }
    }

    /// Buckets kept at most.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    pub fn series(&self) -> usize {
        self.series
    }

    /// Observations folded into each bucket now.
    pub fn stride(&self) -> u64 {
        self.stride
    }

    /// Buckets in use.
    pub fn len(&self) -> usize {
        self.steps.len()
    }

    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Bytes held by the buckets.
    pub fn heap_bytes(&self) -> usize {
        self.cells.capacity() * std::mem::size_of::<Cell>()
            + self.steps.capacity() * std::mem::size_of::<u64>()
    }

    /// Starts an observation at `step`; follow with [`Self::record`] for each series that has
    /// a value. Series without a value in a bucket read back as NaN.
    pub fn begin(&mut self, step: u64) {
        if self.steps.is_empty() || self.fill >= self.stride {
            if self.steps.len() == self.capacity {
                self.coarsen();
            }
            if self.steps.is_empty() || self.fill >= self.stride {
                self.steps.push(step);
                self.cells.extend(std::iter::repeat_n(EMPTY, self.series));
                self.fill = 0;
            }
        }
        self.fill += 1;
        *self.steps.last_mut().expect("a bucket is open") = step;
    }

    /// Records `value` for `series` in the current observation.
    #[inline]
    pub fn record(&mut self, series: usize, value: f32) {
        debug_assert!(series < self.series);
        let base = (self.steps.len() - 1) * self.series;
        self.cells[base + series].record(value);
    }

    /// The current observation's cells, to record many series without recomputing where the
    /// row starts for each.
    #[inline]
    pub(crate) fn row(&mut self) -> Row<'_> {
        let base = (self.steps.len() - 1) * self.series;
        Row(&mut self.cells[base..base + self.series])
    }

    /// Records a whole row of values (one per series, in order) for the current observation.
    #[inline]
    pub fn record_row(&mut self, first_series: usize, values: impl Iterator<Item = f32>) {
        let base = (self.steps.len() - 1) * self.series + first_series;
        for (cell, v) in self.cells[base..].iter_mut().zip(values) {
            cell.record(v);
        }
    }

    /// Merges buckets pairwise, halving their number and doubling the stride.
    fn coarsen(&mut self) {
        let n = self.steps.len();
        let half = n / 2;
        for b in 0..half {
            let (i, j) = (2 * b, 2 * b + 1);
            self.steps[b] = self.steps[j];
            for s in 0..self.series {
                let merged = Cell::merge(
                    self.cells[i * self.series + s],
                    self.cells[j * self.series + s],
                );
                self.cells[b * self.series + s] = merged;
            }
        }
        self.steps.truncate(half);
        self.cells.truncate(half * self.series);
        self.stride *= 2;
        // The newest merged bucket is full; the next observation opens a fresh one.
        self.fill = self.stride;
    }

    /// The series as `(steps, values)`: one point per bucket, at the bucket's last step.
    pub fn read(&self, series: usize, reduce: Reduce) -> (Vec<u64>, Vec<f64>) {
        let values = (0..self.steps.len())
            .map(|b| {
                let c = self.cells[b * self.series + series];
                let v = match reduce {
                    Reduce::Last => c.last,
                    Reduce::Min if c.min.is_finite() => c.min,
                    Reduce::Max if c.max.is_finite() || c.max.is_nan() => c.max,
                    _ => f32::NAN,
                };
                f64::from(v)
            })
            .collect();
        (self.steps.clone(), values)
    }

    /// Last step covered by each bucket.
    pub fn steps(&self) -> &[u64] {
        &self.steps
    }

    /// Every bucket of a series as stored (None: the series had no value in it), so readers
    /// that need both extremes, or must tell "no value" from "non-finite", get them unreduced.
    pub fn buckets(&self, series: usize) -> Vec<Option<Bucket>> {
        (0..self.steps.len())
            .map(|b| {
                let c = self.cells[b * self.series + series];
                (!c.is_empty()).then_some(Bucket {
                    min: c.min,
                    max: c.max,
                    last: c.last,
                })
            })
            .collect()
    }

    /// Largest value of a series over the buckets overlapping `[from, to]` (NaN if any of them
    /// held a non-finite value, None if none has a value).
    pub fn max_between(&self, series: usize, from: u64, to: u64) -> Option<f64> {
        let mut out: Option<f64> = None;
        let mut start = 0u64;
        for (b, &end) in self.steps.iter().enumerate() {
            if end >= from && start <= to {
                let c = self.cells[b * self.series + series];
                if !c.is_empty() {
                    let v = if c.max.is_nan() {
                        f64::NAN
                    } else {
                        f64::from(c.max)
                    };
                    out = Some(match out {
                        Some(o) if o.is_nan() || v.is_nan() => f64::NAN,
                        Some(o) => o.max(v),
                        None => v,
                    });
                }
            }
            start = end + 1;
        }
        out
    }
}

#[cfg(test)]
#[allow(clippy::float_cmp)] // extremes must survive coarsening exactly
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn exact_until_full_then_coarsens() {
        let mut h = History::new(2, 8);
        for step in 0..8u64 {
            h.begin(step);
            h.record(0, step as f32);
            h.record(1, -(step as f32));
        }
        let (steps, v) = h.read(0, Reduce::Last);
        assert_eq!(steps, (0..8).collect::<Vec<_>>());
        assert_eq!(v, (0..8).map(f64::from).collect::<Vec<_>>());
        h.begin(8);
        h.record(0, 8.0);
        let (steps, v) = h.read(0, Reduce::Max);
        assert_eq!(steps, vec![1, 3, 5, 7, 8]);
        assert_eq!(v, vec![1.0, 3.0, 5.0, 7.0, 8.0]);
        assert_eq!(h.stride(), 2);
    }

    #[test]
    fn nan_survives_coarsening() {
        let mut h = History::new(1, 4);
        for step in 0..100u64 {
            h.begin(step);
            h.record(0, if step == 37 { f32::NAN } else { 1.0 });
        }
        let (steps, max) = h.read(0, Reduce::Max);
        let hit: Vec<_> = steps.iter().zip(&max).filter(|(_, v)| v.is_nan()).collect();
        assert_eq!(hit.len(), 1, "{steps:?} {max:?}");
        assert!(h.max_between(0, 30, 40).unwrap().is_nan());
    }

    #[test]
    fn buckets_tell_no_value_from_non_finite_and_merge_like_coarsening() {
        let mut h = History::new(2, 8);
        for step in 0..4u64 {
            h.begin(step);
            h.record(
                0,
                if step == 2 {
                    f32::INFINITY
                } else {
                    step as f32
                },
            );
        }
        let b = h.buckets(0);
        let empty = h.buckets(1);
        assert!(
            empty.iter().all(Option::is_none),
            "series 1 never had a value"
        );
        assert!(b[2].unwrap().non_finite() && !b[1].unwrap().non_finite());
        let merged = b[1].unwrap().merge(b[2].unwrap()).merge(b[3].unwrap());
        assert!(merged.non_finite());
        assert_eq!(merged.min, 1.0);
        assert_eq!(merged.last, 3.0);
        assert_eq!(h.steps(), &[0, 1, 2, 3]);
    }

    proptest! {
        /// Memory stays within capacity, buckets stay ordered, and the global maximum and
        /// minimum of the series are preserved exactly, for any length.
        #[test]
        fn bounded_and_extremes_preserved(values in proptest::collection::vec(0.0f32..1e6, 1..3000), cap in 4usize..64) {
            let mut h = History::new(1, cap);
            for (i, v) in values.iter().enumerate() {
                h.begin(i as u64);
                h.record(0, *v);
            }
            prop_assert!(h.len() <= cap.max(2) & !1 || h.len() <= cap);
            let (steps, max) = h.read(0, Reduce::Max);
            let (_, min) = h.read(0, Reduce::Min);
            prop_assert!(steps.windows(2).all(|w| w[0] < w[1]));
            prop_assert_eq!(*steps.last().unwrap(), values.len() as u64 - 1);
            let true_max = values.iter().copied().fold(f32::MIN, f32::max);
            let true_min = values.iter().copied().fold(f32::MAX, f32::min);
            prop_assert_eq!(max.iter().copied().fold(f64::MIN, f64::max), f64::from(true_max));
            prop_assert_eq!(min.iter().copied().fold(f64::MAX, f64::min), f64::from(true_min));
        }
    }
}
