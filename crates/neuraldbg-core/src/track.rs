//! Per-series trackers: everything the engine remembers about a layer, an activation, the loss
//! and the input data between steps. Each is O(1) memory; analysis reads them post hoc.

use std::collections::VecDeque;

use crate::config::Config;
use crate::detector::{Debounce, Transition};
use crate::health::{
    ActivationHealth, ActivationSample, ActivationTraits, Classified, DataHealth, GradientHealth,
    LossHealth, classify_activation, classify_gradient, decades,
};

/// The first few values of a series, for a robust "how it started" level.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[repr(C)] // `len`, read on every push, first
pub struct Early {
    len: usize,
    values: [f64; 5],
}

impl Early {
    pub fn push(&mut self, v: f64) {
        if self.len < self.values.len() && v.is_finite() {
            self.values[self.len] = v;
            self.len += 1;
        }
    }

    /// Median of the values kept so far.
    pub fn median(&self) -> Option<f64> {
        median(&self.values[..self.len])
    }

    /// The first value kept.
    pub fn first(&self) -> Option<f64> {
        (self.len > 0).then_some(self.values[0])
    }
}

/// Median of a slice (None when empty), in `f64::total_cmp` order. Trackers call it every
/// step on their small windows: up to 64 values it works on a stack copy (no allocation) and
/// selects rather than sorts.
pub fn median(values: &[f64]) -> Option<f64> {
    let n = values.len();
    if n == 0 {
        return None;
    }
    let mut stack = [0.0f64; 64];
    let mut heap = Vec::new();
    let v: &mut [f64] = if n <= stack.len() {
        stack[..n].copy_from_slice(values);
        &mut stack[..n]
    } else {
        heap.extend_from_slice(values);
        &mut heap
    };
    let (below, &mut mid, _) = v.select_nth_unstable_by(n / 2, f64::total_cmp);
    Some(if n % 2 == 1 {
        mid
    } else {
        let lower = below.iter().copied().max_by(f64::total_cmp).unwrap_or(mid);
        f64::midpoint(lower, mid)
    })
}

/// Everything remembered about one layer's gradient.
///
/// `repr(C)` keeps the fields every step touches first and together: with 100,000 layers the
/// trackers no longer fit in cache, and each cache line per layer is a memory access per step.
#[derive(Clone, Debug)]
#[repr(C)]
pub struct LayerTrack {
    pub detector: Debounce<GradientHealth>,
    pub observed: u64,
    pub early: Early,
    /// Raw class of the first observation (before any debouncing).
    pub first_raw: Option<GradientHealth>,
    /// Scale of the weight at its first measurement relative to a variance-preserving init:
    /// `std(W) * sqrt(fan_in)` (`PyTorch`'s default `Linear` init gives ~0.58, He init ~1.41).
    pub gain_first: Option<f64>,
    pub weight_first: Option<f64>,
    pub weight_last: Option<f64>,
    /// Weight-norm samples taken, and how many in a row (ending with the latest) were exactly
    /// equal to the one before, since the step of the first of them (`still_since`).
    pub weight_samples: u32,
    pub weight_still: u32,
    pub still_since: u64,
    /// Step of the latest sample whose norm differed from the one before.
    pub weight_moved: Option<u64>,
    /// The latest gradient norm.
    pub grad_last: f64,
    /// Exactly-zero rows (output units) and columns (input units) of the weight's gradient:
    /// the latest shares measured, and the first step of the current stretch at >= 90%.
    pub zero_rows: ZeroShare,
    pub zero_cols: ZeroShare,
    /// How far the optimizer moved the weight relative to its size: the first finite
    /// measurements.
    pub update_early: Early,
    /// The cosine between those moves and the weight's gradient: the first finite
    /// measurements.
    pub direction_early: Early,
}

/// The share of a weight gradient's rows or columns that are exactly zero, over the steps it
/// was measured.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ZeroShare {
    pub last: Option<f64>,
    /// First step of the current stretch of measurements at or above [`ZeroShare::DEAD`].
    pub since: Option<u64>,
}

impl ZeroShare {
    /// The share from which a layer's units count as dead.
    pub const DEAD: f64 = 0.9;

    pub fn observe(&mut self, step: u64, share: f64) {
        if !share.is_finite() {
            return;
        }
        self.last = Some(share);
        if share >= Self::DEAD {
            self.since.get_or_insert(step);
        } else {
            self.since = None;
        }
    }
}

