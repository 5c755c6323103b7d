//! `loss_plateau`: the loss stopped improving above the level of a converged run, or at the
//! floor of a loss that provably cannot reach its optimum, or it creeps (see [`creeping`]).

use std::fmt::Write as _;

use crate::config::Config;
use crate::engine::{Global, Run};
use crate::event::SemanticEvent;
use crate::history::Reduce;
use crate::model::LossSpec;

use super::super::episodes::Episode;
use super::super::text::num;
use super::super::vocab::Failure;
use super::{FailureRule, Link, Sentence, after_bad_data, first_at_onset};

pub(crate) struct LossPlateau;

impl FailureRule for LossPlateau {
    fn failure(&self) -> Failure {
        Failure::LossPlateau
    }

    fn precedence(&self) -> u8 {
        8
    }

    /// A loss that went flat below the plateau level (which otherwise tells a converged run
    /// from a stuck one) is a plateau too when the loss provably cannot reach its optimum: the
    /// output does not fit the loss, or the loss broadcasts the target (see `causes`).
    ///
    /// A classifier's loss that stays at its chance level for most of the run is a plateau
    /// whatever it started from: the model is not learning (see [`not_learning`]). So is a
    /// loss that bounces up and down without getting lower (see [`bouncing`]), from the start.
    fn episodes(&self, run: &Run, config: &Config, found: &[Episode]) -> Vec<Episode> {
        if found.iter().any(|e| e.failure == Failure::LossPlateau) {
            return Vec::new();
        }
        if let (true, Some(first), Some(last)) =
            (bouncing(run, config), run.first_step, run.last_step)
        {
            return vec![Episode::to_end(Failure::LossPlateau, first, last)];
        }
        let Some(last) = run.last_step else {
            return Vec::new();
        };
        let bounded = super::super::causes::loss_bounded_by_mistake(run);
        let since = match (run.loss.flat_since, not_learning(run)) {
            (Some(since), _) if bounded => Some(since),
            (since, Some(_)) => since.or(run.first_step),
            _ => frozen_by_the_schedule(run).map(|f| f.from),
        };
        if let Some(since) = since {
            return vec![Episode::to_end(Failure::LossPlateau, since, last)];
        }
        // A loss that provably cannot reach its optimum is held above it from the first step,
        // even while it still falls.
        if let (true, Some(first)) = (bounded, run.first_step) {
            return vec![Episode::to_end(Failure::LossPlateau, first, last)];
        }
        match (creeping(run), run.first_step) {
            (Some(_), Some(first)) => vec![Episode::to_end(Failure::LossPlateau, first, last)],
            _ => Vec::new(),
        }
    }

    fn locate(
        &self,
        _: &Run,
        events: &[SemanticEvent],
        cluster: &[usize],
        onset: u64,
    ) -> (Option<usize>, Option<usize>) {
        first_at_onset(events, cluster, onset)
    }

    /// Longer is likelier, up to 100 steps or the whole run, when the run is shorter (down
    /// to the 50 steps a judgment of not learning needs); likelier still when the loss ends
    /// where it began, or at its chance level (a noisy loss can end a little below its first
    /// value and still be no better than a constant guess), or where a schedule froze it.
    fn probability(&self, run: &Run, e: &Episode) -> f64 {
        if settled_at_own_entropy(run) {
            return SETTLED;
        }
        let run_len = match (run.first_step, run.last_step) {
            (Some(first), Some(last)) => (last.saturating_sub(first) + 1) as f64,
            _ => 100.0,
        };
        let w = run_len.clamp(NOT_LEARNING_STEPS as f64, 100.0);
        let stuck = run
            .loss
            .initial
            .is_some_and(|i| run.loss.last_smoothed >= 0.95 * i)
            || not_learning(run).is_some()
            || frozen_plateau(run, e.onset).is_some();
        let end = if e.to_end { 1.0 } else { 0.0 };
        0.35 + 0.2 * (e.duration as f64 / w).min(1.0) + if stuck { 0.2 } else { 0.0 } + 0.1 * end
    }

