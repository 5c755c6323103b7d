//! `bad_input_data`: NaN/Inf or out-of-distribution batches, or inputs and targets far off
//! scale.

use crate::engine::Run;
use crate::health::{DataHealth, State};

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::evidence::{
    FeatureSpread, MEASURED_TOO_LARGE, TRAINING_UPDATE, earliest, measured_step, times,
    uneven_features,
};
use super::{Case, CauseRule, Facts, RemedyCase, Votes, facts_of, fmt_g};
use super::{output_ignores_input, output_loss_mismatch};

pub(crate) struct BadInputData;

/// Saturation episode `j` began at the first step in the first bounded activation, under
/// inputs far beyond a normalized range: their largest magnitude.
fn first_activation_saturated_by_inputs(c: &Case<'_>, j: usize) -> Option<f64> {
    let s = &c.episodes[j];
    let first_act = c.run.model.activations.first().map(|a| a.module);
    c.ev.huge_inputs().filter(|_| {
        s.failure == Failure::SaturatedActivations
            && s.onset <= c.ev.first_step
            && s.root == first_act
    })
}

/// The same behind ordinarily scaled weights: the saturation is the inputs' doing.
pub(crate) fn saturated_by_inputs(c: &Case<'_>, j: usize) -> Option<f64> {
    first_activation_saturated_by_inputs(c, j).filter(|_| c.ev.gain_normal())
}

/// The input batch of the onset step (or the one before): the data anomaly there, and whether
/// it held NaN/Inf.
#[derive(serde::Serialize)]
struct Batch {
    data: Option<usize>,
    nonfinite_input: bool,
}

impl Batch {
    fn of(c: &Case<'_>) -> Self {
        let onset = c.e.onset;
        let data = earliest(c.episodes, c.k, Failure::DataAnomaly, &|o| {
            o.onset <= onset && onset <= o.onset + 1
        });
        let nonfinite_input = data.is_some_and(|j| {
            c.episodes[j]
                .events
                .iter()
                .any(|&i| c.events[i].to_state == State::Data(DataHealth::NonFinite))
        });
        Self {
            data,
            nonfinite_input,
        }
    }
}

impl CauseRule for BadInputData {
    fn cause(&self) -> Cause {
        Cause::BadInputData
    }