impl Default for LayerTrack {
    fn default() -> Self {
        Self {
            detector: Debounce::new(GradientHealth::Healthy),
            observed: 0,
            first_raw: None,
            early: Early::default(),
            gain_first: None,
            weight_first: None,
            weight_last: None,
            weight_samples: 0,
            weight_still: 0,
            still_since: 0,
            weight_moved: None,
            grad_last: f64::NAN,
            zero_rows: ZeroShare::default(),
            zero_cols: ZeroShare::default(),
            update_early: Early::default(),
            direction_early: Early::default(),
        }
    }
}

impl LayerTrack {
    /// Feeds one weight-norm sample.
    pub fn observe_weight(&mut self, step: u64, norm: f64) {
        match self.weight_last {
            Some(prev) if prev.to_bits() == norm.to_bits() => self.weight_still += 1,
            Some(_) => {
                self.weight_still = 0;
                self.still_since = step;
                self.weight_moved = Some(step);
            }
            None => self.still_since = step,
        }
        self.weight_samples += 1;
        self.weight_first.get_or_insert(norm);
        self.weight_last = Some(norm);
    }

    /// Feeds one gradient norm; returns the confirmed transition, if any.
    #[inline]
    pub fn observe(
        &mut self,
        step: u64,
        norm: f64,
        config: &Config,
    ) -> Option<(Transition<GradientHealth>, Classified<GradientHealth>)> {
        let c = classify_gradient(norm, self.detector.state(), config);
        if self.observed == 0 {
            self.first_raw = Some(c.state);
        }
        self.observed += 1;
        self.grad_last = norm;
        self.early.push(norm);
        let urgent = c.state == GradientHealth::NonFinite;
        self.detector
            .update(step, norm, c, urgent, config)
            .map(|t| (t, c))
    }
}

/// Everything remembered about one activation module's output.
#[derive(Clone, Debug)]
pub struct ActTrack {
    pub detector: Debounce<ActivationHealth>,
    pub observed: u64,
    pub first_raw: Option<ActivationHealth>,
    pub max_saturated: f64,
    pub max_dead: f64,
    /// The dead share at the first measurement that had one.
    pub first_dead: f64,
    /// The dead share at the latest measurement.
    pub last_dead: f64,
    /// Mean slope at the first measurement and the smallest seen (bounded activations).
    pub first_slope: f64,
    pub min_slope: f64,
    absmax_ring: [f64; 16],
    ring_len: usize,
    ring_pos: usize,
}

impl Default for ActTrack {
    fn default() -> Self {
        Self {
            detector: Debounce::new(ActivationHealth::Normal),
            observed: 0,
            first_raw: None,
            max_saturated: f64::NAN,
            max_dead: f64::NAN,
            first_dead: f64::NAN,
            last_dead: f64::NAN,
            first_slope: f64::NAN,
            min_slope: f64::NAN,
            absmax_ring: [0.0; 16],
            ring_len: 0,
            ring_pos: 0,
        }
    }
}

fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() {
        b
    } else if b.is_nan() {
        a
    } else {
        a.max(b)
    }
}

impl ActTrack {
    pub fn observe(
        &mut self,
        step: u64,
        sample: &ActivationSample,
        traits: ActivationTraits,
        config: &Config,
    ) -> Option<(Transition<ActivationHealth>, Classified<ActivationHealth>)> {
        let median = (self.ring_len >= 4)
            .then(|| median(&self.absmax_ring[..self.ring_len]))
            .flatten();
        let c = classify_activation(sample, traits, self.detector.state(), median, config);
        if self.observed == 0 {
            self.first_raw = Some(c.state);
            self.first_slope = sample.mean_slope;
        }
        if sample.mean_slope.is_finite() {
            self.min_slope = if self.min_slope.is_nan() {
                sample.mean_slope
            } else {
                self.min_slope.min(sample.mean_slope)
            };
        }
        self.observed += 1;
        self.max_saturated = nan_max(self.max_saturated, sample.saturated_fraction);
        self.max_dead = nan_max(self.max_dead, sample.dead_fraction);
        if !sample.dead_fraction.is_nan() {
            if self.first_dead.is_nan() {
                self.first_dead = sample.dead_fraction;
            }
            self.last_dead = sample.dead_fraction;
        }
        // Only ordinary samples feed the baseline, so an anomaly cannot become the new normal.
        if c.state == ActivationHealth::Normal && sample.absmax.is_finite() {
            self.absmax_ring[self.ring_pos] = sample.absmax;
            self.ring_pos = (self.ring_pos + 1) % self.absmax_ring.len();
            self.ring_len = (self.ring_len + 1).min(self.absmax_ring.len());
        }
        let value = match c.state {
            ActivationHealth::Dead => sample.dead_fraction,
            ActivationHealth::Saturated => sample.saturated_fraction,
            _ => sample.absmax,
        };
        let urgent = c.state == ActivationHealth::NonFinite;
        self.detector
            .update(step, value, c, urgent, config)
            .map(|t| (t, c))
    }
}