    /// Where the loss stands (see [`standing`]), and a cut of the learning rate that did not
    /// move it.
    fn place(&self, s: &Sentence<'_>) -> String {
        let mut out = standing(s);
        if let Some(c) = super::super::causes::outlasted_cut(s.run, s.episode()) {
            let _ = write!(
                out,
                "; cutting the learning rate from {} to {} (first at step {}) did not move it",
                num(c.peak),
                num(c.last),
                c.cut
            );
        }
        out
    }

    /// A failure that stops learning explains a flat loss, if it is itself a real failure (the
    /// plateau's onset is back-dated to the start of its flat window); a layer that does not
    /// learn can hold the loss flat too.
    fn follows_from(&self, a: &Episode, e: &Episode, l: &Link<'_>) -> bool {
        after_bad_data(a, e, l)
            || matches!(
                a.failure,
                Failure::DeadNeurons
                    | Failure::VanishingGradients
                    | Failure::SaturatedActivations
                    | Failure::StalledLayer
            ) && a.p_failure >= 0.5
                && a.onset <= e.onset + u64::from(l.config.loss_plateau_window)
    }
}

/// The loss of a model that predicts a constant: for a classifier the class prior's
/// cross-entropy, at most ln C over C classes (ln 2 for binary cross-entropy, per output); for
/// a mean squared error the targets' variance (predicting their mean).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Chance {
    /// The loss of a model that learned how often each answer occurs and nothing of its input.
    pub level: f64,
    /// The loss of a model that gives every class the same probability (ln C; a regression's
    /// `level`): where an untrained classifier starts.
    pub uniform: f64,
    pub classes: u64,
    pub binary: bool,
    pub regression: bool,
    /// The standard error of an unbalanced `level`, as one batch measured it (else 0).
    pub error: f64,
}

impl Chance {
    /// `level` is the entropy of the targets' frequencies, below `uniform`: the classes (or a
    /// binary target's two values) are unbalanced.
    pub fn unbalanced(&self) -> bool {
        self.level < self.uniform
    }
}

/// The chance level of the run's loss, when the engine recognizes the loss: cross-entropy or
/// negative log-likelihood over the output's last dimension (also written out as the log of a
/// softmax), binary cross-entropy, or a mean squared error whose targets' variance is known.
/// A classifier's is the entropy of its targets' frequencies where they are unbalanced (see
/// [`unbalanced_level`]), else ln C. A binary cross-entropy whose soft targets' own entropy
/// is half of its level or more has none (see [`SOFT_TARGETS_FLOOR`]).
pub(crate) fn chance_level(run: &Run) -> Option<Chance> {
    let loss = run.model.spec.loss.as_ref()?;
    // (A loss summed over the batch sits at the batch size times the level.)
    if loss.reduction.as_deref() == Some("sum") {
        return None;
    }
    let has = |op: &str| loss.ops.iter().any(|o| o == op);
    let classifier = |classes: u64, binary: bool| {
        let uniform = (classes as f64).ln();
        let prior = unbalanced_level(loss, classes, uniform);
        Chance {
            level: prior.map_or(uniform, |p| p.0),
            uniform,
            classes,
            binary,
            regression: false,
            error: prior.map_or(0.0, |p| p.1),
        }
    };
    if loss.is_binary_cross_entropy() {
        // Soft targets (probabilities, pixel intensities) have an entropy of their own, the
        // loss of a model that predicts each exactly: where it is a large share of the chance
        // level, a loss near that level says nothing of whether the model learned.
        let chance = classifier(2, true);
        let floor = loss.target_entropy.filter(|f| f.is_finite()).unwrap_or(0.0);
        return (floor < SOFT_TARGETS_FLOOR * chance.level).then_some(chance);
    }
    // A cross-entropy written out (`-(onehot * log_softmax(z)).sum(1)`, or the log of a
    // softmax), averaged over the batch somewhere (without a mean it is summed over it).
    let logs_probabilities = has("LogSoftmax")
        || has("Log") && (loss.output_op.as_deref() == Some("Softmax") || has("Softmax"));
    let written_out = logs_probabilities && has("Mean");
    if has("NllLoss") || has("NllLoss2D") || written_out {
        let classes = loss.classes().filter(|&c| c >= 2)?;
        return Some(classifier(classes, false));
    }
    if has("MseLoss") {
        let level = loss.target_var.filter(|v| v.is_finite() && *v > 0.0)?;
        return Some(Chance {
            level,
            uniform: level,
            classes: 0,
            binary: false,
            regression: true,
            error: 0.0,
        });
    }
    None
}