    fn phrase(&self) -> &'static str {
        "bad input data"
    }

    fn explains(&self, failure: Failure) -> bool {
        !matches!(failure, Failure::StalledLayer | Failure::LossScaleCollapse)
    }

    /// A plateau is data's doing only with the inputs' scale to show for it; so is a warning of
    /// high gradient norms.
    fn always_candidate(&self, failure: Failure) -> bool {
        !matches!(failure, Failure::LossPlateau | Failure::SaturatedGradients)
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let (ev, f) = (c.ev, c.f);
        // A bounded output that cannot reach targets as raw as the inputs: a fact of the data.
        if let Some(why) = output_loss_mismatch::raw_data_explains(c) {
            v.proof(5.0, why);
        }
        match c.e.failure {
            Failure::ExplodingGradients => {
                // Ordinary weights that do not amplify the signal, yet a huge loss or huge
                // inputs: the data is off scale (unnormalized inputs or regression targets).
                if f.at_start
                    && ev.gain_not_off_scale()
                    && ev.network_gain() < 1.0
                    && ev.forward.is_none()
                {
                    if let Some(l) = ev.loss_initial.filter(|l| *l > 1e3) {
                        v.add(
                            2.5,
                            format!(
                                "the weights are ordinarily scaled but the loss starts at {}: targets or inputs are far off scale",
                                fmt_g(l)
                            ),
                        );
                    }
                    if let Some(x) = ev.huge_inputs() {
                        v.add(
                            1.5,
                            format!("inputs reach magnitude {} (not normalized)", fmt_g(x)),
                        );
                    }
                }
                if let Some(t) = raw_targets(c.run).filter(|_| f.at_start) {
                    v.add(2.0, t.said());
                }
                steps_grown_by_inputs(c, v);
                anomalous_batch(c, v, 4.0);
            }
            Failure::VanishingGradients => {
                if let Some(x) = f.saturation.and_then(|j| saturated_by_inputs(c, j)) {
                    v.add(
                        3.5,
                        format!(
                            "inputs reach magnitude {} (not normalized): with ordinarily scaled weights they saturated the first bounded activation from the first step",
                            fmt_g(x)
                        ),
                    );
                }
                // Behind units that inputs of one value killed from the first step.
                let dead_at_start = c
                    .episodes
                    .iter()
                    .any(|e| e.failure == Failure::DeadNeurons && e.onset <= ev.first_step);
                if let Some(x) = c
                    .run
                    .data
                    .first_constant
                    .filter(|_| f.at_start && dead_at_start)
                {
                    v.proof(5.0, constant_inputs_said(x));
                }
                anomalous_batch(c, v, 3.0);
            }
            Failure::DeadNeurons => {
                // Units dead before any update, behind ordinarily scaled weights, under inputs
                // far beyond a normalized range: inputs that large saturate what comes before
                // the units (a recurrent cell's gates, a bounded activation) or swamp their
                // bias, so each unit sees nearly the same signal for every sample.
                if let Some(x) = ev.huge_inputs() {
                    if f.at_start && ev.gain_normal() {
                        v.add(
                            3.5,
                            format!(
                                "the units were dead at the first step, before any update, with ordinarily scaled weights and inputs reaching magnitude {} (not normalized)",
                                fmt_g(x)
                            ),
                        );
                    }
                }
                // Inputs all of one value from the first step: each unit of the first layer
                // computes the same for every sample (its bias alone where the inputs are 0), so
                // a ReLU after it is off for all of them or none.
                if let Some(x) = c.run.data.first_constant.filter(|_| f.at_start) {
                    v.proof(5.0, constant_inputs_said(x));
                }
                steps_grown_by_inputs(c, v);
                anomalous_batch(c, v, 3.0);
            }
            Failure::NonFinite => {
                if Batch::of(c).nonfinite_input {
                    v.add(
                        6.0,
                        format!("the input batch of step {} contained NaN/Inf", c.e.onset),
                    );
                }
            }
            Failure::SaturatedActivations => {
                // Inputs far beyond a normalized range saturate the first bounded activation
                // however well the weights are scaled.
                if let Some(scale) = first_activation_saturated_by_inputs(c, c.k) {
                    v.add(
                        3.0,
                        format!("inputs reach magnitude {} (not normalized)", fmt_g(scale)),
                    );
                    if ev.gain_normal() {
                        v.add(1.0, "the weights themselves are ordinarily scaled");
                    }
                }
                anomalous_batch(c, v, 3.0);
            }
            Failure::DataAnomaly => match targets_outside_probabilities(c.run) {
                Some(t) if c.e.root_event.is_none() => v.proof(5.0, t.said(c.run)),
                _ => v.add(4.0, "the input batch itself was anomalous"),
            },
            Failure::LossDivergence => {
                steps_grown_by_inputs(c, v);
                anomalous_batch(c, v, 4.0);
            }
            Failure::LossPlateau => {
                // Inputs far beyond a normalized range, ordinarily scaled weights, and a loss
                // that stays at its chance level: inputs that large saturate the first bounded
                // units (a recurrent cell's gates, a sigmoid or tanh), so what reaches the rest
                // of the network hardly depends on the sample.
                if let Some(x) = ev.huge_inputs() {
                    let chance = super::super::failures::not_learning(c.run).is_some();
                    if chance && ev.gain_normal() {
                        v.add(
                            3.0,
                            format!(
                                "the loss stays at its chance level while the inputs reach magnitude {} (not normalized) and the weights are ordinarily scaled",
                                fmt_g(x)
                            ),
                        );
                    }
                }
                // Regression targets far beyond what the output starts at: the network must
                // grow its output that many times before the error says anything else.
                if let Some(t) = raw_targets(c.run) {
                    v.add(3.5, t.said());
                }
                // Inputs all of one value (all zero: values in [0, 1) cast to integers, a
                // division by a spread of 0): nothing tells the samples apart.
                if let Some(x) = c.run.data.first_constant {
                    if super::super::failures::not_learning(c.run).is_some() {
                        v.proof(
                            5.0,
                            format!(
                                "every input value of the first batch is {}: the model has nothing to tell its samples apart by, so it can learn only what all of them share",
                                fmt_g(x)
                            ),
                        );
                    }
                }
                // Batches of one class each: the data comes in class order. Each step then
                // pulls the model toward the class of its batch, and the next class undoes it.
                if let Some(b) = one_class_batch(c.run) {
                    v.add(
                        4.0,
                        format!(
                            "the first batch's {} targets are all class {} (of {} classes): the batches come in class order, the data is not shuffled",
                            b.batch,
                            fmt_g(b.class),
                            b.classes
                        ),
                    );
                }
                // A table whose features are on scales far apart: the small ones need weights
                // as much larger to count, which the steps take that much longer to grow.
                if let Some(s) = ev.feature_spread {
                    v.add(3.5, uneven_features_said(s));
                }
                // A model that learns nothing though everything measured of its training
                // works: what is left is the targets.
                if let Some(step) = targets_unrelated(c) {
                    // Where the first batch's class frequencies are known: the level the loss
                    // sits at is theirs.
                    let level = frequencies_level(c.run).map_or(String::new(), |h| {
                        format!(
                            " (the loss ends at {}, where predicting only how often each class occurs puts it: {}, the entropy of the first batch's classes)",
                            fmt_g(c.run.loss.last_smoothed),
                            fmt_g(h)
                        )
                    });
                    // Whether the inputs reach the output was measured (its spread across the
                    // first batch) or is the other possibility.
                    let inputs = if output_ignores_input::varies_with_input(c.run) {
                        " (they reach the output: it varied across the first batch)"
                    } else {
                        ", or inputs that do not reach the output"
                    };
                    v.add(
                        3.0,
                        format!(
                            "the model learns nothing though every part of training that was measured works: the inputs are at a normalized scale, the weights at a variance-preserving one, each step moves them by {} of their size as training steps do, no unit is dead or saturated and the output fits the loss: what is left is the targets, which look unrelated to their inputs{level}{inputs}",
                            fmt_g(step)
                        ),
                    );
                }
                // Inputs far below a normalized range (scaled twice, e.g. /255 then /255
                // again): with ordinary weights every layer's signal and its gradient are as
                // small, and each step moves the weights as little.
                if let Some(x) = ev.tiny_inputs() {
                    if ev.gain_not_off_scale() {
                        v.add(
                            3.5,
                            format!(
                                "inputs reach only {} ({}x below the ~1 of normalized data) while the weights are ordinarily scaled: the signal, its gradients and each step are that much smaller",
                                fmt_g(x),
                                fmt_g((1.0 / x).round())
                            ),
                        );
                    }
                }
            }
            Failure::SaturatedGradients => {
                // Norms high from the first step under inputs far beyond a normalized range,
                // behind weights that do not amplify (or whose scale is unknown).
                if let Some(x) = ev
                    .huge_inputs()
                    .filter(|_| f.at_start && !ev.gain_too_large())
                {
                    v.add(1.0, super::evidence::HIGH_FROM_THE_START);
                    v.add(
                        2.0,
                        format!("inputs reach magnitude {} (not normalized)", fmt_g(x)),
                    );
                }
            }
            Failure::LossScaleCollapse | Failure::StalledLayer | Failure::ReplicaDivergence => {}
        }
    }

    fn episode_facts(&self, c: &Case<'_>) -> Facts {
        facts_of(&Batch::of(c))
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        if let Some(t) = targets_outside_probabilities(c.run).filter(|_| c.e.root_event.is_none()) {
            return vec![Remedy::TargetsIntoProbabilities { lo: t.lo, hi: t.hi }];
        }
        if output_loss_mismatch::raw_data_targets(c.run).is_some() {
            return vec![Remedy::NormalizeInputs, Remedy::ScaleTargetsIntoRange];
        }
        if raw_targets(c.run).is_some()
            && matches!(
                c.e.failure,
                Failure::LossPlateau | Failure::ExplodingGradients | Failure::NonFinite
            )
        {
            return vec![Remedy::StandardizeTargets];
        }
        if c.e.failure == Failure::LossPlateau && uneven_features(c.run).is_some() {
            return vec![Remedy::StandardizeEachFeature];
        }
        if matches!(c.e.failure, Failure::LossPlateau | Failure::DeadNeurons)
            && c.run.data.first_constant.is_some()
        {
            return vec![Remedy::CheckInputsVary];
        }
        if c.e.failure == Failure::LossPlateau && one_class_batch(c.run).is_some() {
            return vec![Remedy::ShuffleData];
        }
        if c.e.failure == Failure::LossPlateau && unrelated_by_facts(c.run) {
            return vec![Remedy::PairTargetsWithInputs, Remedy::OverfitOneBatch];
        }
        vec![
            Remedy::InspectBatch { step: c.e.onset },
            Remedy::NormalizeInputs,
        ]
    }
}