/// A loss rise counts as divergence only beyond this many typical step-to-step changes.
const NOISE_MARGIN: f64 = 4.0;
/// Differences of consecutive losses before the noise estimate is used.
const NOISE_WARMUP: u64 = 10;
/// Weight of each new step in the loss's noise estimate (about the last 20 steps).
const NOISE_WEIGHT: f64 = 0.05;
/// Share of the loss's changes that reverse the one before, above which the loss bounces
/// rather than drifts with noise (which reverses 2 in 3).
const OSCILLATING: f64 = 0.85;
/// Swing of the loss, relative to its level, from which a bouncing loss counts.
const LARGE_SWING: f64 = 0.1;
/// Changes of the loss compared before their alternation is judged.
pub(crate) const ALTERNATION_PAIRS: u64 = 50;

/// The training loss: smoothed, with divergence and plateau detection.
#[derive(Clone, Debug)]
pub struct LossTrack {
    pub detector: Debounce<LossHealth>,
    pub observed: u64,
    recent: VecDeque<f64>,
    first: Vec<f64>,
    /// Median of the first three finite losses.
    pub initial: Option<f64>,
    /// Lowest smoothed loss so far.
    pub best: f64,
    pub last_smoothed: f64,
    /// Largest smoothed loss relative to the best before it.
    pub peak_ratio: f64,
    /// Start of the current flat stretch (no real improvement over the plateau window), at
    /// any level of the loss; None while it improves.
    pub flat_since: Option<u64>,
    window: VecDeque<(u64, f64)>,
    /// Mean smoothed loss over the plateau window when the current plateau was confirmed: a
    /// plateau ends only when the loss falls clearly below it (beyond its own noise).
    plateau_level: f64,
    /// Standard error of `plateau_level`.
    plateau_se: f64,
    /// Step the last loss transition was confirmed: a new one is never dated before it.
    last_event: Option<u64>,
    /// `peak_ratio` when the first plateau was confirmed: what the loss did before it
    /// flattened, not a jump that came later.
    pub peak_at_plateau: Option<f64>,
    /// Typical step-to-step change of the raw loss (an exponential average of its absolute
    /// differences): a rise or a fall smaller than a few of these is noise, not a change.
    noise: f64,
    diffs: u64,
    last_raw: f64,
    /// Consecutive nonzero differences of the raw loss compared, and how many of them changed
    /// sign (see [`LossTrack::alternation`]).
    turn_pairs: u64,
    turns: u64,
    last_diff: f64,
}

impl Default for LossTrack {
    fn default() -> Self {
        Self {
            detector: Debounce::new(LossHealth::Normal),
            observed: 0,
            recent: VecDeque::with_capacity(3),
            first: Vec::with_capacity(3),
            initial: None,
            best: f64::INFINITY,
            last_smoothed: f64::NAN,
            peak_ratio: 1.0,
            flat_since: None,
            window: VecDeque::new(),
            plateau_level: f64::NAN,
            plateau_se: f64::NAN,
            last_event: None,
            peak_at_plateau: None,
            noise: 0.0,
            diffs: 0,
            last_raw: f64::NAN,
            turn_pairs: 0,
            turns: 0,
            last_diff: 0.0,
        }
    }
}

impl LossTrack {
    /// The first finite loss: the one computed before any update.
    pub fn first_value(&self) -> Option<f64> {
        self.first.first().copied()
    }