/// A binary cross-entropy on soft targets that ended within this share of the way from where
/// it began down to the targets' own entropy, the least it can reach, converged.
const SETTLED_SHARE: f64 = 0.2;

/// The probability of a plateau where the loss settled at its soft targets' own entropy.
const SETTLED: f64 = 0.1;

/// A loss that ended near the least it can reach: a binary cross-entropy whose soft targets
/// (probabilities, pixel intensities) have an entropy of their own, `LossSpec::target_entropy`,
/// having come at least 80% of the way from its first value down to it. It flattens there as
/// any converged run does, however close to its start that is.
fn settled_at_own_entropy(run: &Run) -> bool {
    let Some(loss) = run.model.spec.loss.as_ref() else {
        return false;
    };
    let own = loss.target_entropy.filter(|f| f.is_finite() && *f > 0.0);
    match (own, run.loss.initial) {
        (Some(own), Some(first)) if loss.is_binary_cross_entropy() && first > own => {
            run.loss.last_smoothed - own <= SETTLED_SHARE * (first - own)
        }
        _ => false,
    }
}

/// A binary cross-entropy's targets' own entropy ([`LossSpec::target_entropy`]) at or above
/// this share of its chance level leaves no chance level to judge the loss by: a model that
/// predicts every soft target exactly ends at it, one that learned nothing not far above.
const SOFT_TARGETS_FLOOR: f64 = 0.5;

/// Targets' frequencies this far below balanced ones (their entropy over ln C) are unbalanced.
const UNBALANCED: f64 = 0.9;
/// ... and not further than this: a first batch of one class or two (a dataset sorted by its
/// labels) says nothing of the classes' frequencies over the run.
const UNBALANCED_FLOOR: f64 = 0.15;

/// The largest standard error of the frequencies' entropy, over the entropy, that is read as
/// the level: a rare class counted on one batch is too uncertain (10% of 64 binary targets
/// gives ~25%).
const UNBALANCED_ERROR: f64 = 0.1;

/// The loss of a classifier that learned only how often each class occurs: the entropy of the
/// first batch's class frequencies (`LossSpec::class_entropy`; a binary cross-entropy's, of how
/// often a target is 1), where it is well below ln C and the batch measured it to within
/// [`UNBALANCED_ERROR`]. The plug-in entropy of one batch is low by about (C - 1) / 2n over n
/// targets (Miller and Madow): that much is added back, counting every class, and a batch of
/// fewer than 2C targets is not read. The level, and its standard error.
fn unbalanced_level(loss: &LossSpec, classes: u64, uniform: f64) -> Option<(f64, f64)> {
    let h = loss.class_entropy.filter(|h| h.is_finite() && *h > 0.0)?;
    let se = loss.class_entropy_se.filter(|se| se.is_finite())?;
    if se > UNBALANCED_ERROR * h {
        return None;
    }
    // Targets counted: a binary cross-entropy's are its compared elements, a negative
    // log-likelihood's its input's elements over the classes.
    let per_target = if loss.is_binary_cross_entropy() {
        1
    } else {
        classes
    };
    let n = loss.compared_numel.or(loss.output_numel)? / per_target;
    if n < 2 * classes {
        return None;
    }
    let level = h + (classes - 1) as f64 / (2 * n) as f64;
    (level < UNBALANCED * uniform && level >= UNBALANCED_FLOOR * uniform).then_some((level, se))
}

/// Steps a run must have before it can be judged not to learn.
const NOT_LEARNING_STEPS: u64 = 50;

/// A regression loss this many times its targets' variance is worse than predicting their
/// mean by more than the one batch's variance is off (~10-20%).
const WORSE_THAN_MEAN: f64 = 1.3;

