//! What several causes look at: run-wide facts ([`Evidence`], gathered once per analysis) and
//! per-episode facts ([`Features`]). A fact only one cause weighs is computed in that cause's
//! own file.

use super::super::remedy::Remedy;
use crate::engine::Run;
use crate::event::SemanticEvent;
use crate::health::GradientHealth;
use crate::track::{LayerTrack, median};

use super::super::episodes::{Episode, activation_gap};
use super::super::vocab::{Cause, Failure};

/// Weighted layers from which a stack is deep: deep enough for its depth alone to compound a
/// gradient's change, or, without normalization, to learn badly when nothing else is wrong.
pub(crate) const DEEP_STACK: usize = 8;

/// Run-wide facts that several causes look at.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub(crate) struct Evidence {
    pub first_step: u64,
    pub depth: usize,
    /// Median and largest weight gain at the first measurement (`std(W) * sqrt(fan_in)`;
    /// 0.58 for `PyTorch`'s default `Linear` init, 1.41 for He).
    pub gain_median: Option<f64>,
    pub gain_max: Option<(f64, usize)>,
    /// How the first gradient norms change along the layers (see [`Profile`]).
    pub profile: Option<Profile>,
    /// Median update-to-weight ratio over the weighted layers at the first steps: measured
    /// where the collector measured it (`update_measured`), else estimated from the learning
    /// rate and the first gradient and weight norms.
    pub update_ratio: Option<f64>,
    pub update_measured: bool,
    /// The optimizer scales its steps per parameter (Adam, RMSprop...): its step size does not
    /// grow with the gradient.
    pub adaptive: bool,
    pub lr_first: Option<f64>,
    pub input_scale_first: Option<f64>,
    /// The input table's features, when they are on scales far apart.
    pub feature_spread: Option<FeatureSpread>,
    pub total_early: Option<f64>,
    /// Largest finite total gradient norm before anything went non-finite.
    pub total_peak: Option<(f64, u64)>,
    pub activation_gap: u64,
    /// The loss at the start (median of the first three).
    pub loss_initial: Option<f64>,
    /// Median, over weighted layers, of `log10(gain / reference)`: decades per layer by which
    /// the initial weights scale the signal away from what the activation after them needs to
    /// keep it (reference gain sqrt(2) before ReLU-family units, 1 otherwise).
    pub init_error: Option<f64>,
    /// Where the forward signal blew up at the start, when module outputs were measured.
    pub forward: Option<ForwardGrowth>,
    /// The optimizer's weight decay, where it adds to the gradient (see [`DecayPull`]).
    pub decay_pull: Option<DecayPull>,
    /// A weight penalty written into the loss that was a large part of it from the first step
    /// (see `over_regularization`): the measured steps are then the penalty's.
    #[serde(skip)]
    pub penalty: Option<super::over_regularization::Penalty>,
}

/// The optimizer's weight decay against the loss's gradient, over the weighted layers whose
/// weight it decays through the gradient (medians over those layers).
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(crate) struct DecayPull {
    /// The decay's pull on the weight (`weight_decay x |W|`) over the loss's own gradient norm,
    /// at the first steps.
    pub pull: f64,
    /// The last weight norm measured over the first.
    pub kept: f64,
    /// The largest weight decay among those layers.
    pub weight_decay: f64,
}

/// A weight decay pulling the weights this many times harder than the loss's gradient at the
/// start, while they shrink to at most [`DECAY_KEPT`] of their first norm, shrinks them faster
/// than the data can grow them. (A small gradient alone, as in a stack whose gradients vanish,
/// makes a large pull under a usual decay; that decay does not shrink the weights by much.)
const DECAY_OUTWEIGHS: f64 = 2.0;
const DECAY_KEPT: f64 = 0.8;

/// Where the forward signal grows the most at the first measurement of module outputs: the
/// module whose output exceeds every output before it in forward order (and the input batch)
/// by the largest factor.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub(crate) struct ForwardGrowth {
    pub module: usize,
    /// Decades the module's output exceeds the largest magnitude before it.
    pub jump: f64,
    /// That largest magnitude before it, and the module's own output scale.
    pub from: f64,
    pub to: f64,
    pub step: u64,
}

/// Largest input magnitude below which inputs are far off a normalized scale (~1).
const TINY_INPUTS: f64 = 0.05;

