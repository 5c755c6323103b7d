//! Abductive ranking: for each failure episode, how likely it is to be a real failure, and how
//! well each candidate cause explains the evidence.
//!
//! Every cause gets a score: the sum of the evidence weights that support it (listed with the
//! reason each one counts). Scores become probabilities by a softmax (temperature 1/1.5) over
//! the candidates of that failure, with `unknown` always present at score 0, so a cause wins
//! only by out-explaining "we don't know". A hypothesis' confidence is
//! `P(failure is real) x P(cause | failure)`, discounted for failures that are consequences
//! of another.

use crate::engine::Run;
use crate::event::{EventType, SemanticEvent};
use crate::health::{DataHealth, GradientHealth, State};
use crate::track::median;

use super::episodes::{Episode, activation_gap};
use super::vocab::{Cause, Failure};

/// Run-wide facts that several causes look at.
#[derive(Clone, Debug, Default)]
pub(crate) struct Evidence {
    pub first_step: u64,
    pub depth: usize,
    pub has_norm: bool,
    /// Median and largest weight gain at the first measurement (`std(W) * sqrt(fan_in)`;
    /// 0.58 for `PyTorch`'s default `Linear` init, 1.41 for He).
    pub gain_median: Option<f64>,
    pub gain_max: Option<(f64, usize)>,
    /// How the first gradient norms change along the layers (see [`Profile`]).
    pub profile: Option<Profile>,
    /// Median estimated update-to-weight ratio at the first step.
    pub update_ratio: Option<f64>,
    pub lr_first: Option<f64>,
    pub input_scale_first: Option<f64>,
    pub total_early: Option<f64>,
    /// Largest finite total gradient norm before anything went non-finite.
    pub total_peak: Option<(f64, u64)>,
    pub activation_gap: u64,
    /// Median mean-slope of the bounded activations at their first measurement, and the median
    /// of their lowest: the share of gradient a bounded activation passes back.
    pub slope_first: Option<f64>,
    pub slope_min: Option<f64>,
    /// Class name of the bounded activations (for sentences).
    pub bounded_kind: Option<String>,
    /// The loss at the start (median of the first three), and its largest smoothed value
    /// relative to the best before it.
    pub loss_initial: Option<f64>,
    pub loss_peak_ratio: f64,
    /// Median, over weighted layers, of `log10(gain / reference)`: decades per layer by which
    /// the initial weights scale the signal away from what the activation after them needs to
    /// keep it (reference gain sqrt(2) before ReLU-family units, 1 otherwise).
    pub init_error: Option<f64>,
    /// Median `log10(mean slope)` of the bounded activations at the start: decades per layer
    /// the activations themselves take off the gradient (0 without bounded activations).
    pub act_attenuation: f64,
}

/// Gradient norms of the weighted layers at the start, in forward order: `slope` is decades
/// per layer (positive when layers nearer the output have larger gradients, i.e. gradients
/// shrink on their way back), `span` the decades between the ends of the fit, `monotone` the
/// rank correlation between position and log-norm (1: every layer smaller than the next).
#[derive(Clone, Copy, Debug, Default)]
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
        let gain_values: Vec<f64> = gains.iter().map(|g| g.0).collect();

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
        let slopes = |f: fn(&crate::track::ActTrack) -> f64| {
            let v: Vec<f64> = run.acts.iter().map(f).filter(|s| s.is_finite()).collect();
            median(&v)
        };
        let bounded_kind = model
            .activations
            .iter()
            .find(|a| a.traits.bounded.is_some())
            .map(|a| a.kind.clone());
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
                let g = t.gain_first.filter(|g| *g > 0.0 && g.is_finite())?;
                let reference = match next_act[l].map(|a| model.activations[a].traits) {
                    Some(tr) if tr.can_die => std::f64::consts::SQRT_2,
                    _ => 1.0,
                };
                Some((g / reference).log10())
            })
            .collect();
        let attenuations: Vec<f64> = run
            .acts
            .iter()
            .map(|a| a.first_slope)
            .filter(|s| s.is_finite() && *s > 0.0)
            .map(f64::log10)
            .collect();
        Self {
            init_error: median(&errors),
            act_attenuation: median(&attenuations).unwrap_or(0.0),
            loss_initial: run.loss.initial,
            loss_peak_ratio: run.loss.peak_ratio,
            slope_first: slopes(|a| a.first_slope),
            slope_min: slopes(|a| a.min_slope),
            bounded_kind,
            first_step: run.first_step.unwrap_or(0),
            depth: model.weighted_depth,
            has_norm: model.has_normalization,
            gain_median: median(&gain_values),
            gain_max: gains.last().copied(),
            profile,
            update_ratio: median(&ratios),
            lr_first,
            input_scale_first: run.data.first_scale,
            total_early: run.total_early.median(),
            total_peak: run.total_peak,
            activation_gap: activation_gap(run),
        }
    }

    /// Weights at the start were far below a variance-preserving scale.
    pub fn gain_too_small(&self) -> bool {
        self.gain_median.is_some_and(|g| g < 0.25)
    }

    /// Weights at the start were far above a variance-preserving scale.
    pub fn gain_too_large(&self) -> bool {
        self.gain_max.is_some_and(|(g, _)| g > 3.0)
    }

    pub fn gain_normal(&self) -> bool {
        self.gain_median.is_some_and(|g| (0.25..=3.0).contains(&g)) && !self.gain_too_large()
    }
}

