//! Abductive ranking: for each failure episode, how likely it is to be a real failure, and how
//! well each candidate cause explains the evidence.
//!
//! Layout: one file per cause, each a [`CauseRule`] that holds everything about that cause:
//! the failures it can explain, the evidence for it with the weight and the reason each piece
//! counts, its phrase in the hypothesis sentence and its remedies. [`RULES`] lists them. What
//! the rules look at is gathered once in `evidence` (run-wide [`Evidence`], per-episode
//! [`Features`]); how likely an episode is to be a real failure, whatever its cause, is its
//! failure's rule (`failures`).
//!
//! Every cause gets a score: the sum of the evidence weights that support it (listed with the
//! reason each one counts). Scores become probabilities by a softmax (temperature 1/1.5) over
//! the candidates of that failure, with `unknown` always present at score 0, so a cause wins
//! only by out-explaining "we don't know". A hypothesis' confidence is
//! `P(failure is real) x P(cause | failure)`, discounted for failures that are consequences
//! of another.
//!
//! To add a cause: a name in `vocab::Cause`, a file here implementing [`CauseRule`], and its
//! entry in [`RULES`] (a test checks every cause has exactly one rule).

mod evidence;

mod bad_input_data;
mod batch_axis_mismatch;
mod dying_relu;
mod eval_mode;
mod flipped_update_sign;
mod learning_rate_too_high;
mod learning_rate_too_low;
mod missing_normalization;
mod missing_zero_grad;
mod network_depth;
mod numerical_instability;
mod output_ignores_input;
mod output_loss_mismatch;
mod over_regularization;
mod parameters_not_updated;
mod poor_initialization;
mod saturating_activation;
mod sequence_start_readout;
mod target_shape_mismatch;
mod unknown;

use crate::engine::Run;
use crate::event::SemanticEvent;

use super::episodes::Episode;
use super::remedy::Remedy;
use super::vocab::{Cause, Failure};

pub(crate) use bad_input_data::targets_outside_probabilities;
pub(crate) use evidence::{
    Evidence, Features, features, forward_growth, lr_collapse, measured_update_ratio,
    outlasted_cut, times, uneven_features,
};
pub(crate) use flipped_update_sign::climbing;
pub(crate) use output_loss_mismatch::{falls_without_end, found as output_mismatch};
pub(crate) use over_regularization::penalty_dominated;

/// Every cause's own run-wide facts.
pub(crate) fn own_run_facts(run: &Run) -> Facts {
    let mut out = Facts::new();
    for r in RULES {
        out.extend(r.run_facts(run));
    }
    out
}

/// Everything a rule may look at when it weighs the evidence for its cause in one episode.
pub(crate) struct Case<'a> {
    pub run: &'a Run,
    pub ev: &'a Evidence,
    pub f: &'a Features,
    pub episodes: &'a [Episode],
    /// The episode being explained (`episodes[k]`).
    pub e: &'a Episode,
    pub k: usize,
    /// The analysis' events, which episodes index.
    pub events: &'a [SemanticEvent],
    /// " (lr 0.1)" after a sentence about step sizes, or empty when the lr is not known.
    pub lr_txt: String,
}

/// What a rule's remedies may refer to.
pub(crate) struct RemedyCase<'a> {
    pub run: &'a Run,
    pub e: &'a Episode,
    /// The episode that explains `e`, when one does (`e` follows from it).
    pub by: Option<&'a Episode>,
}

impl RemedyCase<'_> {
    /// The framework the run was collected from (its remedies name that framework's functions).
    pub fn framework(&self) -> super::remedy::Framework {
        super::remedy::Framework::of(self.run.model.spec.framework.as_deref())
    }

    /// The root-cause layer's qualified name.
    pub fn layer(&self) -> Option<String> {
        self.e
            .root
            .map(|m| self.run.model.module_name(m).to_string())
    }

    /// The first learning rate.
    pub fn lr(&self) -> Option<f64> {
        self.run.lr_first
    }
}