/// Largest input magnitude above which inputs are far off a normalized scale (not normalized).
pub(crate) const HUGE_INPUTS: f64 = 20.0;

/// A first step's largest input magnitude (`Run::data.first_scale`), when it is far above a
/// normalized scale (see [`Evidence::huge_inputs`]; remedies see the run, not the evidence).
pub(crate) fn huge_inputs(first_scale: Option<f64>) -> Option<f64> {
    first_scale.filter(|x| *x > HUGE_INPUTS)
}

/// The features of a table of inputs far apart in scale (see [`uneven_features`]).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub(crate) struct FeatureSpread {
    /// The largest feature's scale over the smallest's.
    pub ratio: f64,
    /// The smallest and the largest feature (their column) and their scales.
    pub small: (usize, f64),
    pub large: (usize, f64),
}

/// Scales this many times apart leave the small features out of what the network learns in a
/// run: a feature needs a weight as many times larger to count, and the optimizer's steps take
/// that much longer to grow it (plain gradient steps, whose gradient is that much smaller too,
/// the square of it). Standardized, min-max scaled or one-hot features are within ~10x.
const UNEVEN_FEATURES: f64 = 1000.0;

/// The first step's input table, when its features are on scales at least
/// [`UNEVEN_FEATURES`] apart (each feature's scale: its largest magnitude in the batch; a
/// feature all zero in the batch, or not all finite, has none).
pub(crate) fn uneven_features(run: &Run) -> Option<FeatureSpread> {
    let scales = run.model.spec.input_feature_scales.as_ref()?;
    let known = || {
        scales
            .iter()
            .enumerate()
            .filter_map(|(i, x)| x.filter(|x| *x > 0.0).map(|x| (i, x)))
    };
    let small = known().min_by(|a, b| a.1.total_cmp(&b.1))?;
    let large = known().max_by(|a, b| a.1.total_cmp(&b.1))?;
    let ratio = large.1 / small.1;
    (ratio >= UNEVEN_FEATURES).then_some(FeatureSpread {
        ratio,
        small,
        large,
    })
}

/// A learning rate that fell to nothing and stayed there (see [`lr_collapse`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct LrCollapse {
    /// The peak and its step, the step from which the rate stayed below a thousandth of it,
    /// and the last rate and its step.
    pub peak: (u64, f64),
    pub from: u64,
    pub last: (u64, f64),
}

/// The learning rate fell below a thousandth of its peak and stayed there for at least a
/// quarter of the run (10 steps or more): a schedule that decays it far too fast (a per-epoch
/// scheduler stepped every batch). A schedule that ends at zero (cosine, linear, one-cycle)
/// gets there only in its last few steps. Only for a failure that began at `onset` or after
/// the rate's first cut: a rate first cut after the failure began was cut because of it (a
/// scheduler that reacts to a plateau, `ReduceLROnPlateau`), not the other way round.
pub(crate) fn lr_collapse(run: &Run, onset: u64) -> Option<LrCollapse> {
    let c = run.lr_course;
    if c.first_cut.is_some_and(|cut| cut > onset) {
        return None;
    }
    let (peak, from, last) = (c.peak?, c.collapsed_from?, c.last?);
    let span = last.0.saturating_sub(from) + 1;
    let observed = last.0.saturating_sub(run.first_step.unwrap_or(0)) + 1;
    (span >= 10 && 4 * span >= observed).then_some(LrCollapse { peak, from, last })
}

impl LrCollapse {
    /// Its fix, in the user's framework's terms when the remedy is worded.
    pub(crate) fn remedy(&self) -> Remedy {
        Remedy::ScheduleDecaysTooFast {
            peak: self.peak.1,
            last: self.last.1,
        }
    }
}

/// A learning rate cut at least [`OUTLASTED_CUT`]x after a failure began, which the failure
/// outlasted by 10 steps or more, to the end: the run's own experiment on its step size.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct OutlastedCut {
    /// The step of the first cut, the peak rate and the last.
    pub cut: u64,
    pub peak: f64,
    pub last: f64,
}

/// How far the rate must have been cut for a failure that outlasted the cut to clear the step
/// size: a loss held up by steps too large comes down when they are 10x smaller.
pub(crate) const OUTLASTED_CUT: f64 = 10.0;