/// The first step's targets of a binary cross-entropy, when they leave [0, 1] (a mask saved as
/// 0/255, labels of -1/+1): beyond it the loss has no minimum, and it falls without end as the
/// logits grow.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct TargetsOutsideProbabilities {
    pub lo: f64,
    pub hi: f64,
}

pub(crate) fn targets_outside_probabilities(run: &Run) -> Option<TargetsOutsideProbabilities> {
    let loss = run.model.spec.loss.as_ref()?;
    let (lo, hi) = loss.target_range?;
    (loss.is_binary_cross_entropy() && (lo < -0.01 || hi > 1.01))
        .then_some(TargetsOutsideProbabilities { lo, hi })
}

impl TargetsOutsideProbabilities {
    /// In words, with the lowest loss the run reached when it went below zero.
    fn said(self, run: &Run) -> String {
        let below = if run.loss.best < 0.0 {
            format!(" (this one reached {})", fmt_g(run.loss.best))
        } else {
            String::new()
        };
        format!(
            "the binary cross-entropy's targets span [{}, {}], and it needs probabilities in [0, 1]: beyond them the loss has no minimum and falls without end as the logits grow{below}",
            fmt_g(self.lo),
            fmt_g(self.hi)
        )
    }
}

/// Regression targets on their raw scale: the first batch's targets reach at least
/// [`RAW_TARGETS_MIN`] in magnitude and at least [`RAW_TARGETS_RATIO`] times the model's
/// first outputs (a price in dollars, a count, a temperature in kelvin, under a network whose
/// output starts near 0). The loss is then the targets' own square at first, its gradient as
/// large, and the network must grow its output that many times before the error says anything
/// about the inputs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct RawTargets {
    pub target: (f64, f64),
    pub output: (f64, f64),
}