/// Per-episode facts.
#[derive(Clone, Debug, Default)]
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
    /// Learning rate around the onset relative to the first one.
    pub lr_spike: f64,
    pub saturation: Option<usize>,
    pub dead: Option<usize>,
    pub data: Option<usize>,
    pub nonfinite_input: bool,
    pub forward_origin: bool,
    pub backward_origin: bool,
    /// The model's outputs were checked finite on the onset step; the loss was not.
    pub loss_origin: bool,
    /// Decades the root layer's weight norm grew from its first measurement.
    pub weight_growth: f64,
    pub vanishing_or_dead: Option<usize>,
    /// The top cause of the failure this one is a consequence of, and that failure's episode.
    pub root_cause: Option<(Cause, usize)>,
}

fn decades_ratio(a: f64, b: f64) -> f64 {
    if a > 0.0 && b > 0.0 && a.is_finite() && b.is_finite() {
        (a / b).log10()
    } else {
        0.0
    }
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
    let tol = ev.activation_gap.max(5);
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
    let find = |f: Failure, pred: &dyn Fn(&Episode) -> bool| {
        episodes
            .iter()
            .enumerate()
            .filter(|(j, o)| *j != k && o.failure == f && pred(o))
            .min_by_key(|(_, o)| o.onset)
            .map(|(j, _)| j)
    };
    let prior_explosion = find(Failure::ExplodingGradients, &|o| o.onset <= onset);
    let prior_divergence = find(Failure::LossDivergence, &|o| o.onset <= onset);
    let saturation = find(Failure::SaturatedActivations, &|o| o.onset <= onset + tol);
    let dead = find(Failure::DeadNeurons, &|o| {
        o.onset <= onset + tol && o.fraction >= 0.9
    });
    let data = find(Failure::DataAnomaly, &|o| {
        o.onset <= onset && onset <= o.onset + 1
    });
    let nonfinite_input = data.is_some_and(|j| {
        episodes[j]
            .events
            .iter()
            .any(|&i| events[i].to_state == State::Data(DataHealth::NonFinite))
    });
    // A real failure that stops learning (for a plateau to inherit its cause).
    let vanishing_or_dead = find(Failure::VanishingGradients, &|o| {
        o.onset <= onset + 50 && o.p_failure >= 0.5
    })
    .or_else(|| {
        find(Failure::DeadNeurons, &|o| {
            o.onset <= onset + 50 && o.p_failure >= 0.5
        })
    });
    let forward_origin = e
        .root_event
        .is_some_and(|i| events[i].event_type == EventType::NonFiniteOutput);
    let checked_finite = run.finite_forward.contains(&onset);
    let backward_origin = !forward_origin
        && checked_finite
        && e.root_event
            .is_some_and(|i| events[i].event_type == EventType::GradientHealth);
    let loss_origin = checked_finite
        && e.root_event
            .is_some_and(|i| events[i].event_type == EventType::LossHealth);
    let lr_spike = match (ev.lr_first, run.lr_between(onset.saturating_sub(5), onset)) {
        (Some(first), Some(now)) if first > 0.0 && now.is_finite() => now / first,
        _ => 1.0,
    };
    let weight_growth = root_layer
        .and_then(|l| {
            let t = &run.layers[l];
            Some(decades_ratio(t.weight_last?, t.weight_first?))
        })
        .unwrap_or(0.0);
    Features {
        at_start: onset <= ev.first_step,
        healthy_start,
        growth,
        root_growth,
        prior_explosion,
        prior_divergence,
        lr_spike,
        saturation,
        dead,
        data,
        nonfinite_input,
        forward_origin,
        backward_origin,
        loss_origin,
        weight_growth,
        vanishing_or_dead,
        root_cause: None,
    }
}