    pub fn observe(
        &mut self,
        step: u64,
        loss: f64,
        config: &Config,
    ) -> Option<Transition<LossHealth>> {
        self.observed += 1;
        let mut c = Classified {
            state: LossHealth::Normal,
            margin: 0.0,
            threshold: f64::NAN,
        };
        let mut onset_shift = 0;
        if loss.is_finite() {
            if self.first.len() < 3 {
                self.first.push(loss);
                self.initial = median(&self.first);
            }
            if self.recent.len() == 3 {
                self.recent.pop_front();
            }
            self.recent.push_back(loss);
            let s = median(self.recent.make_contiguous()).unwrap_or(loss);
            self.last_smoothed = s;
            let initial = self.initial.unwrap_or(s);
            let current = self.detector.state();
            let h = config.hysteresis;
            // Divergence: far above the best so far and worse than where training started.
            // Only judged for positive losses, where ratios mean something.
            if self.best > 0.0 && self.best.is_finite() && initial > 0.0 {
                let factor = if current == LossHealth::Diverging {
                    config.loss_divergence_factor / h
                } else {
                    config.loss_divergence_factor
                };
                let ratio = s / self.best;
                // A rise counts beyond the loss's noise (a noisy loss's ups are no jump), once
                // there are enough steps to know it (a blow-up in the first steps is one).
                let beyond = self.diffs < NOISE_WARMUP || s - self.best > NOISE_MARGIN * self.noise;
                if beyond {
                    self.peak_ratio = self.peak_ratio.max(ratio);
                }
                // (Only to enter: a diverging loss's own swings must not end it.)
                let rose = beyond || current == LossHealth::Diverging;
                if ratio > factor.max(1.0) && s > initial && rose {
                    c = Classified {
                        state: LossHealth::Diverging,
                        margin: decades(s, self.best * config.loss_divergence_factor),
                        threshold: self.best * config.loss_divergence_factor,
                    };
                }
            }
            // Plateau: no real improvement over a window while still near the starting level.
            let w = u64::from(config.loss_plateau_window);
            if c.state == LossHealth::Normal && initial > 0.0 {
                if let Some(&(old_step, old)) = self.window.front() {
                    if step.saturating_sub(old_step) >= w && old > 0.0 {
                        let improvement = (old - s) / old;
                        if improvement < config.loss_plateau_tolerance {
                            self.flat_since.get_or_insert(old_step);
                        } else {
                            self.flat_since = None;
                        }
                        // Leaving takes a real fall of the loss, not a dip of a noisy one below
                        // its level or its (noisy) start: one event per change of state.
                        let flat = if current == LossHealth::Plateau {
                            !self.recovered(config)
                        } else {
                            s > config.loss_plateau_level * initial
                                && improvement < config.loss_plateau_tolerance
                        };
                        if flat {
                            c = Classified {
                                state: LossHealth::Plateau,
                                margin: 0.0,
                                threshold: config.loss_plateau_tolerance,
                            };
                            onset_shift = step - old_step;
                        }
                    }
                }
            }
            if s < self.best {
                self.best = s;
            }
            self.window.push_back((step, s));
            while self.window.front().is_some_and(|(st, _)| step - st > w) {
                self.window.pop_front();
            }
            if self.last_raw.is_finite() {
                // A plain mean over the first differences, then a moving one.
                self.diffs += 1;
                let weight = (1.0 / self.diffs as f64).max(NOISE_WEIGHT);
                self.noise += weight * ((loss - self.last_raw).abs() - self.noise);
                self.count_turn(loss - self.last_raw);
            }
            self.last_raw = loss;
        } else {
            c = Classified {
                state: LossHealth::NonFinite,
                margin: f64::INFINITY,
                threshold: f64::NAN,
            };
        }
        let urgent = c.state == LossHealth::NonFinite;
        let mut t = self.detector.update(step, loss, c, urgent, config);
        if let Some(t) = &mut t {
            if t.to == LossHealth::Plateau {
                // The plateau began where the flat window began, though not before the loss's
                // previous change was confirmed (events stay in the order they happened).
                let after = self.last_event.map_or(0, |e| e + 1);
                t.onset = t
                    .onset
                    .saturating_sub(onset_shift)
                    .max(after)
                    .min(t.confirmed);
                (self.plateau_level, self.plateau_se) = self.window_stats(0);
                self.peak_at_plateau.get_or_insert(self.peak_ratio);
            }
            self.last_event = Some(t.confirmed);
        }
        t
    }

    /// Counts whether the change `change` of the raw loss reverses the one before.
    fn count_turn(&mut self, change: f64) {
        if change == 0.0 {
            return;
        }
        if self.last_diff != 0.0 {
            self.turn_pairs += 1;
            self.turns += u64::from((change > 0.0) != (self.last_diff > 0.0));
        }
        self.last_diff = change;
    }

    /// Share of the loss's step-to-step changes that reverse the one before (after at least
    /// [`ALTERNATION_PAIRS`] of them). Independent noise around a trend reverses 2 changes in 3;
    /// steps that overshoot the minimum back and forth reverse nearly every one.
    pub fn alternation(&self) -> Option<f64> {
        (self.turn_pairs >= ALTERNATION_PAIRS).then(|| self.turns as f64 / self.turn_pairs as f64)
    }