/// See [`OutlastedCut`]: `e` persisted to the end, the rate was first cut after its onset, and
/// ended at least [`OUTLASTED_CUT`]x below its peak, 10 or more steps after the cut.
pub(crate) fn outlasted_cut(run: &Run, e: &Episode) -> Option<OutlastedCut> {
    let c = run.lr_course;
    let (cut, (_, peak), (last_step, last)) = (c.first_cut?, c.peak?, c.last?);
    (e.to_end && cut > e.onset && last_step >= cut + 10 && last * OUTLASTED_CUT <= peak)
        .then_some(OutlastedCut { cut, peak, last })
}

/// Gradient clipping that cut (nearly) every step's gradient to a small part of it, under an
/// optimizer whose step is the gradient's (SGD): the clip, not the rate, makes the steps small.
/// (Adam's step does not scale with the gradient: there a tight clip changes little.)
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct TightClip {
    /// Share of the steps clipped, and the typical ratio of clipped to produced norm.
    pub share: f64,
    pub ratio: f64,
    /// The loss scale, when the cut is what that scale makes of gradients of an ordinary norm:
    /// the clip ran on gradients still multiplied by a mixed-precision loss scale (before
    /// `scaler.unscale_(optimizer)`), see [`scaled_clip`].
    pub loss_scale: Option<f64>,
}

/// See [`TightClip`]: at least 10 steps checked, 90% of them clipped, typically to a tenth of
/// the gradient's norm or less.
pub(crate) fn tight_clip(run: &Run) -> Option<TightClip> {
    let t = &run.loop_track;
    let (share, ratio) = (t.clipped_share()?, t.clip_ratio_typical()?);
    (!run.model.adaptive_optimizer && t.checked_steps >= 10 && share >= 0.9 && ratio <= 0.1).then(
        || TightClip {
            share,
            ratio,
            loss_scale: scaled_clip(t.loss_scale_first, ratio),
        },
    )
}

/// A loss scale of 16 or more under which the clip's cut is the scale's: the clip's max norm
/// within 100x of the unscaled gradient's norm (`ratio x scale` in 0.01-100, where a clip on
/// unscaled gradients that tight would cut them 10^3-10^7 times).
fn scaled_clip(loss_scale: Option<f64>, ratio: f64) -> Option<f64> {
    loss_scale.filter(|s| *s >= 16.0 && (0.01..=100.0).contains(&(ratio * s)))
}

/// A learning rate still rising at the last step, at least 10x above where it began, 10 steps
/// or more into the run: a warmup far longer than the run (counted in epochs or samples where
/// the scheduler counts optimizer steps).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct EndlessWarmup {
    pub first: f64,
    pub last: (u64, f64),
}

/// See [`EndlessWarmup`]: the rate's peak is its last value.
pub(crate) fn endless_warmup(run: &Run) -> Option<EndlessWarmup> {
    let c = run.lr_course;
    let (first, (peak_step, _), last) = (run.lr_first?, c.peak?, c.last?);
    (peak_step == last.0 && last.1 >= 10.0 * first && last.0 >= run.first_step.unwrap_or(0) + 10)
        .then_some(EndlessWarmup { first, last })
}

/// A scheduler that set the rate far below the one the optimizer was built with and never
/// changed it: `base` (the optimizer's), `held` (the rate of every step), at most a hundredth
/// of it, over 10 observed steps or more. A warmup whose `scheduler.step()` is never called holds its
/// first factor (`LinearLR(start_factor=1e-3)`, a `LambdaLR` ramp).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct HeldBySchedule {
    pub base: f64,
    pub held: f64,
}

/// See [`HeldBySchedule`].
#[allow(clippy::float_cmp)] // a scheduler never stepped leaves the very same number
pub(crate) fn held_by_schedule(run: &Run) -> Option<HeldBySchedule> {
    let base = run.model.spec.base_lr?;
    let c = run.lr_course;
    let (held, (_, peak), (_, last)) = (run.lr_first?, c.peak?, c.last?);
    let never_changed = peak == held && last == held && c.first_cut.is_none();
    (never_changed && held <= 1e-2 * base && run.steps_observed >= 10)
        .then_some(HeldBySchedule { base, held })
}