/// Probability that an episode is a real failure, from how far past its threshold it went, how
/// long it lasted and how much of the model it reached.
#[allow(clippy::many_single_char_names)]
pub(crate) fn base_probability(run: &Run, e: &Episode) -> f64 {
    let n_layers = run.model.layers.len().max(1) as f64;
    let breadth = e.affected.len() as f64 / n_layers;
    let d = e.duration as f64;
    let end = if e.to_end { 1.0 } else { 0.0 };
    let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
    let p = match e.failure {
        Failure::NonFinite => {
            if e.to_end || e.duration >= 2 {
                0.99
            } else {
                0.7
            }
        }
        Failure::ExplodingGradients => {
            let x = 1.2 * e.margin.min(3.0) + d.min(20.0) / 5.0 + 2.0 * breadth + 0.5 * end
                - if !e.to_end && e.duration <= 2 {
                    0.8
                } else {
                    0.0
                };
            1.0 - (-x.max(0.0)).exp()
        }
        Failure::VanishingGradients => {
            let x = 0.5 * e.margin.min(2.0) + d.min(30.0) / 10.0 + 2.0 * breadth + end;
            let mut p = 1.0 - (-x).exp();
            // Gradients that fade everywhere together long after a healthy start, while the
            // loss approaches zero, are a converged run, not a failure.
            if let (Some(initial), true) = (run.loss.initial, run.loss.observed > 0) {
                if initial > 0.0 && run.loss.best < 1e-3 * initial && e.onset > 0 {
                    p *= 0.2;
                }
            }
            p
        }
        Failure::DeadNeurons => {
            let t = 0.5;
            let base = ((e.fraction - t) / (1.0 - t)).clamp(0.0, 1.0);
            let persist = if e.to_end || e.duration >= 10 {
                1.0
            } else {
                0.6
            };
            sig(6.0 * (base - 0.4)) * persist
        }
        Failure::SaturatedActivations => {
            let t = 0.5;
            // Severity: the share of saturated outputs, or how little gradient the activation
            // still passes back (1 - 2 x mean slope), whichever is worse.
            let slope = e
                .root
                .and_then(|m| run.model.module_activation[m])
                .map_or(f64::NAN, |a| run.acts[a].min_slope);
            let by_slope = if slope.is_finite() {
                (1.0 - 2.0 * slope).clamp(0.0, 1.0)
            } else {
                0.0
            };
            let base = ((e.fraction - t) / (1.0 - t)).clamp(0.0, 1.0).max(by_slope);
            let persist = if e.to_end || e.duration >= 10 {
                1.0
            } else {
                0.6
            };
            sig(6.0 * (base - 0.5)) * persist
        }
        Failure::SaturatedGradients => (0.1 + 0.25 * breadth * end).min(0.35),
        // Replicas differ far beyond float noise (margin: decades past the tolerance); more
        // certain the longer it lasts.
        Failure::ReplicaDivergence => {
            let persist = if e.to_end || e.duration >= 3 {
                0.1
            } else {
                0.0
            };
            (0.6 + 0.1 * e.margin.min(3.0) + persist).min(0.97)
        }
        Failure::DataAnomaly => {
            if e.margin.is_infinite() {
                0.97
            } else {
                // Margin is decades past the out-of-distribution factor (100x by default).
                sig(2.0 * (e.margin + 2.0 - 2.5))
            }
        }
        Failure::LossDivergence => {
            let x = 1.0 + 2.0 * e.margin.min(3.0) + d.min(20.0) / 10.0 + 0.5 * end;
            let p = 1.0 - (-x).exp();
            // A spike the run recovered from within a few steps is a warning more than a failure.
            if !e.to_end && e.duration <= 5 {
                p.min(0.6)
            } else {
                p
            }
        }
        Failure::LossPlateau => {
            let w = 100.0;
            let stuck = run
                .loss
                .initial
                .is_some_and(|i| run.loss.last_smoothed >= 0.95 * i);
            0.35 + 0.2 * (d / w).min(1.0) + if stuck { 0.2 } else { 0.0 } + 0.1 * end
        }
    };
    p.clamp(0.0, 0.99)
}

/// The base probability, corroborated by each failure this one explains.
pub(crate) fn failure_probability(episodes: &[Episode], k: usize) -> f64 {
    let p = episodes[k].p_failure;
    let consequences = episodes
        .iter()
        .filter(|o| o.explained_by == Some(k))
        .count() as f64;
    (p + 0.1 * consequences * (1.0 - p)).clamp(0.0, 0.99)
}