/// The chance level of a model whose loss stayed flat at or above it (never clearly below,
/// and at least 90% of it at the end; a regression's 70%) over at least half of a run of
/// [`NOT_LEARNING_STEPS`] steps or more. Unbalanced classes are judged at ln C first (as
/// balanced ones: a loss at or above it learned nothing, not even the frequencies), then at
/// their frequencies' entropy, within 10% of it: a model that learned how often each class
/// occurs and nothing of its input (one that always answers the majority class).
pub(crate) fn not_learning(run: &Run) -> Option<Chance> {
    let chance = chance_level(run)?;
    let uniform = Chance {
        level: chance.uniform,
        error: 0.0,
        ..chance
    };
    held_at(run, uniform).or_else(|| chance.unbalanced().then(|| held_at(run, chance)).flatten())
}

/// [`not_learning`] at `chance.level`; an unbalanced level (`band`): ending within 10% of it,
/// never above (above by up to twice its standard error more: a level measured on one batch
/// may be that low; a loss above the true level learned nothing either), flat over most of the
/// run or there from its middle tenth on.
fn held_at(run: &Run, chance: Chance) -> Option<Chance> {
    let band = chance.unbalanced();
    let (first, last) = (run.first_step?, run.last_step?);
    let l = &run.loss;
    // Flat over most of the run; a noisy loss may never count as flat (or only over a late
    // window), but one that began at the level and never got clearly below it (`best`, below)
    // was at it all along.
    let began_at_level = l.initial.is_some_and(|i| i <= 1.1 * chance.level);
    // A regression that ends clearly worse than its targets' mean (beyond the variance's
    // estimation error) has not learned, however its loss got there.
    let worse_than_mean = chance.regression && l.last_smoothed >= WORSE_THAN_MEAN * chance.level;
    let flat_most = began_at_level
        || worse_than_mean
        || l.flat_since
            .is_none_or(|since| 2 * (last.saturating_sub(since) + 1) > last.saturating_sub(first));
    // A loss above its chance level is no better: a classifier's is confidently wrong, a
    // regression's no better than the targets' mean. (The variance comes from one batch of
    // targets, off by ~10-20% for batches of 64-256, and a regression loss is noisy: both
    // bounds are looser.) A loss that rose above where it began did not fail to learn: it
    // diverged, another failure.
    let at_level = l.last_smoothed / chance.level;
    let risen = l.initial.is_none_or(|i| l.last_smoothed > i);
    let highest = 1.1 * (chance.level + 2.0 * chance.error) / chance.level;
    let (at_chance, best) = if chance.regression {
        (at_level >= 0.7, 0.5)
    } else {
        let above = !risen && !band;
        (at_level >= 0.9 && (at_level <= highest || above), 0.8)
    };
    // A loss at unbalanced classes' level fell there from ln C first, and a noisy one may
    // count as flat only late: the means of the run's middle and last tenths at the level
    // say as much.
    let band_held = band
        && pace(run).is_some_and(|p| {
            [p.mid, p.end]
                .iter()
                .all(|v| (0.9..=highest).contains(&(v / chance.level)))
        });
    let held = flat_most && at_chance || band_held;
    (l.observed >= NOT_LEARNING_STEPS && l.best >= best * chance.level && held).then_some(chance)
}

/// A loss that creeps: over a run of at least [`NOT_LEARNING_STEPS`] steps it never got below
/// a third of where it began, while every optimizer step moves the weights by less than a
/// tenth of what a learning rate that trains moves them (an update-to-weight ratio of ~1e-3,
/// measured), or the input's features are on scales so far apart that the small ones need
/// weights far larger than the steps reach (see `causes::uneven_features`). Or it fell by
/// less than [`STEADY_FELL_TO`] and still falls as fast as it began (see [`steady_descent`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Creeping {
    /// The loss's best over its initial level.
    pub fell_to: f64,
    pub steps: u64,
    /// The run ended still falling as fast as it began (see [`steady_descent`]).
    pub steady: bool,
}

/// The loss (means of the run's first, middle and last tenth, at least 3 points each).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Pace {
    pub start: f64,
    pub mid: f64,
    pub end: f64,
}

/// A loss ending above this share of where it began has not come far.
const STEADY_FELL_TO: f64 = 0.6;
/// The second half's fall at least this share of the first half's: not levelling off.
const STEADY_PACE: f64 = 0.8;
/// A learning rate raised more than this over the run is still warming up: a slow start is
/// what a warmup makes.
const WARMING_UP: f64 = 1.5;