/// The collapse in words: "the learning rate fell from 0.1 (step 0) to 8.3e-26 (step 79),
/// below a thousandth of its peak from step 10 on".
pub(crate) fn lr_collapse_words(c: &LrCollapse) -> String {
    format!(
        "the learning rate fell from {} (step {}) to {} (step {}), below a thousandth of its peak from step {} on: a schedule that decays it far too fast",
        super::fmt_g(c.peak.1),
        c.peak.0,
        super::fmt_g(c.last.1),
        c.last.0,
        c.from
    )
}

/// Evidence for the warning of gradient norms running high from the first step, before any
/// update (the causes that explain it add what made them high).
pub(crate) const HIGH_FROM_THE_START: &str =
    "gradient norms were already high at the first step, before any update";

/// An update-to-weight ratio typical of a learning rate that trains (about 1e-3 per step).
pub(crate) const TRAINING_UPDATE: f64 = 1e-3;

/// A measured update-to-weight ratio this many times a training one's (~1e-3) is a step too
/// large for the weights it moves, whatever the loss does.
pub(crate) const MEASURED_TOO_LARGE: f64 = 10.0 * TRAINING_UPDATE;

/// A measured step size in words: "~3.45x their size (measured, lr 0.05)", "~0.05 of their
/// size (measured)".
pub(crate) fn measured_step(ratio: f64, lr: Option<f64>) -> String {
    let size = if ratio > 1.0 {
        format!("~{}x their size", super::fmt_g(ratio))
    } else {
        format!("~{} of their size", super::fmt_g(ratio))
    };
    let lr = lr.map_or(String::new(), |lr| format!(", lr {}", super::fmt_g(lr)));
    format!("{size} (measured{lr})")
}

/// How much more of a layer must be dead than at its first measurement for the deaths to be
/// the updates' doing rather than the initialization's.
pub(crate) const DIED_AFTER_UPDATES: f64 = 0.3;

/// A factor as a reader would say it: "50" below a thousand, "26,500" up to a million, "3.2e7"
/// beyond.
pub(crate) fn times(x: f64) -> String {
    if !(1e3..1e6).contains(&x) {
        return super::fmt_g(if x < 1e3 { x.round() } else { x });
    }
    thousands((x / 100.0).round() as u64 * 100)
}

/// An integer with its thousands grouped: `6272` -> "6,272".
pub(crate) fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i) % 3 == 0 {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

/// See [`Evidence::decay_pull`].
pub(crate) fn decay_pull(run: &Run) -> Option<DecayPull> {
    let wds = run.model.spec.param_weight_decay.as_ref()?;
    let mut weight_decay = 0.0f64;
    let (mut pulls, mut kept) = (Vec::new(), Vec::new());
    for (layer, t) in run.model.layers.iter().zip(&run.layers) {
        let wd = layer.weight.map_or(0.0, |(p, _)| wds[p]);
        let (Some(w), Some(last), Some(g)) = (t.weight_first, t.weight_last, t.early.median())
        else {
            continue;
        };
        if wd > 0.0 && w > 0.0 && g > 0.0 && w.is_finite() && last.is_finite() {
            weight_decay = weight_decay.max(wd);
            pulls.push(wd * w / g);
            kept.push(last / w);
        }
    }
    Some(DecayPull {
        pull: median(&pulls)?,
        kept: median(&kept)?,
        weight_decay,
    })
}

/// Median over the weighted layers of how far the first optimizer steps moved their weights
/// relative to their size, where the collector measured it.
pub(crate) fn measured_update_ratio(run: &Run) -> Option<f64> {
    over_weighted_layers(run, |t| t.update_early.median())
}

/// Median over the weighted layers of the direction of the first measured optimizer steps:
/// the cosine between each step's move of the weight and its gradient (-1 straight down it).
pub(crate) fn measured_update_direction(run: &Run) -> Option<f64> {
    over_weighted_layers(run, |t| t.direction_early.median())
}

/// Median over the weighted layers of how far the first measured optimizer step moved their
/// weights relative to their size.
fn first_update_ratio(run: &Run) -> Option<f64> {
    over_weighted_layers(run, |t| t.update_early.first())
}

/// Median over the layers that have a weight of what `of` reads from their track.
fn over_weighted_layers(run: &Run, of: impl Fn(&LayerTrack) -> Option<f64>) -> Option<f64> {
    let values: Vec<f64> = weighted_tracks(run).filter_map(of).collect();
    median(&values)
}

/// The tracks of the layers that have a weight.
pub(crate) fn weighted_tracks(run: &Run) -> impl Iterator<Item = &LayerTrack> {
    run.model
        .layers
        .iter()
        .zip(&run.layers)
        .filter(|(l, _)| l.weight.is_some())
        .map(|(_, t)| t)
}

/// Median initial gain (`std(W)·sqrt(fan_in)`) below which the weights are far below a
/// variance-preserving scale.
const SMALL_GAIN: f64 = 0.25;

/// Decades a single module must grow the signal to be where a forward blow-up starts.
pub(crate) const FORWARD_JUMP: f64 = 2.0;

/// The module where the forward signal grew by at least [`FORWARD_JUMP`] decades at the first
/// measurement, if any.
pub(crate) fn forward_growth(run: &Run) -> Option<ForwardGrowth> {
    let (step, outs) = run.outputs_first.as_ref()?;
    let mut before = run.data.first_scale.filter(|x| *x > 0.0 && x.is_finite());
    let mut best: Option<ForwardGrowth> = None;
    for (m, &out) in outs.iter().enumerate() {
        let out = f64::from(out);
        if !(out.is_finite() && out > 0.0) {
            continue;
        }
        if let Some(from) = before {
            let jump = (out / from).log10();
            if best.is_none_or(|b| jump > b.jump) {
                best = Some(ForwardGrowth {
                    module: m,
                    jump,
                    from,
                    to: out,
                    step: *step,
                });
            }
        }
        before = Some(before.map_or(out, |b| b.max(out)));
    }
    best.filter(|b| b.jump >= FORWARD_JUMP)
}

/// Gradient norms of the weighted layers at the start, in forward order: `slope` is decades
/// per layer (positive when layers nearer the output have larger gradients, i.e. gradients
/// shrink on their way back), `span` the decades between the ends of the fit, `monotone` the
/// rank correlation between position and log-norm (1: every layer smaller than the next).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub(crate) struct Profile {
    pub slope: f64,
    pub span: f64,
    pub monotone: f64,
}