/// One scored candidate cause, with the reasons behind its score.
#[derive(Clone, Debug)]
pub(crate) struct Scored {
    pub cause: Cause,
    pub score: f64,
    pub reasons: Vec<String>,
}

/// How far below `unknown` every named cause starts.
const NAMED_PRIOR: f64 = 1.5;

struct Ballot {
    scored: Vec<Scored>,
}

impl Ballot {
    fn new(candidates: &[Cause]) -> Self {
        // A named cause starts below `unknown`: it must bring evidence just to tie with "we
        // don't know", so a failure nothing explains is reported as one of unknown cause.
        let mut scored: Vec<Scored> = candidates
            .iter()
            .map(|&cause| Scored {
                cause,
                score: if cause == Cause::Unknown {
                    0.0
                } else {
                    -NAMED_PRIOR
                },
                reasons: Vec::new(),
            })
            .collect();
        if !candidates.contains(&Cause::Unknown) {
            scored.push(Scored {
                cause: Cause::Unknown,
                score: 0.0,
                reasons: Vec::new(),
            });
        }
        Self { scored }
    }

    fn add(&mut self, cause: Cause, weight: f64, reason: impl Into<String>) {
        if let Some(s) = self.scored.iter_mut().find(|s| s.cause == cause) {
            s.score += weight;
            if weight > 0.0 {
                s.reasons.push(reason.into());
            }
        }
    }

    /// Probabilities by softmax with temperature 1/1.5, sorted descending.
    fn finish(mut self) -> Vec<(Scored, f64)> {
        let max = self
            .scored
            .iter()
            .map(|s| s.score)
            .fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = self
            .scored
            .iter()
            .map(|s| (1.5 * (s.score - max)).exp())
            .collect();
        let total: f64 = weights.iter().sum();
        let mut out: Vec<(Scored, f64)> = self
            .scored
            .drain(..)
            .zip(weights)
            .map(|(s, w)| (s, w / total))
            .collect();
        out.sort_by(|a, b| b.1.total_cmp(&a.1));
        out
    }
}

fn fmt_g(v: f64) -> String {
    super::text::num(v)
}