    /// A loss that bounces rather than drifts: how often it reverses (at least
    /// [`OSCILLATING`]) and by how much of its level (at least [`LARGE_SWING`]).
    pub fn oscillation(&self) -> Option<(f64, f64)> {
        let alternation = self.alternation().filter(|a| *a >= OSCILLATING)?;
        let swing = self.relative_swing().filter(|s| *s >= LARGE_SWING)?;
        Some((alternation, swing))
    }

    /// The loss's typical step-to-step change relative to its current (smoothed) level.
    pub fn relative_swing(&self) -> Option<f64> {
        let level = self.last_smoothed.abs();
        (self.diffs >= NOISE_WARMUP && level > 0.0 && level.is_finite()).then(|| self.noise / level)
    }

    /// The loss's level over the older and the newer half of the plateau window: each half's
    /// mean of the smoothed losses and its standard error (see `window_stats`), once the window
    /// holds 10 of them. Their difference is how the loss moved over the window.
    pub fn halves(&self) -> Option<[(f64, f64); 2]> {
        let n = self.window.len();
        if n < 10 {
            return None;
        }
        let newer = self.window_stats(n / 2);
        let all = self.window_stats(0);
        // The older half's mean from the whole window's and the newer half's.
        let older = (all.0 * n as f64 - newer.0 * (n - n / 2) as f64) / (n / 2) as f64;
        Some([(older, newer.1), newer])
    }

    /// Mean of the smoothed losses in the window after its first `skip` entries, and its
    /// standard error from the loss's step-to-step noise (`noise` is the mean absolute
    /// difference of consecutive losses, 2/sqrt(pi) standard deviations for independent
    /// ones; a median of three is worth about 2/pi of a sample).
    fn window_stats(&self, skip: usize) -> (f64, f64) {
        let n = self.window.len().saturating_sub(skip);
        if n < 2 {
            return (f64::NAN, f64::NAN);
        }
        let mean = self.window.iter().skip(skip).map(|x| x.1).sum::<f64>() / n as f64;
        let sd = self.noise * std::f64::consts::PI.sqrt() / 2.0;
        (mean, sd / (n as f64 * 2.0 / std::f64::consts::PI).sqrt())
    }

    /// Whether the loss has come down from its plateau: the mean of the window's newer half
    /// is below the plateau's level by more than the tolerance (with hysteresis) and by more
    /// than four standard errors of the difference (it is asked every step).
    fn recovered(&self, config: &Config) -> bool {
        let skip = self.window.len() / 2;
        if self.window.len() - skip < 4 || !self.plateau_level.is_finite() {
            return false;
        }
        let (mean, se) = self.window_stats(skip);
        let drop = self.plateau_level - mean;
        let noise = 4.0 * se.hypot(self.plateau_se);
        drop > config.loss_plateau_tolerance * config.hysteresis * self.plateau_level
            && drop > noise
    }
}

/// The last values of a series, also kept sorted, so its median costs O(1) per step and an
/// update O(window) moves instead of a sort.
#[derive(Clone, Debug, Default)]
struct Window {
    arrival: VecDeque<f64>,
    sorted: Vec<f64>,
}

impl Window {
    fn len(&self) -> usize {
        self.arrival.len()
    }

    /// Adds `v`, dropping the oldest value beyond `cap`.
    fn push(&mut self, v: f64, cap: usize) {
        if self.arrival.len() == cap {
            if let Some(old) = self.arrival.pop_front() {
                let at = self.sorted.partition_point(|x| x.total_cmp(&old).is_lt());
                self.sorted.remove(at);
            }
        }
        self.arrival.push_back(v);
        let at = self.sorted.partition_point(|x| x.total_cmp(&v).is_lt());
        self.sorted.insert(at, v);
    }

    fn median(&self) -> Option<f64> {
        let n = self.sorted.len();
        match n {
            0 => None,
            _ if n % 2 == 1 => Some(self.sorted[n / 2]),
            _ => Some(f64::midpoint(self.sorted[n / 2 - 1], self.sorted[n / 2])),
        }
    }
}

/// The loss against the sum of the weights' squared norms, at the steps both were measured: a
/// least-squares line through the pairs and the first and last pair. A loss that a weight
/// penalty dominates moves with that sum, the line's slope being the penalty's coefficient.
#[derive(Clone, Debug, Default)]
pub struct LossOnWeights {
    n: u64,
    sums: [f64; 5],
    /// The first and the last `(squared norm, loss)` pair.
    pub first: Option<(f64, f64)>,
    pub last: Option<(f64, f64)>,
}