impl Profile {
    /// Gradients shrink geometrically towards the input, by at least 2 decades overall.
    pub fn shrinking(&self) -> bool {
        self.span >= 2.0 && self.monotone >= 0.8
    }

    /// Gradients grow geometrically towards the input.
    pub fn growing(&self) -> bool {
        self.span <= -2.0 && self.monotone <= -0.8
    }
}

fn ranks(values: &[f64]) -> Vec<f64> {
    let mut idx: Vec<usize> = (0..values.len()).collect();
    idx.sort_by(|&a, &b| values[a].total_cmp(&values[b]));
    let mut r = vec![0.0; values.len()];
    for (rank, &i) in idx.iter().enumerate() {
        r[i] = rank as f64;
    }
    r
}

fn correlation(x: &[f64], y: &[f64]) -> f64 {
    let n = x.len() as f64;
    let mx = x.iter().sum::<f64>() / n;
    let my = y.iter().sum::<f64>() / n;
    let (mut sxy, mut sxx, mut syy) = (0.0, 0.0, 0.0);
    for (a, b) in x.iter().zip(y) {
        sxy += (a - mx) * (b - my);
        sxx += (a - mx) * (a - mx);
        syy += (b - my) * (b - my);
    }
    if sxx <= 0.0 || syy <= 0.0 {
        0.0
    } else {
        sxy / (sxx * syy).sqrt()
    }
}

impl Evidence {
    pub fn gather(run: &Run) -> Self {
        let model = &run.model;
        let mut gains: Vec<(f64, usize)> = run
            .layers
            .iter()
            .enumerate()
            .filter_map(|(l, t)| t.gain_first.filter(|g| g.is_finite()).map(|g| (g, l)))
            .collect();
        gains.sort_by(|a, b| a.0.total_cmp(&b.0));

        // Depth profile over weighted layers with a finite early gradient norm.
        let points: Vec<(f64, f64)> = model
            .layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.weight.is_some())
            .filter_map(|(l, _)| run.layers[l].early.median())
            .enumerate()
            .map(|(pos, norm)| (pos as f64, norm.max(1e-30).log10()))
            .collect();
        let profile = (points.len() >= 4).then(|| {
            let x: Vec<f64> = points.iter().map(|p| p.0).collect();
            let y: Vec<f64> = points.iter().map(|p| p.1).collect();
            let n = x.len() as f64;
            let mx = x.iter().sum::<f64>() / n;
            let my = y.iter().sum::<f64>() / n;
            let sxy: f64 = x.iter().zip(&y).map(|(a, b)| (a - mx) * (b - my)).sum();
            let sxx: f64 = x.iter().map(|a| (a - mx) * (a - mx)).sum();
            let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
            Profile {
                slope,
                span: slope * (n - 1.0),
                monotone: correlation(&ranks(&x), &ranks(&y)),
            }
        });