/// Scores the candidate causes of episode `k`.
pub(crate) fn rank_causes(
    run: &Run,
    ev: &Evidence,
    episodes: &[Episode],
    k: usize,
    f: &Features,
) -> Vec<(Scored, f64)> {
    use Cause as C;
    let e = &episodes[k];
    let lr_txt = ev
        .lr_first
        .map_or(String::new(), |lr| format!(" (lr {})", fmt_g(lr)));
    let mut b;
    match e.failure {
        Failure::ExplodingGradients => {
            b = Ballot::new(&[
                C::LearningRateTooHigh,
                C::PoorInitialization,
                C::NetworkDepth,
                C::MissingNormalization,
                C::BadInputData,
            ]);
            lr_evidence(&mut b, ev, f, &lr_txt);
            if f.at_start {
                b.add(
                    C::PoorInitialization,
                    2.5,
                    "gradients were already exploding at the first step, before any update",
                );
                init_compounding(&mut b, ev, false);
                // Ordinary weights that do not amplify the signal, yet a huge loss or huge
                // inputs: the data is off scale (unnormalized inputs or regression targets).
                let data_off_scale = ev.loss_initial.is_some_and(|l| l > 1e3)
                    || ev.input_scale_first.is_some_and(|x| x > 20.0);
                if ev.gain_normal() && network_gain(ev) < 1.0 && data_off_scale {
                    b.add(C::PoorInitialization, -1.0, "");
                }
                if ev.gain_normal() && network_gain(ev) < 1.0 {
                    if let Some(l) = ev.loss_initial.filter(|l| *l > 1e3) {
                        b.add(
                            C::BadInputData,
                            2.5,
                            format!(
                                "the weights are ordinarily scaled but the loss starts at {}: targets or inputs are far off scale",
                                fmt_g(l)
                            ),
                        );
                    }
                    if let Some(x) = ev.input_scale_first.filter(|x| *x > 20.0) {
                        b.add(
                            C::BadInputData,
                            1.5,
                            format!("inputs reach magnitude {} (not normalized)", fmt_g(x)),
                        );
                    }
                }
                large_weights(&mut b, ev, 1.5);
                depth_evidence(&mut b, ev, false);
            } else {
                b.add(C::PoorInitialization, -1.0, "");
            }
            data_evidence(&mut b, f, 4.0);
        }
        Failure::VanishingGradients => {
            b = Ballot::new(&[
                C::DyingRelu,
                C::SaturatingActivation,
                C::PoorInitialization,
                C::NetworkDepth,
                C::MissingNormalization,
                C::LearningRateTooHigh,
                C::BadInputData,
            ]);
            if let Some(j) = f.dead {
                b.add(C::DyingRelu, 4.0, format!("{:.0}% of the units of a ReLU layer downstream output zero for the whole batch", 100.0 * episodes[j].fraction));
            }
            // Exactly-zero gradients look like a blocked ReLU path only if the model can have
            // one: ReLU-family modules, or no activation modules at all (functional ReLUs).
            let may_have_relu = run.model.activations.is_empty()
                || run.model.activations.iter().any(|a| a.traits.can_die);
            if e.exact_zero && may_have_relu {
                b.add(
                    C::DyingRelu,
                    1.0,
                    "the gradients are exactly zero, as behind a blocked (dead) path",
                );
            }
            if let Some(j) = f.saturation {
                b.add(C::SaturatingActivation, 3.0, format!("bounded activations were saturated ({:.0}% of outputs at their bounds) by step {}", 100.0 * episodes[j].fraction, episodes[j].onset));
            }
            let slope = if f.at_start {
                ev.slope_first
            } else {
                ev.slope_min
            };
            if let Some(s) = slope.filter(|s| *s < 0.5) {
                let kind = ev.bounded_kind.as_deref().unwrap_or("bounded");
                b.add(
                    C::SaturatingActivation,
                    3.0 * ((0.5 - s) / 0.25).clamp(0.0, 1.0),
                    format!("the {kind} activations pass back only {:.0}% of the gradient on average (mean slope {})", 100.0 * s, fmt_g(s)),
                );
            }
            if f.at_start {
                b.add(
                    C::PoorInitialization,
                    2.0,
                    "gradients vanished from the first step, before any update",
                );
                small_weights(&mut b, ev, 2.0);
                depth_evidence(&mut b, ev, true);
                init_compounding(&mut b, ev, true);
            } else {
                b.add(C::PoorInitialization, -1.0, "");
                if f.healthy_start && (f.prior_explosion.is_some() || f.weight_growth >= 0.5) {
                    b.add(C::LearningRateTooHigh, 1.5, format!("gradients were healthy at first and weights grew {:.1}x before they vanished", 10f64.powf(f.weight_growth)));
                }
                if f.lr_spike >= 3.0 {
                    b.add(
                        C::LearningRateTooHigh,
                        1.0,
                        format!("the learning rate rose {:.0}x just before", f.lr_spike),
                    );
                }
            }
            data_evidence(&mut b, f, 3.0);
        }
        Failure::NonFinite => {
            b = Ballot::new(&[
                C::BadInputData,
                C::LearningRateTooHigh,
                C::NumericalInstability,
                C::PoorInitialization,
            ]);
            if f.nonfinite_input {
                b.add(
                    C::BadInputData,
                    6.0,
                    format!("the input batch of step {} contained NaN/Inf", e.onset),
                );
            }
            let blew_up =
                f.prior_explosion.is_some() || f.growth >= 2.0 || f.prior_divergence.is_some();
            if blew_up && f.root_cause.is_none() {
                let why = if let Some(j) = f.prior_explosion {
                    format!(
                        "gradients exploded from step {} before the first NaN/Inf",
                        episodes[j].onset
                    )
                } else if let Some(j) = f.prior_divergence {
                    format!(
                        "the loss diverged from step {} before the first NaN/Inf",
                        episodes[j].onset
                    )
                } else {
                    format!(
                        "the total gradient norm grew {:.1} decades before the first NaN/Inf",
                        f.growth
                    )
                };
                b.add(C::LearningRateTooHigh, 2.5, why);
                lr_evidence_common(&mut b, ev, f, &lr_txt);
            } else {
                if f.forward_origin {
                    b.add(C::NumericalInstability, 2.5, "a module's forward output went non-finite while gradients and inputs were finite and stable");
                } else if f.loss_origin {
                    b.add(
                        C::NumericalInstability,
                        2.5,
                        "the model's outputs were finite: the loss computation itself produced the first NaN/Inf (log of 0, a division by zero...)",
                    );
                } else if f.backward_origin {
                    b.add(C::NumericalInstability, 1.5, "the forward pass was finite; the gradient went non-finite inside the backward pass");
                }
                if f.at_start {
                    b.add(
                        C::NumericalInstability,
                        0.5,
                        "values were non-finite from the first step",
                    );
                }
            }
            if f.at_start {
                b.add(C::LearningRateTooHigh, -1.5, "");
                b.add(
                    C::PoorInitialization,
                    1.5,
                    "values were non-finite from the first step, before any update",
                );
                if ev.gain_too_large() || ev.gain_too_small() {
                    b.add(
                        C::PoorInitialization,
                        1.0,
                        "the initial weight scale is far from variance-preserving",
                    );
                }
            }
        }
        Failure::DeadNeurons => {
            b = Ballot::new(&[
                C::DyingRelu,
                C::LearningRateTooHigh,
                C::PoorInitialization,
                C::BadInputData,
            ]);
            b.add(
                C::DyingRelu,
                3.0,
                format!(
                    "{:.0}% of the layer's units output zero for every sample of the batch",
                    100.0 * e.fraction
                ),
            );
            if f.at_start {
                b.add(
                    C::PoorInitialization,
                    2.0,
                    "the units were dead at the first step, before any update",
                );
                small_weights(&mut b, ev, 2.0);
            } else if f.healthy_start {
                b.add(
                    C::LearningRateTooHigh,
                    1.5,
                    "the units were alive at first and died after updates",
                );
                lr_evidence_common(&mut b, ev, f, &lr_txt);
            }
            data_evidence(&mut b, f, 3.0);
        }
        Failure::SaturatedActivations => {
            b = Ballot::new(&[
                C::SaturatingActivation,
                C::PoorInitialization,
                C::LearningRateTooHigh,
                C::BadInputData,
                C::MissingNormalization,
            ]);
            b.add(
                C::SaturatingActivation,
                2.5,
                format!(
                    "{:.0}% of the outputs sit at the activation's bounds, where its slope is ~0",
                    100.0 * e.fraction
                ),
            );
            if f.at_start {
                b.add(
                    C::PoorInitialization,
                    1.0,
                    "the activations were saturated at the first step, before any update",
                );
                large_weights(&mut b, ev, 2.0);
                // Inputs far beyond a normalized range saturate the first bounded activation
                // however well the weights are scaled.
                let first_act = run.model.activations.first().map(|a| a.module);
                let scale = ev.input_scale_first.unwrap_or(0.0);
                if scale > 20.0 && e.root == first_act {
                    b.add(
                        C::BadInputData,
                        3.0,
                        format!("inputs reach magnitude {} (not normalized)", fmt_g(scale)),
                    );
                    if ev.gain_normal() {
                        b.add(
                            C::BadInputData,
                            1.0,
                            "the weights themselves are ordinarily scaled",
                        );
                    }
                }
            } else if f.healthy_start {
                b.add(
                    C::LearningRateTooHigh,
                    1.5,
                    "the activations were in range at first and saturated after updates",
                );
                if f.weight_growth >= 0.3 {
                    b.add(
                        C::LearningRateTooHigh,
                        1.0,
                        format!(
                            "the weights before them grew {:.1}x",
                            10f64.powf(f.weight_growth)
                        ),
                    );
                }
            }
            if !ev.has_norm {
                b.add(
                    C::MissingNormalization,
                    0.5,
                    "no normalization keeps pre-activations in range",
                );
            }
            data_evidence(&mut b, f, 3.0);
        }
        // No cause in the vocabulary fits a replica that stopped matching the others: the
        // failure is named, and its remedies say where such code usually is.
        Failure::ReplicaDivergence => {
            b = Ballot::new(&[]);
        }
        Failure::DataAnomaly => {
            b = Ballot::new(&[C::BadInputData]);
            b.add(C::BadInputData, 4.0, "the input batch itself was anomalous");
        }
        Failure::LossDivergence => {
            b = Ballot::new(&[
                C::LearningRateTooHigh,
                C::BadInputData,
                C::NumericalInstability,
                C::PoorInitialization,
            ]);
            if f.at_start {
                b.add(
                    C::PoorInitialization,
                    1.0,
                    "the loss rose from the first steps",
                );
            } else {
                b.add(
                    C::LearningRateTooHigh,
                    2.0,
                    "the loss rose after a healthy start, i.e. after updates",
                );
            }
            lr_evidence_common(&mut b, ev, f, &lr_txt);
            if f.growth >= 1.0 || f.prior_explosion.is_some() {
                b.add(C::LearningRateTooHigh, 1.0, "gradient norms grew with it");
            } else {
                b.add(
                    C::NumericalInstability,
                    0.5,
                    "gradient norms did not grow with it",
                );
            }
            data_evidence(&mut b, f, 4.0);
        }
        Failure::LossPlateau => {
            b = Ballot::new(&[
                C::LearningRateTooLow,
                C::LearningRateTooHigh,
                C::PoorInitialization,
                C::SaturatingActivation,
                C::DyingRelu,
                C::NetworkDepth,
            ]);
            if f.root_cause.is_some() {
                b.add(C::LearningRateTooLow, -2.0, "");
            } else if let Some(j) = f.vanishing_or_dead {
                let inherited = match episodes[j].failure {
                    Failure::DeadNeurons => C::DyingRelu,
                    _ if f.saturation.is_some() => C::SaturatingActivation,
                    _ => C::NetworkDepth,
                };
                b.add(
                    inherited,
                    3.0,
                    format!(
                        "{} from step {} keep the weights from learning",
                        episodes[j].failure.phrase().to_lowercase(),
                        episodes[j].onset
                    ),
                );
                b.add(C::LearningRateTooLow, -2.0, "");
            } else if ev.update_ratio.is_none_or(|r| r < 1e-3) {
                b.add(
                    C::LearningRateTooLow,
                    1.0,
                    "gradients are healthy, yet the loss does not move",
                );
            }
            if ev.loss_peak_ratio >= 2.0 {
                b.add(
                    C::LearningRateTooHigh,
                    1.5,
                    format!(
                        "the loss jumped to {:.1}x its best before it flattened: the steps overshoot",
                        ev.loss_peak_ratio
                    ),
                );
            }
            if let Some(r) = ev.update_ratio {
                if r < 1e-5 {
                    b.add(
                        C::LearningRateTooLow,
                        2.5,
                        format!(
                            "each step moves the weights by only ~{} of their size{lr_txt}",
                            fmt_g(r)
                        ),
                    );
                } else if r < 1e-4 {
                    b.add(
                        C::LearningRateTooLow,
                        1.0,
                        format!(
                            "each step moves the weights by ~{} of their size{lr_txt}",
                            fmt_g(r)
                        ),
                    );
                } else if r > 0.5 {
                    b.add(
                        C::LearningRateTooHigh,
                        1.5,
                        format!(
                            "each step moves the weights by ~{} of their size{lr_txt}",
                            fmt_g(r)
                        ),
                    );
                }
            }
            if f.at_start && (ev.gain_too_large() || ev.gain_too_small()) {
                b.add(
                    C::PoorInitialization,
                    1.0,
                    "the initial weight scale is far from variance-preserving",
                );
            }
        }
        Failure::SaturatedGradients => {
            b = Ballot::new(&[C::LearningRateTooHigh]);
            if f.root_growth >= 1.0 {
                b.add(
                    C::LearningRateTooHigh,
                    0.5,
                    "gradient norms grew after updates",
                );
            }
        }
    }
    // A consequence shares the cause of the failure it follows from.
    if let Some((cause, j)) = f.root_cause {
        b.add(
            cause,
            3.0,
            format!(
                "it follows from the {} at step {} ({})",
                episodes[j].failure.as_str().replace('_', " "),
                episodes[j].onset,
                cause.phrase()
            ),
        );
    }
    b.finish()
}