/// The slope of a least-squares line `loss = a + slope * squared norm`, and how well it fits.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Line {
    pub slope: f64,
    /// Coefficient of determination (1: every pair on the line).
    pub r2: f64,
}

impl LossOnWeights {
    pub fn add(&mut self, sq: f64, loss: f64) {
        if !(sq.is_finite() && loss.is_finite()) {
            return;
        }
        self.n += 1;
        for (s, v) in self
            .sums
            .iter_mut()
            .zip([sq, loss, sq * sq, sq * loss, loss * loss])
        {
            *s += v;
        }
        self.first.get_or_insert((sq, loss));
        self.last = Some((sq, loss));
    }

    /// The line through the pairs, from `min_pairs` of them (None while the squared norm has
    /// not moved, or the loss has not).
    pub fn line(&self, min_pairs: u64) -> Option<Line> {
        if self.n < min_pairs.max(2) {
            return None;
        }
        let n = self.n as f64;
        let [s, l, ss, sl, ll] = self.sums;
        let var_s = ss / n - (s / n).powi(2);
        let var_l = ll / n - (l / n).powi(2);
        let cov = sl / n - (s / n) * (l / n);
        if var_s <= 0.0 || var_l <= 0.0 {
            return None;
        }
        Some(Line {
            slope: cov / var_s,
            r2: (cov * cov / (var_s * var_l)).min(1.0),
        })
    }
}

/// Input batches: non-finite values and scale jumps against a running baseline.
#[derive(Clone, Debug)]
pub struct DataTrack {
    pub state: DataHealth,
    /// Scale (largest magnitude) of the first batch.
    pub first_scale: Option<f64>,
    /// The value every input of the first batch had, when they were all the same (all zero,
    /// say): a batch that gives the model nothing to tell its samples apart by.
    pub first_constant: Option<f64>,
    scales: Window,
    stds: Window,
}

impl Default for DataTrack {
    fn default() -> Self {
        Self {
            state: DataHealth::Normal,
            first_scale: None,
            first_constant: None,
            scales: Window::default(),
            stds: Window::default(),
        }
    }
}

const DATA_BASELINE: usize = 64;

impl DataTrack {
    /// Judges one batch from `(min, max, mean, std)`; returns its state and the scale ratio.
    /// A NaN anywhere in the batch makes its mean NaN, also where a backend's min and max
    /// skip NaN (XLA's fast min/max, TensorFlow's default under `jit_compile`).
    pub fn judge(&mut self, row: [f64; 4], config: &Config) -> (DataHealth, f64) {
        let [min, max, mean, std] = row;
        if !min.is_finite() || !max.is_finite() || !mean.is_finite() {
            return (DataHealth::NonFinite, f64::INFINITY);
        }
        let scale = min.abs().max(max.abs());
        if self.first_scale.is_none() {
            self.first_scale = Some(scale);
            // (min <= max always: equal when every value is the same)
            self.first_constant = (max <= min).then_some(min);
        }
        let mut ratio = 1.0f64;
        let mut state = DataHealth::Normal;
        if self.scales.len() >= config.data_baseline_batches as usize {
            let f = config.data_ood_factor;
            let ms = self.scales.median().unwrap_or(scale);
            let md = self.stds.median().unwrap_or(std);
            for (v, m) in [(scale, ms), (std, md)] {
                if m > 0.0 && v.is_finite() {
                    let r = if v >= m {
                        v / m
                    } else if v > 0.0 {
                        m / v
                    } else {
                        f64::INFINITY
                    };
                    if r > ratio {
                        ratio = r;
                    }
                }
            }
            if ratio >= f {
                state = DataHealth::OutOfDistribution;
            }
        }
        if state == DataHealth::Normal {
            self.scales.push(scale, DATA_BASELINE);
            self.stds
                .push(if std.is_finite() { std } else { 0.0 }, DATA_BASELINE);
        }
        (state, ratio)
    }