/// One cause: which failures it can explain, the evidence for it, how it reads and what to do.
pub(crate) trait CauseRule: Sync {
    fn cause(&self) -> Cause;
    /// How the cause reads in the hypothesis sentence ("a learning rate that is too high").
    fn phrase(&self) -> &'static str;
    /// Whether the cause is a candidate explanation of `failure`.
    fn explains(&self, failure: Failure) -> bool;
    /// Whether the cause competes for `failure` even without evidence (the default). A cause
    /// observed directly (a loop mistake the collector reports) is a candidate only when its
    /// evidence is there, so it never dilutes the others.
    fn always_candidate(&self, _failure: Failure) -> bool {
        true
    }
    /// Adds the weighted evidence for this cause in `c` (called only when it explains
    /// `c.e.failure`). Reasons are listed in the order they are added.
    fn evidence(&self, c: &Case<'_>, v: &mut Votes);
    /// Concrete changes to the user's code.
    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy>;
    /// The run-wide facts only this cause weighs, by name, as `evidence_features` lists them
    /// (the default: none).
    fn run_facts(&self, _run: &Run) -> Facts {
        Facts::new()
    }
    /// The facts of one episode only this cause weighs (the default: none).
    fn episode_facts(&self, _c: &Case<'_>) -> Facts {
        Facts::new()
    }
}

/// Named facts, for fitting and inspecting the cause weights.
pub(crate) type Facts = serde_json::Map<String, serde_json::Value>;

/// A cause's own facts as [`Facts`].
pub(crate) fn facts_of(own: &impl serde::Serialize) -> Facts {
    match serde_json::to_value(own) {
        Ok(serde_json::Value::Object(m)) => m,
        _ => Facts::new(),
    }
}

/// Every cause's rule. Candidates of one failure are ranked in this order when their
/// probabilities tie exactly.
pub(crate) static RULES: &[&dyn CauseRule] = &[
    &dying_relu::DyingRelu,
    &saturating_activation::SaturatingActivation,
    &learning_rate_too_high::LearningRateTooHigh,
    &learning_rate_too_low::LearningRateTooLow,
    &poor_initialization::PoorInitialization,
    &network_depth::NetworkDepth,
    &missing_normalization::MissingNormalization,
    &bad_input_data::BadInputData,
    &numerical_instability::NumericalInstability,
    // Mistakes in the training loop.
    &missing_zero_grad::MissingZeroGrad,
    &parameters_not_updated::ParametersNotUpdated,
    &eval_mode::EvalMode,
    &output_loss_mismatch::OutputLossMismatch,
    &target_shape_mismatch::TargetShapeMismatch,
    &over_regularization::OverRegularization,
    &output_ignores_input::OutputIgnoresInput,
    &flipped_update_sign::FlippedUpdateSign,
    &batch_axis_mismatch::BatchAxisMismatch,
    &sequence_start_readout::SequenceStartReadout,
    &unknown::Unknown,
];

/// The rule of `cause`.
pub(crate) fn rule(cause: Cause) -> &'static dyn CauseRule {
    RULES
        .iter()
        .copied()
        .find(|r| r.cause() == cause)
        .unwrap_or(&unknown::Unknown)
}

/// The weighted evidence for one cause.
#[derive(Clone, Debug, Default)]
pub(crate) struct Votes {
    score: f64,
    reasons: Vec<String>,
    proven: bool,
}

impl Votes {
    /// Adds `weight` to the score; a positive weight lists `reason`. A negative weight is
    /// evidence against the cause and carries no reason.
    pub fn add(&mut self, weight: f64, reason: impl Into<String>) {
        self.score += weight;
        if weight > 0.0 {
            self.reasons.push(reason.into());
        }
    }

    /// Evidence that is a fact of the program, not an inference from the statistics (the
    /// output does not fit the loss, `.grad` was never zeroed): the mistake is there whatever
    /// else is wrong, so another proven mistake is a second cause, not a rival (see
    /// [`rank_causes`]).
    pub fn proof(&mut self, weight: f64, reason: impl Into<String>) {
        self.add(weight, reason);
        self.proven = true;
    }

    /// Evidence against the cause.
    pub fn against(&mut self, weight: f64) {
        self.score -= weight;
    }
}

/// One scored candidate cause, with the reasons behind its score.
#[derive(Clone, Debug)]
pub(crate) struct Scored {
    pub cause: Cause,
    pub score: f64,
    pub reasons: Vec<String>,
    /// Its evidence includes a fact of the program (see [`Votes::proof`]).
    pub proven: bool,
}

/// How far below `unknown` every named cause starts: it must bring evidence just to tie with
/// "we don't know", so a failure nothing explains is reported as one of unknown cause.
const NAMED_PRIOR: f64 = 1.5;

/// Weight of "a consequence shares the cause of the failure it follows from".
const INHERITED: f64 = 3.0;

/// Weight of "a plateau follows from a real failure that stops learning" (see
/// [`Case::stalled_by`]).
const STALLED: f64 = 3.0;

impl Case<'_> {
    /// The one of three names for a thing in the user's framework (`PyTorch`'s for burn and
    /// when the spec names none), for evidence that quotes the user's code.
    pub fn framework_says(&self, torch: &str, keras: &str, jax: &str) -> String {
        super::remedy::Framework::of(self.run.model.spec.framework.as_deref())
            .pick(torch, keras, jax)
    }
}

impl<'a> Case<'a> {
    pub fn new(
        run: &'a Run,
        ev: &'a Evidence,
        f: &'a Features,
        events: &'a [SemanticEvent],
        episodes: &'a [Episode],
        k: usize,
    ) -> Self {
        Self {
            run,
            ev,
            f,
            episodes,
            e: &episodes[k],
            k,
            events,
            lr_txt: ev
                .lr_first
                .map_or(String::new(), |lr| format!(" (lr {})", fmt_g(lr))),
        }
    }