/// Initial weights far below a variance-preserving scale.
fn small_weights(b: &mut Ballot, ev: &Evidence, weight: f64) {
    if let Some(g) = ev.gain_median.filter(|_| ev.gain_too_small()) {
        b.add(
            Cause::PoorInitialization,
            weight,
            format!(
                "initial weights are only {}x a variance-preserving scale",
                fmt_g(g)
            ),
        );
    }
}

/// Initial weights far above a variance-preserving scale.
fn large_weights(b: &mut Ballot, ev: &Evidence, weight: f64) {
    if let Some((g, _)) = ev.gain_max.filter(|_| ev.gain_too_large()) {
        b.add(
            Cause::PoorInitialization,
            weight,
            format!(
                "initial weights are {}x a variance-preserving scale",
                fmt_g(g)
            ),
        );
    }
}

/// Weights mis-scaled for their activation, compounded over the layers, explain a failure at
/// the start in a network of moderate depth (in a very deep one, even a mild per-layer error is
/// the depth's doing) when the weights, not the activations, carry most of the per-layer change.
fn init_compounding(b: &mut Ballot, ev: &Evidence, shrinking: bool) {
    let Some(w) = ev.init_error else { return };
    let right_way = if shrinking { w < 0.0 } else { w > 0.0 };
    let compounded = w * ev.depth as f64;
    if right_way
        && w.abs() >= 0.12
        && w.abs() >= ev.act_attenuation.abs()
        && compounded.abs() >= 1.5
        && ev.depth < 16
    {
        b.add(
            Cause::PoorInitialization,
            2.0,
            format!(
                "each layer's weights scale the signal {}x away from what its activation keeps stable, {:.1} decades over {} layers",
                fmt_g(10f64.powf(w)),
                compounded.abs(),
                ev.depth
            ),
        );
    }
}