        let lr_first = run.lr_first;
        let ratios: Vec<f64> = model
            .layers
            .iter()
            .enumerate()
            .filter(|(_, l)| l.weight.is_some())
            .filter_map(|(l, layer)| {
                let t = &run.layers[l];
                let w = t.weight_first.filter(|w| *w > 0.0)?;
                let lr = lr_first?;
                let step = if model.adaptive_optimizer {
                    lr * (layer.numel as f64).sqrt()
                } else {
                    lr * t.early.median()?
                };
                Some(step / w)
            })
            .collect();
        let decay_pull = decay_pull(run);
        let measured = measured_update_ratio(run);
        let update_measured = measured.is_some();
        let update_ratio = measured.or_else(|| median(&ratios));
        // Weight norms are first read at the end of the first step: when that step moved the
        // weights by more than their own size, they describe the update, not the
        // initialization, and the initial gains are unknown (Adam's first step moves every
        // weight by about the learning rate, however small later steps are beside the
        // weights it made). A step that large can only have grown them (in many dimensions
        // it is nearly orthogonal to them): weights still far below a variance-preserving
        // scale after it were at most that large before.
        let mut gain_values: Vec<f64> = gains.iter().map(|g| g.0).collect();
        let first_large = first_update_ratio(run).is_some_and(|r| r > 1.0);
        let still_small = median(&gain_values).is_some_and(|g| g < SMALL_GAIN);
        let init_known = update_ratio.is_none_or(|r| r <= 1.0) && (!first_large || still_small);
        if !init_known {
            gains.clear();
            gain_values.clear();
        }
        // Which activation follows each layer in forward order (before the next layer).
        let mut next_act: Vec<Option<usize>> = vec![None; model.layers.len()];
        let mut pending: Option<usize> = None;
        for m in 0..model.spec.modules.len() {
            if let Some(l) = model.module_layer[m] {
                pending = Some(l);
            } else if let (Some(a), Some(l)) = (model.module_activation[m], pending) {
                next_act[l] = Some(a);
                pending = None;
            }
        }
        let errors: Vec<f64> = run
            .layers
            .iter()
            .enumerate()
            .filter_map(|(l, t)| {
                let g = t
                    .gain_first
                    .filter(|g| init_known && *g > 0.0 && g.is_finite())?;
                let reference = match next_act[l].map(|a| model.activations[a].traits) {
                    Some(tr) if tr.can_die => std::f64::consts::SQRT_2,
                    _ => 1.0,
                };
                Some((g / reference).log10())
            })
            .collect();
        Self {
            forward: forward_growth(run),
            init_error: median(&errors),
            loss_initial: run.loss.initial,
            first_step: run.first_step.unwrap_or(0),
            depth: model.weighted_depth,
            gain_median: median(&gain_values),
            gain_max: gains.last().copied(),
            profile,
            update_ratio,
            update_measured,
            adaptive: model.adaptive_optimizer,
            lr_first,
            input_scale_first: run.data.first_scale,
            feature_spread: uneven_features(run),
            total_early: run.total_early.median(),
            total_peak: run.total_peak,
            activation_gap: activation_gap(run),
            decay_pull,
            penalty: super::penalty_dominated(run),
        }
    }

    /// The optimizer's weight decay outweighs the loss's gradient from the start, and the
    /// weights shrink under it.
    ///
    /// (Either this or a dominant penalty in the loss makes the measured steps the penalty's:
    /// see [`Self::steps_are_the_penalty`].)
    pub fn decay_outweighs(&self) -> Option<DecayPull> {
        self.decay_pull
            .filter(|d| d.pull >= DECAY_OUTWEIGHS && d.kept <= DECAY_KEPT)
    }

    /// The steps the optimizer makes are mostly a weight penalty's (the optimizer's decay or
    /// one written into the loss), not the data's.
    pub fn steps_are_the_penalty(&self) -> bool {
        self.penalty.is_some() || self.decay_outweighs().is_some()
    }

    /// Weights at the start were far below a variance-preserving scale.
    pub fn gain_too_small(&self) -> bool {
        self.gain_median.is_some_and(|g| g < SMALL_GAIN)
    }

    /// Weights at the start were far above a variance-preserving scale.
    pub fn gain_too_large(&self) -> bool {
        self.gain_max.is_some_and(|(g, _)| g > 3.0)
    }

    /// The inputs' largest magnitude at the first step, when it is far above a normalized
    /// scale under a plain gradient step (SGD): the first layer's gradient, and its step, grow
    /// with the inputs, so a measured step size then measures the data.
    pub fn sgd_steps_of_huge_inputs(&self) -> Option<f64> {
        self.huge_inputs().filter(|_| !self.adaptive)
    }

    /// Under a plain gradient step (SGD), the weights were far above a variance-preserving
    /// scale at the start, most of them (the median layer: one layer grown by the first
    /// step is not the initialization's scale). The gradients grow with the weights around
    /// each layer, and the steps with them: the measured step size is the initialization's.
    pub fn sgd_steps_of_large_weights(&self) -> Option<f64> {
        self.gain_median.filter(|g| *g > 3.0 && !self.adaptive)
    }

    /// The largest input magnitude of the first step, when it is far below a normalized
    /// scale (~1): inputs scaled down twice, or left in a tiny unit.
    pub fn tiny_inputs(&self) -> Option<f64> {
        self.input_scale_first
            .filter(|x| *x > 0.0 && *x < TINY_INPUTS)
    }

    /// The largest input magnitude of the first step, when it is far above a normalized scale:
    /// inputs left on a raw scale (pixels 0-255, a sensor's units).
    pub fn huge_inputs(&self) -> Option<f64> {
        huge_inputs(self.input_scale_first)
    }

    /// The measured step size (update-to-weight ratio), when it lies within `lo..=hi`: steps of
    /// the size a rule takes for ones that train.
    pub fn measured_step_within(&self, lo: f64, hi: f64) -> Option<f64> {
        self.update_ratio
            .filter(|r| self.update_measured && (lo..=hi).contains(r))
    }

    /// Inputs measured on the first step, within a normalized scale's reach.
    pub fn ordinary_inputs(&self) -> bool {
        self.input_scale_first
            .is_some_and(|x| (TINY_INPUTS..=HUGE_INPUTS).contains(&x))
    }

    /// No measured weight scale is far from variance-preserving (also when the initial scale
    /// is unknown).
    pub fn gain_not_off_scale(&self) -> bool {
        !self.gain_too_small() && !self.gain_too_large()
    }

    pub fn gain_normal(&self) -> bool {
        self.gain_median.is_some_and(|g| (0.25..=3.0).contains(&g)) && !self.gain_too_large()
    }

    /// The network itself amplifies (or attenuates) the signal by this many decades at the
    /// start.
    pub fn network_gain(&self) -> f64 {
        self.init_error.map_or(0.0, |w| w * self.depth as f64)
    }

    /// The early gradient profile, when gradients shrink (or grow) geometrically along the
    /// layers.
    pub fn geometric_profile(&self, shrinking: bool) -> Option<Profile> {
        self.profile.filter(|p| {
            if shrinking {
                p.shrinking()
            } else {
                p.growing()
            }
        })
    }
}