const RAW_TARGETS_MIN: f64 = 10.0;
const RAW_TARGETS_RATIO: f64 = 100.0;

pub(crate) fn raw_targets(run: &Run) -> Option<RawTargets> {
    let loss = run.model.spec.loss.as_ref()?;
    let ops: Vec<&str> = loss.ops.iter().map(String::as_str).collect();
    if !output_loss_mismatch::is_regression(&ops) {
        return None;
    }
    let raw = RawTargets {
        target: loss.target_range?,
        output: loss.output_range?,
    };
    let (t, o) = raw.reach();
    (t >= RAW_TARGETS_MIN && t >= RAW_TARGETS_RATIO * o).then_some(raw)
}

impl RawTargets {
    /// The largest magnitude of the targets and of the first outputs.
    fn reach(self) -> (f64, f64) {
        let most = |(lo, hi): (f64, f64)| lo.abs().max(hi.abs());
        (most(self.target), most(self.output))
    }

    fn said(self) -> String {
        let (t, o) = self.reach();
        format!(
            "the regression targets span [{}, {}], {}x the model's first outputs ([{}, {}]): they are on their raw scale, so the error is theirs at first and the network must grow its output that much before it says anything about the inputs",
            fmt_g(self.target.0),
            fmt_g(self.target.1),
            times(t / o.max(f64::MIN_POSITIVE)),
            fmt_g(self.output.0),
            fmt_g(self.output.1)
        )
    }
}

/// A first batch whose class-index targets are all one class.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct OneClassBatch {
    pub class: f64,
    pub batch: u64,
    pub classes: u64,
}