/// The loss's mean over a tenth of a run of at least [`NOT_LEARNING_STEPS`] steps (3 steps or
/// more) at its start, its middle and its end.
pub(crate) fn pace(run: &Run) -> Option<Pace> {
    if run.loss.observed < NOT_LEARNING_STEPS {
        return None;
    }
    let (_, values) = run
        .grads
        .read(run.global_series(Global::Loss), Reduce::Last);
    let loss: Vec<f64> = values.into_iter().filter(|v| v.is_finite()).collect();
    let n = loss.len();
    let w = (n / 10).max(3);
    if n < 3 * w {
        return None;
    }
    let mean = |from: usize| loss[from..from + w].iter().sum::<f64>() / w as f64;
    Some(Pace {
        start: mean(0),
        mid: mean(n / 2 - w / 2),
        end: mean(n - w),
    })
}

/// The loss over a run of at least [`NOT_LEARNING_STEPS`] steps that fell by at least 5% but
/// ended above [`STEADY_FELL_TO`] of where it began, and fell over the second half at least
/// [`STEADY_PACE`] times as much as over the first: far from where it levels off, and getting
/// there slowly. Not while the learning rate was being raised (a warmup).
pub(crate) fn steady_descent(run: &Run) -> Option<Pace> {
    let p = pace(run)?;
    let warming_up = match (run.lr_first, run.first_step, run.last_step) {
        (Some(first), Some(from), Some(to)) => run
            .lr_between(from, to)
            .is_some_and(|max| max > WARMING_UP * first),
        _ => false,
    };
    let fell = p.start - p.end;
    (p.start > 0.0
        && fell >= 0.05 * p.start
        && p.end >= STEADY_FELL_TO * p.start
        && p.mid - p.end >= STEADY_PACE * (p.start - p.mid)
        && !warming_up)
        .then_some(p)
}

/// Update-to-weight ratio below which steps are too small to train (a tenth of ~1e-3).
const CREEPING_UPDATE: f64 = 1e-4;

pub(crate) fn creeping(run: &Run) -> Option<Creeping> {
    let l = &run.loss;
    let slow_steps =
        super::super::causes::measured_update_ratio(run).is_some_and(|r| r < CREEPING_UPDATE);
    let reason = slow_steps || super::super::causes::uneven_features(run).is_some();
    let steady = steady_descent(run).is_some();
    let initial = l.initial.filter(|i| *i > 0.0 && i.is_finite())?;
    let fell_to = l.best / initial;
    let creeps = reason && l.observed >= NOT_LEARNING_STEPS && fell_to >= 1.0 / 3.0;
    (creeps || steady).then_some(Creeping {
        fell_to,
        steps: l.observed,
        steady,
    })
}

/// A loss the schedule froze (see [`frozen_by_the_schedule`]): the step from which the rate
/// stayed below a hundredth of its peak, the loss's level over the older and newer half of
/// the window before it, and its level now.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Frozen {
    pub from: u64,
    pub before: f64,
    pub then: f64,
    pub now: f64,
}

/// A loss still falling over the window before the schedule cut the learning rate below a
/// hundredth of its peak (its newer half clearly below its older: by 2% and three standard
/// errors, asked once), that all the steps since took less far than the half window before
/// it, while the rate sat below a thousandth for a quarter of the run or more (see
/// `lr_collapse`): frozen wherever it had got to, not converged (a run that converges levels off while its rate still moves the weights; a
/// schedule that ends at zero gets there in its last steps; a rate cut in reaction to a
/// plateau was cut where the loss no longer fell). A per-epoch scheduler stepped every batch
/// does this after the loss has already fallen a long way. Not for a loss frozen within 5% of
/// zero (of where it began): that run had fit its data.
pub(crate) fn frozen_by_the_schedule(run: &Run) -> Option<Frozen> {
    let c = run.lr_course;
    let from = c.small_from?;
    super::super::causes::lr_collapse(run, from)?;
    let [(before, before_se), (then, then_se)] = c.loss_at_small?;
    let [_, (now, _)] = run.loss.halves()?;
    let initial = run.loss.initial?;
    let fell = before - then > (0.02 * before).max(3.0 * before_se.hypot(then_se));
    // All the steps since took it less far than the half window before.
    let held = then - now < before - then;
    (fell && held && now > 0.05 * initial).then_some(Frozen {
        from,
        before,
        then,
        now,
    })
}