/// Per-episode facts.
#[derive(Clone, Debug, Default, serde::Serialize)]
#[allow(clippy::struct_excessive_bools)]
pub(crate) struct Features {
    /// The failure was there at the very first observed step.
    pub at_start: bool,
    /// The root subject was healthy when first observed.
    pub healthy_start: bool,
    /// Decades the total gradient norm grew from its early level before the onset.
    pub growth: f64,
    /// Decades the root layer's gradient norm grew from its early level to its onset value.
    pub root_growth: f64,
    pub prior_explosion: Option<usize>,
    pub prior_divergence: Option<usize>,
    pub saturation: Option<usize>,
    pub vanishing_or_dead: Option<usize>,
    /// The top cause of the failure this one is a consequence of, and that failure's episode.
    pub root_cause: Option<(Cause, usize)>,
}

impl Features {
    /// Gradients exploded, the loss diverged or the total gradient norm grew 2 decades before
    /// this failure.
    pub fn blew_up(&self) -> bool {
        self.prior_explosion.is_some() || self.growth >= 2.0 || self.prior_divergence.is_some()
    }
}

pub(crate) fn decades_ratio(a: f64, b: f64) -> f64 {
    if a > 0.0 && b > 0.0 && a.is_finite() && b.is_finite() {
        (a / b).log10()
    } else {
        0.0
    }
}