/// Classes a shuffled batch almost never holds just one of (two are often one in a batch
/// when one of them is rare), and the smallest batch that says so.
const ONE_CLASS_MIN_CLASSES: u64 = 3;
const ONE_CLASS_MIN_BATCH: u64 = 16;

/// The first step's targets, class indices of a loss over at least 3 classes, all one class
/// in a batch of at least 16: the data comes in class order (`LossSpec::class_range`).
pub(crate) fn one_class_batch(run: &Run) -> Option<OneClassBatch> {
    let loss = run.model.spec.loss.as_ref()?;
    let (lo, hi) = loss.class_range?;
    let classes = loss.classes()?;
    let batch = loss.compared_numel.or(loss.output_numel)? / classes.max(1);
    (hi - lo < 0.5 && classes >= ONE_CLASS_MIN_CLASSES && batch >= ONE_CLASS_MIN_BATCH).then_some(
        OneClassBatch {
            class: lo,
            batch,
            classes,
        },
    )
}

/// A model that does not learn (its loss stays at its chance level, `not_learning`) though
/// every part of its training that can be measured works: inputs at a normalized scale,
/// weights at a variance-preserving one, steps of the size that trains, no unit dead or
/// saturated and no other failure stopping it, a stack shallow (or normalized) enough to
/// train, and nothing written in the program that holds a model back (an output that does not
/// fit the loss, a broadcast, heavy dropout, a weight penalty, `eval()` mode, gradients left to
/// accumulate, batches of one class). Labels shuffled apart from their inputs, the wrong
/// column, a misaligned join: the targets do not follow from the inputs. The measured step
/// size, when so.
fn targets_unrelated(c: &Case<'_>) -> Option<f64> {
    let (ev, f) = (c.ev, c.f);
    // Steps a few times smaller than a training one's are the learning rate's to explain, and
    // so are larger ones where the loss shows them overshooting (it jumped, or it reverses
    // direction step after step); small networks under Adam train with steps of ~1e-2.
    let calm = c.run.loss.oscillation().is_none()
        && super::learning_rate_too_high::loss_peak_ratio(c.run) < 2.0;
    let largest = if calm {
        UNRELATED_STEP_MAX
    } else {
        MEASURED_TOO_LARGE
    };
    let step = ev.measured_step_within(TRAINING_UPDATE / 2.0, largest)?;
    let failing = f.root_cause.is_some()
        || f.vanishing_or_dead.is_some()
        || f.saturation.is_some()
        || c.stalled_by().is_some()
        || super::saturating_activation::passes_little_gradient(c.run);
    let shallow = ev.depth < super::evidence::DEEP_STACK || c.run.model.has_normalization;
    (!failing
        && shallow
        && output_ignores_input::same_for_every_sample(c.run, ev).is_none()
        && ev.ordinary_inputs()
        && ev.feature_spread.is_none()
        && ev.gain_normal()
        && !ev.steps_are_the_penalty()
        && unrelated_by_facts(c.run))
    .then_some(step)
}

/// Why inputs all of one value (`x`) kill units and the gradient behind them from the first step.
fn constant_inputs_said(x: f64) -> String {
    format!(
        "every input value of the first batch is {}: each unit computes the same for every sample (its bias alone, where the inputs are 0), so a ReLU unit is zero for all of them or none, and no gradient passes a dead one",
        fmt_g(x)
    )
}

/// The largest measured step that leaves the targets to blame for a calm loss at its chance
/// level (beyond it every step moves the weights by a tenth of their size).
const UNRELATED_STEP_MAX: f64 = 10.0 * MEASURED_TOO_LARGE;

/// A loss whose last tenth of the run is below this share of its middle tenth is still falling.
const STILL_FALLING: f64 = 0.9;

/// A classifier's loss that ends within this share of its chance level (the entropy of its
/// classes' frequencies, where known): one that learned part of what noisy labels allow ends
/// below it.
const HELD_AT_CHANCE: f64 = 0.96;
/// The same for a regression, whose loss is noisier and whose level (the targets' variance)
/// comes from one batch.
const HELD_AT_VARIANCE: f64 = 0.8;