/// The network itself amplifies (or attenuates) the signal by this many decades at the start.
fn network_gain(ev: &Evidence) -> f64 {
    ev.init_error.map_or(0.0, |w| w * ev.depth as f64)
}

/// Gradients that shrink (or grow) geometrically along the layers at the start: a mild loss per
/// layer compounded over many layers is the depth's doing; a severe one per layer is the
/// weights' scale.
fn depth_evidence(b: &mut Ballot, ev: &Evidence, shrinking: bool) {
    let Some(p) = ev.profile else { return };
    let geometric = if shrinking {
        p.shrinking()
    } else {
        p.growing()
    };
    if !geometric {
        return;
    }
    let per_layer = p.slope.abs();
    let way = if shrinking { "shrink" } else { "grow" };
    if ev.depth >= 8 {
        b.add(
            Cause::NetworkDepth,
            1.5,
            format!(
                "gradient norms {way} geometrically, {:.1} decades over {} layers",
                p.span.abs(),
                ev.depth
            ),
        );
        if ev.gain_normal() {
            b.add(
                Cause::NetworkDepth,
                0.5,
                "the initial weight scale is ordinary",
            );
        }
        if ev.depth >= 16 && per_layer < 0.5 {
            b.add(
                Cause::NetworkDepth,
                1.0,
                format!(
                    "each layer changes the gradient by only {per_layer:.2} decades: it is the number of layers that compounds it"
                ),
            );
        }
        if !ev.has_norm {
            b.add(
                Cause::MissingNormalization,
                1.0,
                "no normalization layer rescales the signal between layers",
            );
        }
    }
    if per_layer >= 1.0 {
        b.add(
            Cause::PoorInitialization,
            1.0,
            format!(
                "each layer changes the gradient {:.0}x: the weights are far off scale",
                10f64.powf(per_layer)
            ),
        );
    }
}