/// The earliest episode of `failure` other than `k` that satisfies `pred`.
pub(crate) fn earliest(
    episodes: &[Episode],
    k: usize,
    failure: Failure,
    pred: &dyn Fn(&Episode) -> bool,
) -> Option<usize> {
    episodes
        .iter()
        .enumerate()
        .filter(|(j, o)| *j != k && o.failure == failure && pred(o))
        .min_by_key(|(_, o)| o.onset)
        .map(|(j, _)| j)
}

/// Steps within which an activation failure counts as there at the onset (activations may be
/// sampled).
pub(crate) fn activation_tolerance(ev: &Evidence) -> u64 {
    ev.activation_gap.max(5)
}

pub(crate) fn features(
    run: &Run,
    ev: &Evidence,
    events: &[SemanticEvent],
    episodes: &[Episode],
    k: usize,
) -> Features {
    let e = &episodes[k];
    let model = &run.model;
    let onset = e.onset;
    let tol = activation_tolerance(ev);
    let root_layer = e.root.and_then(|m| model.module_layer[m]);
    let root_act = e.root.and_then(|m| model.module_activation[m]);
    let healthy_start = match (root_layer, root_act) {
        (Some(l), _) if e.failure.is_gradient() || e.failure == Failure::NonFinite => {
            matches!(
                run.layers[l].first_raw,
                Some(GradientHealth::Healthy | GradientHealth::Saturated)
            )
        }
        (_, Some(a)) => run.acts[a].first_raw == Some(crate::health::ActivationHealth::Normal),
        _ => onset > ev.first_step,
    };
    let root_growth = match (root_layer, e.root_event) {
        (Some(l), Some(i)) => run.layers[l]
            .early
            .median()
            .map_or(0.0, |early| decades_ratio(events[i].value, early)),
        _ => 0.0,
    };
    let growth = match (ev.total_peak, ev.total_early) {
        (Some((peak, step)), Some(early)) if step <= onset => decades_ratio(peak, early),
        _ => 0.0,
    };
    let find = |f: Failure, pred: &dyn Fn(&Episode) -> bool| earliest(episodes, k, f, pred);
    let prior_explosion = find(Failure::ExplodingGradients, &|o| o.onset <= onset);
    let prior_divergence = find(Failure::LossDivergence, &|o| o.onset <= onset);
    let saturation = find(Failure::SaturatedActivations, &|o| o.onset <= onset + tol);
    // A real failure that stops learning (for a plateau to inherit its cause).
    let vanishing_or_dead = find(Failure::VanishingGradients, &|o| {
        o.onset <= onset + 50 && o.p_failure >= 0.5
    })
    .or_else(|| {
        find(Failure::DeadNeurons, &|o| {
            o.onset <= onset + 50 && o.p_failure >= 0.5
        })
    });
    Features {
        at_start: onset <= ev.first_step,
        healthy_start,
        growth,
        root_growth,
        prior_explosion,
        prior_divergence,
        saturation,
        vanishing_or_dead,
        root_cause: None,
    }
}

#[cfg(test)]
mod tests {
    use super::scaled_clip;

    #[test]
    fn a_clip_is_the_loss_scales_only_where_the_scale_accounts_for_its_cut() {
        // Clipped at 1.0, gradients of norm ~0.4 under a scale of 65,536: cut ~26,000x.
        assert_eq!(scaled_clip(Some(65536.0), 1.0 / 26_000.0), Some(65536.0));
        // The same cut without a loss scale, or under a scale of 1 (no scaler at work).
        assert_eq!(scaled_clip(None, 1.0 / 26_000.0), None);
        assert_eq!(scaled_clip(Some(1.0), 1.0 / 26_000.0), None);
        // A clip 10x tight on unscaled gradients under that scale: the clip's own doing.
        assert_eq!(scaled_clip(Some(65536.0), 0.1), None);
    }
}