/// A classifier's loss where it predicts how often each class occurs and nothing of the input:
/// the entropy of the first batch's class frequencies (`LossSpec::class_entropy`), when known
/// and not above ln C (the chance level of balanced classes). A binary cross-entropy's is its
/// chance level: one batch's count of two values (balanced ones read ~0.67 for ln 2 = 0.69 on
/// 64 targets) is too rough to hold a loss within 4% of, unless measured well enough to be
/// its level (see `failures::chance_level`).
fn frequencies_level(run: &Run) -> Option<f64> {
    let chance = super::super::failures::chance_level(run).filter(|c| !c.regression)?;
    if chance.binary {
        return Some(chance.level);
    }
    let h = run.model.spec.loss.as_ref()?.class_entropy?;
    (h > 0.0 && h <= 1.01 * chance.level).then_some(h)
}

/// The part of [`targets_unrelated`] read from the run's facts alone (no episode): a loss held
/// at its chance level to the end, flat (not still falling over the second half of the run, not
/// creeping down as under steps too small), and no mistake written in the program that would
/// hold it there.
fn unrelated_by_facts(run: &Run) -> bool {
    use super::super::failures::{creeping, not_learning, pace};
    let facts = &run.loop_facts;
    let held = |c: super::super::failures::Chance| {
        let share = if c.regression {
            HELD_AT_VARIANCE
        } else {
            HELD_AT_CHANCE
        };
        run.loss.last_smoothed >= share * frequencies_level(run).unwrap_or(c.level)
    };
    // Still falling over the second half of the run (a slow start, a bounded output working
    // its way to its targets): not held anywhere.
    let falling = pace(run).is_none_or(|p| p.end < STILL_FALLING * p.mid);
    not_learning(run).is_some_and(held)
        && !falling
        && creeping(run).is_none()
        && output_loss_mismatch::found(run).is_none()
        && super::target_shape_mismatch::broadcast(run).is_none()
        && super::over_regularization::heavy_dropout(run).is_none()
        && super::over_regularization::penalty_dominated(run).is_none()
        && one_class_batch(run).is_none()
        && raw_targets(run).is_none()
        && facts.eval_share().is_none_or(|s| s < 0.5)
        && facts.accumulated_share().is_none_or(|s| s < 0.5)
}

/// The evidence of a table whose features are on scales far apart, in words.
fn uneven_features_said(s: FeatureSpread) -> String {
    format!(
        "the input's features are on scales {}x apart (feature {} reaches {}, feature {} {}): the small ones need weights {}x larger to count, which the optimizer's steps take that much longer to grow",
        times(s.ratio),
        s.small.0,
        fmt_g(s.small.1),
        s.large.0,
        fmt_g(s.large.1),
        times(s.ratio)
    )
}

/// A failure that began after updates, under steps measured far too large under a plain
/// gradient step on inputs far off a normalized scale: the first layer's gradient grows with
/// its inputs, and so does each step at a given learning rate; the same rate trains the data
/// once normalized (see `learning_rate_too_high`, which then does not read the step size).
/// Weighed as the learning rate's "died (or blew up) after updates" and "steps measured far
/// too large" together.
fn steps_grown_by_inputs(c: &Case<'_>, v: &mut Votes) {
    let ev = c.ev;
    if c.f.at_start {
        return;
    }
    let (Some(x), Some(r)) = (ev.sgd_steps_of_huge_inputs(), ev.update_ratio) else {
        return;
    };
    if !ev.update_measured || r < MEASURED_TOO_LARGE || !ev.gain_not_off_scale() {
        return;
    }
    v.add(
        3.5,
        format!(
            "inputs reach magnitude {} (not normalized): under plain gradient steps the first layer's gradient grows with them, and each step moves the weights by {}",
            fmt_g(x),
            measured_step(r, ev.lr_first)
        ),
    );
}

/// The input batch of the onset step was itself anomalous.
fn anomalous_batch(c: &Case<'_>, v: &mut Votes, weight: f64) {
    let batch = Batch::of(c);
    if batch.data.is_some() {
        let what = if batch.nonfinite_input {
            "the input batch of that step contained NaN/Inf"
        } else {
            "the input batch of that step was far out of distribution"
        };
        v.add(weight, what);
    }
}