    /// Records the worst judgement of a step; returns the transition `(from, to, ratio)` if
    /// the step changed the data state.
    pub fn step(&mut self, worst: DataHealth, ratio: f64) -> Option<(DataHealth, DataHealth, f64)> {
        if worst == self.state {
            return None;
        }
        let from = self.state;
        self.state = worst;
        Some((from, worst, ratio))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_median_matches_median_of_its_values() {
        let mut w = Window::default();
        let mut kept: VecDeque<f64> = VecDeque::new();
        let mut x = 7u64;
        for _ in 0..500 {
            x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
            let v = (x >> 40) as f64 / 1e3;
            w.push(v, 64);
            kept.push_back(v);
            if kept.len() > 64 {
                kept.pop_front();
            }
            assert_eq!(w.len(), kept.len());
            assert_eq!(w.median(), median(kept.make_contiguous()));
        }
    }

    #[test]
    #[allow(clippy::float_cmp)] // exact selections of input values
    fn median_matches_sorting() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[3.0]), Some(3.0));
        assert_eq!(median(&[4.0, 1.0]), Some(2.5));
        assert_eq!(median(&[5.0, 1.0, 3.0]), Some(3.0));
        let long: Vec<f64> = (0..101).map(|i| f64::from((i * 37) % 101)).collect();
        assert_eq!(median(&long), Some(50.0));
        let even: Vec<f64> = (0..64).map(|i| f64::from((i * 7) % 64)).collect();
        assert_eq!(median(&even), Some(31.5));
    }

    #[test]
    fn loss_divergence_and_plateau() {
        let config = Config::default();
        let mut t = LossTrack::default();
        let mut events = Vec::new();
        for step in 0..10u64 {
            let loss = 2.0 - 0.1 * step as f64;
            events.extend(t.observe(step, loss, &config));
        }
        assert!(events.is_empty());
        for step in 10..20u64 {
            let loss = 1.0 * 2f64.powi((step - 9) as i32);
            events.extend(t.observe(step, loss, &config));
        }
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].to, LossHealth::Diverging);

        let mut t = LossTrack::default();
        let mut events = Vec::new();
        for step in 0..200u64 {
            events.extend(t.observe(step, 2.3 + 0.001 * ((step % 7) as f64), &config));
        }
        assert_eq!(events.len(), 1, "{events:?}");
        assert_eq!(events[0].to, LossHealth::Plateau);
        assert_eq!(events[0].onset, 0);
    }

    /// A batch loss of a model that cannot fit its targets (noise): the mean of 16 squared
    /// standard normals around `level`, from a fixed generator.
    fn noisy_losses(n: usize, level: f64, seed: u64) -> Vec<f64> {
        let mut state = seed;
        let mut uniform = || {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        (0..n)
            .map(|_| {
                let sum: f64 = (0..16)
                    .map(|_| {
                        let z = (-2.0 * uniform().ln()).sqrt()
                            * (2.0 * std::f64::consts::PI * uniform()).cos();
                        z * z
                    })
                    .sum();
                level * sum / 16.0
            })
            .collect()
    }

    #[test]
    fn a_loss_that_overshoots_back_and_forth_alternates_more_than_noise() {
        let config = Config::default();
        // Independent noise around a flat level reverses about 2 changes in 3.
        for seed in 1..20 {
            let mut t = LossTrack::default();
            for (step, loss) in noisy_losses(400, 1.0, seed).into_iter().enumerate() {
                t.observe(step as u64, loss, &config);
            }
            let a = t.alternation().unwrap();
            assert!((0.55..0.78).contains(&a), "seed {seed}: {a}");
        }
        // Steps that overshoot: the loss swings up and down around its level, with noise.
        let noise = noisy_losses(400, 0.1, 3);
        let mut t = LossTrack::default();
        for (step, n) in noise.into_iter().enumerate() {
            let swing = if step % 2 == 0 { 0.6 } else { -0.6 };
            t.observe(step as u64, 1.5 + swing + n, &config);
        }
        assert!(t.alternation().unwrap() > 0.95, "{:?}", t.alternation());
        assert!(
            t.relative_swing().unwrap() > 0.5,
            "{:?}",
            t.relative_swing()
        );
        // Too few changes to judge.
        let mut t = LossTrack::default();
        for step in 0..ALTERNATION_PAIRS {
            t.observe(step, 1.0 + 0.1 * (step % 2) as f64, &config);
        }
        assert_eq!(t.alternation(), None);
    }

    #[test]
    fn a_noisy_flat_loss_is_one_plateau_not_a_flip_flop() {
        let config = Config::default();
        for seed in 1..60 {
            let mut t = LossTrack::default();
            let mut events = Vec::new();
            for (step, loss) in noisy_losses(500, 1.0, seed).into_iter().enumerate() {
                events.extend(t.observe(step as u64, loss, &config));
            }
            let plateaus: Vec<_> = events
                .iter()
                .filter(|e| e.to == LossHealth::Plateau)
                .collect();
            assert_eq!(plateaus.len(), 1, "seed {seed}: {events:?}");
            assert!(events.len() <= 2, "seed {seed}: {events:?}");
            assert!(
                events
                    .windows(2)
                    .all(|w| w[0].onset <= w[1].onset && w[0].to == w[1].from)
            );
        }
    }

    #[test]
    fn a_plateau_ends_when_the_loss_really_falls_and_dates_stay_ordered() {
        let config = Config::default();
        let mut t = LossTrack::default();
        let mut events = Vec::new();
        let flat = noisy_losses(300, 1.0, 7);
        // Flat, then a real descent (a fixed learning rate), then flat again at a third.
        let losses = flat.iter().copied().chain(
            noisy_losses(300, 1.0, 8)
                .into_iter()
                .enumerate()
                .map(|(i, l)| l * (0.35 + 0.65 * (-(i as f64) / 40.0).exp())),
        );
        for (step, loss) in losses.enumerate() {
            events.extend(t.observe(step as u64, loss, &config));
        }
        assert_eq!(
            events.first().map(|e| e.to),
            Some(LossHealth::Plateau),
            "{events:?}"
        );
        assert!(
            events
                .iter()
                .any(|e| e.from == LossHealth::Plateau && e.confirmed > 300),
            "{events:?}"
        );
        for w in events.windows(2) {
            assert!(w[1].onset > w[0].confirmed, "{events:?}");
        }
    }

    #[test]
    fn the_peak_before_a_plateau_is_not_a_later_jump() {
        let config = Config::default();
        let mut t = LossTrack::default();
        let losses = noisy_losses(2000, 1.0, 3)
            .into_iter()
            .chain((0..100).map(|i| 1.0 + 4000.0 * f64::from(i).min(3.0)));
        for (step, loss) in losses.enumerate() {
            t.observe(step as u64, loss, &config);
        }
        assert!(t.peak_ratio > 1000.0);
        // What the loss did before it flattened, not the jump at step 2,000.
        let before = t.peak_at_plateau.unwrap();
        assert!(before < 3.0, "{before}");
    }

    #[test]
    fn converged_loss_is_not_a_plateau() {
        let config = Config::default();
        let mut t = LossTrack::default();
        let mut events = Vec::new();
        for step in 0..300u64 {
            let loss = 0.05 + 2.0 * (-(step as f64) / 20.0).exp();
            events.extend(t.observe(step, loss, &config));
        }
        assert!(events.is_empty(), "{events:?}");
    }

    #[test]
    fn data_scale_jump_and_nan() {
        let config = Config::default();
        let mut d = DataTrack::default();
        for _ in 0..10 {
            assert_eq!(
                d.judge([-2.0, 2.0, 0.0, 1.0], &config).0,
                DataHealth::Normal
            );
        }
        assert_eq!(
            d.judge([-2000.0, 2000.0, 0.0, 1000.0], &config).0,
            DataHealth::OutOfDistribution
        );
        assert_eq!(
            d.judge([f64::NAN, 1.0, 0.0, 1.0], &config).0,
            DataHealth::NonFinite
        );
        // min and max that skip NaN (XLA's fast min/max): the mean still carries it.
        assert_eq!(
            d.judge([-2.0, 2.0, f64::NAN, f64::NAN], &config).0,
            DataHealth::NonFinite
        );
        assert_eq!(
            d.judge([-2.5, 2.1, 0.1, 1.1], &config).0,
            DataHealth::Normal
        );
    }
}