/// [`frozen_by_the_schedule`], when the plateau that begins at `onset` is the one it makes.
pub(crate) fn frozen_plateau(run: &Run, onset: u64) -> Option<Frozen> {
    frozen_by_the_schedule(run).filter(|f| f.from == onset)
}

/// A loss that oscillates (see `LossTrack::oscillation`) over a run of at least
/// [`NOT_LEARNING_STEPS`] steps and ends no lower than the plateau level of where it began:
/// the steps bounce it around instead of descending.
pub(crate) fn bouncing(run: &Run, config: &Config) -> bool {
    let l = &run.loss;
    l.observed >= NOT_LEARNING_STEPS
        && l.oscillation().is_some()
        && l.initial
            .is_some_and(|i| i > 0.0 && l.last_smoothed >= config.loss_plateau_level * i)
}

/// A loss that was zero (within 1e-6) at its first step and still is: not a converged run (a
/// loss starts above its optimum) but one computed so that it cannot move, whose relative
/// changes are noise.
fn at_zero(run: &Run) -> bool {
    let l = &run.loss;
    l.first_value().is_some_and(|f| f.abs() <= 1e-6) && l.last_smoothed.abs() <= 1e-6
}

/// Where a plateaued loss stands: held above its optimum by a mistake, creeping, or at its
/// chance level.
fn standing(s: &Sentence<'_>) -> String {
    if at_zero(s.run) {
        return ", at zero from the first step: a loss that is 0 whatever the weights gives the model nothing to learn from".into();
    }
    // (A loss held at its chance level says more than "above its optimum": it is said below.)
    if s.run.loss.flat_since.is_none()
        && super::super::causes::loss_bounded_by_mistake(s.run)
        && not_learning(s.run).is_none()
    {
        return ", held above its optimum from the first step (it may still fall, but not to where it should)".into();
    }
    if not_learning(s.run).is_none() {
        if let Some(c) = creeping(s.run) {
            let still = if c.steady {
                ", and still falling as fast as it began"
            } else {
                ""
            };
            return format!(
                ", creeping: at best {:.0}% lower after {} steps{still}",
                100.0 * (1.0 - c.fell_to),
                c.steps
            );
        }
    }
    if let Some(f) = frozen_plateau(s.run, s.episode().onset) {
        return format!(
            ", frozen: it was still falling ({} to {} over the steps before) when the schedule cut the learning rate below a hundredth of its peak, and fell no further than {} since",
            num(f.before),
            num(f.then),
            num(f.now)
        );
    }
    not_learning(s.run).map_or(String::new(), |c| {
        if c.regression {
            if s.run.loss.last_smoothed >= WORSE_THAN_MEAN * c.level {
                return format!(
                    ", at {:.1}x the variance of its targets ({}): the model predicts worse than their mean",
                    s.run.loss.last_smoothed / c.level,
                    num(c.level)
                );
            }
            return format!(
                ", at the variance of its targets ({}): the model predicts no better than their mean",
                num(c.level)
            );
        }
        if c.unbalanced() {
            let what = if c.binary {
                "how often a target is 1"
            } else {
                "how often each class occurs"
            };
            return format!(
                ", at its chance level ({}: the entropy of {what} in its targets, which are unbalanced; ln {} = {} were they balanced): the model learned {what} and nothing of its input",
                num(c.level),
                c.classes,
                num(c.uniform)
            );
        }
        let (at, worse) = if s.run.loss.last_smoothed > 1.1 * c.level {
            (
                "above",
                "is confidently wrong, worse than a constant guess",
            )
        } else {
            ("at", "predicts no better than a constant guess")
        };
        format!(
            ", {at} its chance level ({} = ln {} for {} classes{}): the model {worse}",
            num(c.level),
            c.classes,
            c.classes,
            if c.binary { ", binary cross-entropy" } else { "" }
        )
    })
}