    /// Every cause's own facts of this episode.
    pub fn own_facts(&self) -> Facts {
        let mut out = Facts::new();
        for r in RULES {
            out.extend(r.episode_facts(self));
        }
        out
    }

    /// For a plateau that no other failure explains: the cause of a real failure that stops
    /// learning around it (vanishing gradients or dead units), with the sentence that says so.
    pub fn stalled_by(&self) -> Option<(Cause, String)> {
        if self.f.root_cause.is_some() {
            return None;
        }
        let j = self.f.vanishing_or_dead?;
        let other = &self.episodes[j];
        let cause = match other.failure {
            Failure::DeadNeurons => Cause::DyingRelu,
            _ if self.f.saturation.is_some() => Cause::SaturatingActivation,
            _ => Cause::NetworkDepth,
        };
        Some((
            cause,
            format!(
                "{} from step {} keep the weights from learning",
                other.failure.phrase().to_lowercase(),
                other.onset
            ),
        ))
    }
}

/// Scores the candidate causes of episode `k`, most probable first.
pub(crate) fn rank_causes(
    run: &Run,
    ev: &Evidence,
    events: &[SemanticEvent],
    episodes: &[Episode],
    k: usize,
    f: &Features,
) -> Vec<(Scored, f64)> {
    let case = Case::new(run, ev, f, events, episodes, k);
    let e = case.e;
    let mut scored: Vec<Scored> = RULES
        .iter()
        .filter(|r| {
            r.cause() == Cause::Unknown
                || (e.failure.ranked_by_cause_rules() && r.explains(e.failure))
        })
        .filter_map(|r| {
            let mut v = Votes::default();
            if r.cause() != Cause::Unknown {
                v.score = -NAMED_PRIOR;
                r.evidence(&case, &mut v);
            }
            // A consequence shares the cause of the failure it follows from; one that began
            // first (saturation under the vanishing it brings about) is that failure's mechanism.
            if let Some((cause, j)) = f.root_cause.filter(|(c, _)| *c == r.cause()) {
                let root = &episodes[j];
                let relation = if root.onset <= e.onset {
                    "it follows from"
                } else {
                    "it leads to"
                };
                v.add(
                    INHERITED,
                    format!(
                        "{relation} the {} at step {} ({})",
                        root.failure.as_str().replace('_', " "),
                        root.onset,
                        cause.phrase()
                    ),
                );
            }
            if v.reasons.is_empty() && !r.always_candidate(e.failure) {
                return None;
            }
            Some(Scored {
                cause: r.cause(),
                score: v.score,
                reasons: v.reasons,
                proven: v.proven,
            })
        })
        .collect();
    // Probabilities by softmax with temperature 1/1.5, sorted descending. A proven cause does
    // not compete with the other proven ones: a run can hold several mistakes at once, and
    // each one found in the program is a cause of its own.
    let max = scored
        .iter()
        .map(|s| s.score)
        .fold(f64::NEG_INFINITY, f64::max);
    let weights: Vec<f64> = scored
        .iter()
        .map(|s| (1.5 * (s.score - max)).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let proven: f64 = scored
        .iter()
        .zip(&weights)
        .filter(|(s, _)| s.proven)
        .map(|(_, w)| w)
        .sum();
    let mut out: Vec<(Scored, f64)> = scored
        .drain(..)
        .zip(weights)
        .map(|(s, w)| {
            let rivals = if s.proven { total - proven + w } else { total };
            (s, w / rivals)
        })
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1));
    out
}

/// The loss cannot reach its optimum because of a proven mistake in how it is computed (the
/// output does not fit the loss, or the loss broadcasts the target), or in the model (layers
/// whose units all have the same weights train like a single unit).
pub(crate) fn loss_bounded_by_mistake(run: &Run) -> bool {
    output_loss_mismatch::found(run)
        .is_some_and(|(m, _)| m != output_loss_mismatch::Mismatch::NllOfRawOutput)
        || target_shape_mismatch::broadcast(run).is_some()
        || poor_initialization::identical_units(run).is_some()
        || over_regularization::loss_held_by_penalty(run).is_some()
        || batch_axis_mismatch::found(run).is_some()
        || sequence_start_readout::found(run).is_some()
}

pub(crate) fn fmt_g(v: f64) -> String {
    super::text::num(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cause_has_exactly_one_rule() {
        for &cause in Cause::ALL {
            let n = RULES.iter().filter(|r| r.cause() == cause).count();
            assert_eq!(n, 1, "{cause} has {n} rules");
        }
        assert_eq!(RULES.len(), Cause::ALL.len());
    }

    #[test]
    fn every_failure_has_a_named_candidate() {
        for &failure in Failure::ALL.iter().filter(|f| f.ranked_by_cause_rules()) {
            assert!(
                RULES
                    .iter()
                    .any(|r| r.cause() != Cause::Unknown && r.explains(failure)),
                "{failure} has no named cause"
            );
        }
    }
}