/// Facts about the training loop, counted over the steps that reported them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LoopFacts {
    /// Steps that said whether the model was in training mode, and those where it was not.
    pub mode_known: u64,
    pub eval_steps: u64,
    /// Steps that said whether their gradients were added onto the previous step's, and those
    /// where they were.
    pub accumulation_known: u64,
    pub accumulated_steps: u64,
}

impl LoopFacts {
    /// Counts the loop facts of one step.
    pub fn observe(&mut self, facts: &[(crate::observation::Fact, f64)]) {
        use crate::observation::Fact;
        for &(fact, value) in facts {
            match fact {
                Fact::Training => {
                    self.mode_known += 1;
                    self.eval_steps += u64::from(value == 0.0);
                }
                Fact::GradAccumulated => {
                    self.accumulation_known += 1;
                    self.accumulated_steps += u64::from(value != 0.0);
                }
                _ => {}
            }
        }
    }

    /// Share of the reporting steps run in eval mode.
    pub fn eval_share(&self) -> Option<f64> {
        (self.mode_known > 0).then(|| self.eval_steps as f64 / self.mode_known as f64)
    }

    /// Share of the reporting steps whose gradients accumulated onto the previous step's.
    pub fn accumulated_share(&self) -> Option<f64> {
        (self.accumulation_known > 0)
            .then(|| self.accumulated_steps as f64 / self.accumulation_known as f64)
    }
}