fn lr_evidence(b: &mut Ballot, ev: &Evidence, f: &Features, lr_txt: &str) {
    if f.at_start {
        b.add(Cause::LearningRateTooHigh, -2.0, "");
        return;
    }
    if f.healthy_start {
        b.add(
            Cause::LearningRateTooHigh,
            2.0,
            "gradients were healthy at the start and blew up after updates",
        );
    }
    if f.root_growth >= 1.0 {
        b.add(
            Cause::LearningRateTooHigh,
            1.0,
            format!(
                "the gradient norm grew {:.1} decades before the threshold",
                f.root_growth
            ),
        );
    }
    if f.prior_divergence.is_some() {
        b.add(Cause::LearningRateTooHigh, 1.0, "the loss diverged with it");
    }
    lr_evidence_common(b, ev, f, lr_txt);
}

fn lr_evidence_common(b: &mut Ballot, ev: &Evidence, f: &Features, lr_txt: &str) {
    if f.lr_spike >= 3.0 {
        b.add(
            Cause::LearningRateTooHigh,
            1.5,
            format!(
                "the learning rate had risen {:.0}x from its first value",
                f.lr_spike
            ),
        );
    }
    if let Some(r) = ev.update_ratio {
        if r > 1.0 {
            b.add(
                Cause::LearningRateTooHigh,
                1.0,
                format!(
                    "each step moves the weights by ~{}x their size{lr_txt}",
                    fmt_g(r)
                ),
            );
        } else if r > 0.1 {
            b.add(
                Cause::LearningRateTooHigh,
                0.5,
                format!(
                    "each step moves the weights by ~{} of their size{lr_txt}",
                    fmt_g(r)
                ),
            );
        }
    }
}

fn data_evidence(b: &mut Ballot, f: &Features, weight: f64) {
    if f.data.is_some() {
        let what = if f.nonfinite_input {
            "the input batch of that step contained NaN/Inf"
        } else {
            "the input batch of that step was far out of distribution"
        };
        b.add(Cause::BadInputData, weight, what);
    }
}
