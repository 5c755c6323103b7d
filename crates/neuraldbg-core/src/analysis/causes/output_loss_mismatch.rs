//! `output_loss_mismatch`: the model's output activation does not fit its loss. Read from what
//! the loss did with the output on the first step (`ModelSpec::loss`): the operations the loss
//! applied and the one that produced the output.
//!
//! - probabilities (softmax) fed to a loss that applies its own log-softmax (cross-entropy):
//!   the logits the loss needs are squeezed into [0, 1], its gradient shrinks to almost nothing
//!   once one class leads, and the loss cannot go below a floor;
//! - probabilities fed to a negative log-likelihood without the log;
//! - a sigmoid output fed to a loss that applies its own sigmoid (BCE with logits), or put
//!   through a second sigmoid on the way: outputs live in [0.5, 0.73], the loss has a floor of
//!   ~0.31 per sample; so does a softmax output fed to it (and its outputs sum to one, so a
//!   multi-label target cannot be met); a softmax under a binary cross-entropy of
//!   probabilities whose targets mark several labels present in a sample cannot meet them either;
//! - a bounded activation (tanh, sigmoid) making the logits of such a loss: the logit gaps,
//!   and with them how confident the loss can get, are capped;
//! - a rectifier (`ReLU`) making the logits of such a loss: a logit pushed below zero is cut to 0
//!   with no gradient, so the loss can only lower a class by killing its unit;
//! - a log taken of outputs that are not probabilities (a hand-written cross-entropy on raw
//!   logits): outputs at or below zero are clipped or undefined, and carry no gradient;
//! - raw outputs into a negative log-likelihood with no log-softmax: the loss is minus the
//!   target's output and has no minimum;
//! - a softmax over one unit: the output is the constant 1, every gradient is exactly zero;
//!   so is a cross-entropy over classes taken of one unit;
//! - class indices beyond the output's last unit: those targets have no logit;
//! - a softmax taken over the batch rather than the classes: each sample's "probabilities"
//!   depend on the other samples of the batch and do not sum to one over its classes;
//! - a bounded output (sigmoid, tanh, `ReLU`...) regressing targets outside its range: the
//!   error on those targets can never go below the distance to the bound.

use crate::engine::Run;
use crate::model::LossSpec;

use super::super::remedy::Remedy;
use super::super::vocab::{Cause, Failure};
use super::{Case, CauseRule, RemedyCase, Votes, fmt_g};

pub(crate) struct OutputLossMismatch;

/// The mismatches this rule knows, as found in a loss description.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Mismatch {
    SoftmaxIntoCrossEntropy,
    SoftmaxIntoNll,
    SigmoidIntoLogitsLoss,
    /// Softmax probabilities fed to a binary cross-entropy on logits (a multi-label loss): each
    /// output's sigmoid lies in [0.5, 0.73], and the outputs sum to one.
    SoftmaxIntoLogitsLoss,
    /// A softmax output under a binary cross-entropy of probabilities whose targets mark
    /// `labels` present in one sample: the outputs sum to one, so no two labels can both be 1.
    SoftmaxForMultiLabel {
        labels: u64,
    },
    /// A sigmoid output passed through a second sigmoid on its way to the loss.
    SigmoidTwice,
    /// A bounded activation (tanh, sigmoid...) producing the logits of a loss that applies its
    /// own softmax or sigmoid: the logit gaps are capped, so the loss has a floor above zero.
    BoundedLogits,
    /// A rectifier producing the logits of such a loss.
    RectifiedLogits,
    /// The loss takes the log of the model's output, which no softmax, sigmoid or exponential
    /// made positive.
    LogOfRawOutput,
    OneUnitSoftmax,
    /// Raw outputs (no log-softmax) fed to a negative log-likelihood: the loss is minus the
    /// target's output, which has no minimum.
    NllOfRawOutput,
    /// A cross-entropy over classes (its own log-softmax, or Keras' division of probabilities
    /// by their sum) taken of one output unit: that one class's probability is the constant 1.
    OneUnitCrossEntropy,
    /// The first batch's class indices reach `hi`, beyond the last of the output's `units`
    /// (labels counted from 1, a class count that is off): those samples have no logit, and
    /// the loss is NaN for them (optax) or ignores them (Keras).
    ClassesBeyondOutput {
        hi: f64,
        units: u64,
    },
    SoftmaxOverBatch,
    BoundedRegression {
        lo: f64,
        hi: f64,
    },
}

/// A regression loss, by the framework's operation names: a named one, or a mean of absolute
/// or squared differences written out.
pub(crate) fn is_regression(ops: &[&str]) -> bool {
    let has = |name: &str| ops.contains(&name);
    ["MseLoss", "L1Loss", "SmoothL1Loss", "HuberLoss"]
        .iter()
        .any(|o| has(o))
        || (has("Sub") && (has("Abs") || has("Pow")))
}

/// The range of a bounded output operation (`Relu`: [0, inf)).
fn bounds(op: &str) -> Option<(f64, f64)> {
    Some(match op {
        "Sigmoid" | "Hardsigmoid" => (0.0, 1.0),
        "Tanh" | "Hardtanh" | "Softsign" => (-1.0, 1.0),
        "Relu" | "Softplus" | "Relu6" | "Exp" => (0.0, f64::INFINITY),
        _ => return None,
    })
}

pub(crate) fn mismatch(loss: &LossSpec) -> Option<Mismatch> {
    let ops: Vec<&str> = loss.ops.iter().map(String::as_str).collect();
    let has = |name: &str| ops.contains(&name);
    if loss.output_op.as_deref() == Some("Softmax") && loss.output_units == Some(1) {
        return Some(Mismatch::OneUnitSoftmax);
    }
    // What a loss over classes does with the output's units, whatever operation made them.
    let over_classes = has("LogSoftmax") || (has("Log") && has("Div"));
    if loss.classes() == Some(1) && over_classes && !loss.is_binary_cross_entropy() {
        return Some(Mismatch::OneUnitCrossEntropy);
    }
    if let (Some((_, hi)), Some(units)) = (loss.class_range, loss.classes()) {
        if over_classes && hi >= units as f64 {
            return Some(Mismatch::ClassesBeyondOutput { hi, units });
        }
    }
    let out = loss.output_op.as_deref()?;
    if loss.softmax_over_batch {
        return Some(Mismatch::SoftmaxOverBatch);
    }
    // (The softmax may be the model's last operation, or the loss's own, applied to the
    // logits before its log-softmax: `ops` run from the loss back to the output.)
    let softmax_inside = ops
        .iter()
        .position(|o| *o == "LogSoftmax")
        .is_some_and(|k| ops[k + 1..].contains(&"Softmax"));
    if (out == "Softmax" && has("LogSoftmax")) || softmax_inside {
        return Some(Mismatch::SoftmaxIntoCrossEntropy);
    }
    if out == "Softmax" && has("NllLoss") && !has("Log") {
        return Some(Mismatch::SoftmaxIntoNll);
    }
    // Nothing between the output and the negative log-likelihood but reshapes (anything else
    // may be a log-softmax written out, `x - x.logsumexp(1, keepdim=True)`).
    let reshapes_only = ops.iter().all(|o| {
        matches!(
            *o,
            "NllLoss"
                | "View"
                | "Reshape"
                | "UnsafeView"
                | "Squeeze"
                | "Unsqueeze"
                | "Transpose"
                | "Permute"
                | "Select"
                | "Slice"
                | "Index"
                | "Clone"
                | "ToCopy"
                | "Alias"
                | "T"
        )
    });
    let log_probabilities = matches!(out, "LogSoftmax" | "Log" | "LogSigmoid");
    if has("NllLoss") && reshapes_only && !log_probabilities {
        return Some(Mismatch::NllOfRawOutput);
    }
    if out == "Sigmoid" && has("BinaryCrossEntropyWithLogits") {
        return Some(Mismatch::SigmoidIntoLogitsLoss);
    }
    if out == "Softmax" && has("BinaryCrossEntropyWithLogits") {
        return Some(Mismatch::SoftmaxIntoLogitsLoss);
    }
    if let (true, Some(labels)) = (
        out == "Softmax" && has("BinaryCrossEntropy"),
        loss.labels_per_sample.filter(|&n| n >= 2),
    ) {
        return Some(Mismatch::SoftmaxForMultiLabel { labels });
    }
    if out == "Sigmoid" && has("Sigmoid") {
        return Some(Mismatch::SigmoidTwice);
    }
    let logits_loss = has("LogSoftmax") || has("BinaryCrossEntropyWithLogits");
    if logits_loss && bounds(out).is_some_and(|(lo, hi)| hi - lo <= 2.0) {
        return Some(Mismatch::BoundedLogits);
    }
    if logits_loss && matches!(out, "Relu" | "Relu6") {
        return Some(Mismatch::RectifiedLogits);
    }
    // What the log is taken of: the output, through the operations between them (a softmax
    // written into the loss makes probabilities of logits).
    let positive = |op: &str| {
        matches!(
            op,
            "Softmax" | "Sigmoid" | "Exp" | "Softplus" | "LogSoftmax" | "Abs" | "Pow"
        )
    };
    let log_of_raw = ops
        .iter()
        .position(|o| *o == "Log")
        .is_some_and(|k| !positive(out) && !ops[k + 1..].iter().any(|o| positive(o)));
    if log_of_raw && !logits_loss && !has("NllLoss") && !is_regression(&ops) {
        return Some(Mismatch::LogOfRawOutput);
    }
    if is_regression(&ops) {
        let (lo, hi) = bounds(out)?;
        let (tmin, tmax) = loss.target_range?;
        let spread = (tmax - tmin).max(if hi.is_finite() { hi - lo } else { 0.0 });
        let slack = 0.05 * spread;
        if tmin < lo - slack || tmax > hi + slack {
            return Some(Mismatch::BoundedRegression { lo, hi });
        }
    }
    None
}

pub(crate) fn found(run: &Run) -> Option<(Mismatch, &LossSpec)> {
    let loss = run.model.spec.loss.as_ref()?;
    mismatch(loss).map(|m| (m, loss))
}

/// A loss with no minimum that went below zero: it falls without end (raw outputs into a
/// negative log-likelihood) rather than being held above its optimum.
pub(crate) fn falls_without_end(run: &Run) -> bool {
    matches!(found(run), Some((Mismatch::NllOfRawOutput, _))) && run.loss.best < 0.0
}

/// A bounded output regressing targets on the raw scale of the inputs themselves (an
/// autoencoder fed unnormalized data: pixels of 0-255 in and out): the output was chosen for
/// normalized data, and the mismatch is the data's. The sentence that says so.
pub(crate) fn raw_data_targets(run: &Run) -> Option<String> {
    let (Mismatch::BoundedRegression { lo, hi }, loss) = found(run)? else {
        return None;
    };
    let x = super::evidence::huge_inputs(run.data.first_scale)?;
    let (tmin, tmax) = loss.target_range?;
    let t = tmin.abs().max(tmax.abs());
    (0.5 * x..=2.0 * x).contains(&t).then(|| {
        format!(
            "the regression targets span [{}, {}], the scale of the inputs (which reach {}): the data is not normalized, and the {} output (range [{}, {}]) cannot reach it",
            fmt_g(tmin),
            fmt_g(tmax),
            fmt_g(x),
            loss.output_op.as_deref().unwrap_or("bounded"),
            fmt_g(lo),
            fmt_g(hi)
        )
    })
}

/// [`raw_data_targets`], when the mismatch explains the failure of episode `c.e`.
pub(crate) fn raw_data_explains(c: &Case<'_>) -> Option<String> {
    let (m, loss) = found(c.run)?;
    let out = loss.output_op.as_deref().unwrap_or("?");
    explains_failure(m, out, c)
        .then(|| raw_data_targets(c.run))
        .flatten()
}

/// Whether mismatch `m` of output `out` explains the failure of episode `c.e`. The one-unit
/// softmax makes every gradient zero, and so does a rectified output once its units are cut to
/// 0: they explain vanishing gradients. The others make learning slow or impossible: a
/// plateau, or saturated/dead outputs. A log of raw outputs also blows gradients up where it
/// begins: the log's gradient is 1/p, unbounded as an output (or, where the loss divides the
/// outputs by their sum to make them "probabilities", as Keras' does, that sum) nears zero,
/// so an explosion or a NaN that begins in the output layer is the loss's.
fn explains_failure(m: Mismatch, out: &str, c: &Case<'_>) -> bool {
    let rectified = matches!(out, "Relu" | "Relu6");
    let one_unit = matches!(m, Mismatch::OneUnitSoftmax | Mismatch::OneUnitCrossEntropy);
    match c.e.failure {
        Failure::LossPlateau => true,
        Failure::VanishingGradients => one_unit || rectified,
        // Every gradient exactly zero: no layer moves.
        Failure::StalledLayer => one_unit,
        Failure::SaturatedActivations | Failure::DeadNeurons | Failure::LossDivergence => !one_unit,
        // A class with no logit: NaN in the loss from the first step (optax fills it).
        Failure::NonFinite
            if c.f.at_start && (one_unit || matches!(m, Mismatch::ClassesBeyondOutput { .. })) =>
        {
            true
        }
        Failure::ExplodingGradients | Failure::NonFinite => {
            m == Mismatch::LogOfRawOutput && begins_at_the_output(c)
        }
        _ => false,
    }
}

/// The episode's root is the model's output layer (its last layer with weights).
fn begins_at_the_output(c: &Case<'_>) -> bool {
    let model = &c.run.model;
    let output = model.layers.iter().rposition(|l| l.weight.is_some());
    let root = c.e.root.and_then(|m| model.module_layer[m]);
    root.is_some() && root == output
}

impl CauseRule for OutputLossMismatch {
    fn cause(&self) -> Cause {
        Cause::OutputLossMismatch
    }

    fn phrase(&self) -> &'static str {
        "an output activation that does not fit the loss"
    }

    fn explains(&self, failure: Failure) -> bool {
        matches!(
            failure,
            Failure::LossPlateau
                | Failure::VanishingGradients
                | Failure::SaturatedActivations
                | Failure::DeadNeurons
                | Failure::LossDivergence
                | Failure::ExplodingGradients
                | Failure::NonFinite
                | Failure::StalledLayer
        )
    }

    fn always_candidate(&self, _: Failure) -> bool {
        false
    }

    fn evidence(&self, c: &Case<'_>, v: &mut Votes) {
        let Some((m, loss)) = found(c.run) else {
            return;
        };
        let out = loss.output_op.as_deref().unwrap_or("?");
        let why = match m {
            Mismatch::OneUnitSoftmax => {
                "the model's output is a softmax over 1 unit: it is the constant 1, so every gradient is exactly zero".to_string()
            }
            Mismatch::OneUnitCrossEntropy => {
                "the loss is a cross-entropy over classes taken of 1 output unit: that one class's probability is the constant 1, so the loss is exactly 0 and every gradient exactly zero".to_string()
            }
            Mismatch::ClassesBeyondOutput { hi, units } => format!(
                "the targets' class indices reach {} but the output has {units} units (classes 0 to {}): a target beyond the last unit has no logit, so its loss is NaN or nothing at all",
                fmt_g(hi),
                units - 1
            ),
            Mismatch::SoftmaxOverBatch => {
                "the softmax on the way to the loss is taken over the batch (dim 0), not over the classes: each sample's probabilities depend on the other samples and do not sum to one over its classes".to_string()
            }
            Mismatch::SoftmaxIntoCrossEntropy => {
                format!("softmax probabilities reach a loss that applies log-softmax again ({} expects raw logits): its gradient shrinks to almost nothing", c.framework_says("CrossEntropyLoss", "a cross-entropy with from_logits=True", "softmax_cross_entropy"))
            }
            Mismatch::SoftmaxIntoNll => {
                "the model outputs softmax probabilities into NLLLoss, which expects log-probabilities".to_string()
            }
            Mismatch::NllOfRawOutput => format!(
                "NLLLoss takes log-probabilities and is given the raw output of {out}: the loss is minus the target class's output, which has no minimum, so it falls without end as that output grows (it reached {}) and never pushes the other classes' outputs down",
                fmt_g(c.run.loss.best)
            ),
            Mismatch::SigmoidIntoLogitsLoss => {
                format!("the model outputs a sigmoid and the loss applies its own sigmoid ({} expects raw logits): outputs are confined to [0.5, 0.73]", c.framework_says("BCEWithLogitsLoss", "a binary cross-entropy with from_logits=True", "sigmoid_binary_cross_entropy"))
            }
            Mismatch::SoftmaxIntoLogitsLoss => {
                format!("the model outputs softmax probabilities and the loss applies its own sigmoid to each ({} expects raw logits): each output's sigmoid is confined to [0.5, 0.73], and since the outputs sum to one no two labels can both be predicted", c.framework_says("BCEWithLogitsLoss", "a binary cross-entropy with from_logits=True", "sigmoid_binary_cross_entropy"))
            }
            Mismatch::SoftmaxForMultiLabel { labels } => format!(
                "the model's output is a softmax, whose probabilities sum to one over the labels, but the binary cross-entropy's targets mark up to {labels} labels of a sample present (a multi-label task): no two labels can both reach 1, so the loss cannot go below a floor"
            ),
            Mismatch::SigmoidTwice => {
                "the model's output is a sigmoid and a second sigmoid is applied to it on the way to the loss: its values are confined to [0.5, 0.73], so the loss has a floor far above zero".to_string()
            }
            Mismatch::BoundedLogits => format!(
                "the model's logits come out of {out}, bounded to a range of at most 2, and the loss applies its own softmax/sigmoid: the logit gaps are capped, so the loss cannot approach zero"
            ),
            Mismatch::RectifiedLogits => format!(
                "the model's logits come out of {out} and the loss applies its own softmax/sigmoid: a logit pushed below zero is cut to 0 with no gradient, so a wrong class can only be lowered by killing its unit"
            ),
            Mismatch::LogOfRawOutput => format!(
                "the loss takes the log of the model's output, which comes out of {out} with no softmax or sigmoid: outputs at or below zero are clipped or undefined and carry no gradient"
            ),
            Mismatch::BoundedRegression { lo, hi } => {
                let (tmin, tmax) = loss.target_range.unwrap_or((f64::NAN, f64::NAN));
                format!(
                    "the output passes through {out} (range [{}, {}]) but the regression targets span [{}, {}]",
                    fmt_g(lo),
                    fmt_g(hi),
                    fmt_g(tmin),
                    fmt_g(tmax)
                )
            }
        };
        if !explains_failure(m, out, c) {
            return;
        }
        let why = if m == Mismatch::LogOfRawOutput
            && matches!(
                c.e.failure,
                Failure::ExplodingGradients | Failure::NonFinite
            ) {
            format!(
                "{why}; the log's gradient (1/p) is unbounded as an output nears zero, so the blow-up begins in the output layer"
            )
        } else {
            why
        };
        // On raw data the mismatch is true but the data's (see `bad_input_data`).
        if raw_data_targets(c.run).is_some() {
            v.add(2.0, why);
        } else {
            v.proof(5.0, why);
        }
    }

    fn remedies(&self, c: &RemedyCase<'_>) -> Vec<Remedy> {
        let Some((m, loss)) = found(c.run) else {
            return vec![Remedy::CheckOutputActivation];
        };
        let output = loss.output_op.clone();
        match m {
            Mismatch::OneUnitSoftmax => vec![Remedy::OneUnitSoftmax],
            Mismatch::OneUnitCrossEntropy => vec![Remedy::OneUnitCrossEntropy],
            Mismatch::ClassesBeyondOutput { hi, units } => {
                vec![Remedy::OneUnitPerClass { hi, units }]
            }
            Mismatch::SoftmaxOverBatch => vec![Remedy::SoftmaxOverClasses],
            Mismatch::SoftmaxIntoCrossEntropy => vec![
                Remedy::RemoveSoftmaxBeforeCrossEntropy,
                Remedy::NllOnLogSoftmax,
            ],
            Mismatch::LogOfRawOutput if loss.is_binary_cross_entropy() => {
                vec![Remedy::SigmoidForBinaryLog]
            }
            Mismatch::SoftmaxIntoNll | Mismatch::LogOfRawOutput => vec![Remedy::LogSoftmaxForNll],
            Mismatch::NllOfRawOutput => vec![Remedy::LogSoftmaxBeforeNll],
            Mismatch::SigmoidIntoLogitsLoss => vec![
                Remedy::RemoveSigmoidBeforeLogitsLoss,
                Remedy::KeepSigmoidUseBce,
            ],
            Mismatch::SoftmaxIntoLogitsLoss => vec![Remedy::RemoveSoftmaxBeforeLogitsLoss],
            Mismatch::SoftmaxForMultiLabel { .. } => vec![Remedy::SigmoidPerLabel],
            Mismatch::SigmoidTwice => vec![Remedy::OneSigmoid],
            Mismatch::BoundedLogits | Mismatch::RectifiedLogits => {
                vec![Remedy::RemoveBoundedLogits { output }]
            }
            Mismatch::BoundedRegression { .. } => vec![
                Remedy::RemoveBoundedRegression { output },
                Remedy::ScaleTargetsIntoRange,
            ],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Mismatch, mismatch};
    use crate::model::LossSpec;

    fn loss(ops: &[&str], output_op: &str, units: u64) -> LossSpec {
        LossSpec {
            ops: ops.iter().map(ToString::to_string).collect(),
            output_op: Some(output_op.into()),
            output_units: Some(units),
            ..LossSpec::default()
        }
    }

    #[test]
    fn a_cross_entropy_over_classes_of_one_unit_is_a_mismatch_a_binary_one_is_not() {
        // Its own log-softmax (logits), or Keras' division of probabilities by their sum.
        let logits = ["NllLoss", "LogSoftmax"];
        let keras_probabilities = ["Mean", "Neg", "Sum", "Mul", "Log", "Div"];
        for (ops, out, fits) in [
            (&logits[..], "Addmm", "Addmm"),
            (&keras_probabilities[..], "Sigmoid", "Softmax"),
        ] {
            assert_eq!(
                mismatch(&loss(ops, out, 1)),
                Some(Mismatch::OneUnitCrossEntropy)
            );
            assert_eq!(mismatch(&loss(ops, fits, 10)), None);
        }
        assert_eq!(
            mismatch(&loss(&["BinaryCrossEntropy", "Log"], "Sigmoid", 1)),
            None
        );
        assert_eq!(
            mismatch(&loss(&["BinaryCrossEntropyWithLogits"], "Addmm", 1)),
            None
        );
    }

    #[test]
    fn class_indices_beyond_the_last_output_unit_are_a_mismatch() {
        let with_classes = |hi: f64, units: u64| LossSpec {
            class_range: Some((0.0, hi)),
            ..loss(&["NllLoss", "LogSoftmax"], "Addmm", units)
        };
        assert_eq!(
            mismatch(&with_classes(10.0, 10)),
            Some(Mismatch::ClassesBeyondOutput {
                hi: 10.0,
                units: 10
            })
        );
        assert_eq!(mismatch(&with_classes(9.0, 10)), None);
    }

    #[test]
    fn raw_outputs_into_a_negative_log_likelihood_are_a_mismatch_log_probabilities_are_not() {
        assert_eq!(
            mismatch(&loss(&["NllLoss"], "Addmm", 10)),
            Some(Mismatch::NllOfRawOutput)
        );
        assert_eq!(mismatch(&loss(&["NllLoss"], "LogSoftmax", 10)), None);
        // A log-softmax written out: the path to the output passes its subtraction.
        assert_eq!(mismatch(&loss(&["NllLoss", "Sub"], "Addmm", 10)), None);
        assert_eq!(
            mismatch(&loss(&["NllLoss", "View"], "Addmm", 10)),
            Some(Mismatch::NllOfRawOutput)
        );
        assert_eq!(
            mismatch(&loss(&["NllLoss", "LogSoftmax"], "Addmm", 10)),
            None
        );
        assert_eq!(
            mismatch(&loss(&["NllLoss"], "Softmax", 10)),
            Some(Mismatch::SoftmaxIntoNll)
        );
    }

    #[test]
    fn a_contrastive_loss_whose_classes_are_the_batch_is_no_mismatch() {
        // CLIP / InfoNCE: logits = z_a @ z_b.T, class indices 0..N-1 against a 16-unit output.
        let contrastive = LossSpec {
            class_range: Some((0.0, 63.0)),
            compared_numel: Some(64 * 64),
            output_numel: Some(64 * 16),
            ..loss(&["NllLoss", "LogSoftmax", "Mul", "Mm"], "Div", 16)
        };
        assert!(!contrastive.reads_output_units());
        assert_eq!(mismatch(&contrastive), None);
        let direct = LossSpec {
            ops: vec!["NllLoss".into(), "LogSoftmax".into()],
            ..contrastive
        };
        assert!(direct.reads_output_units());
        assert!(matches!(
            mismatch(&direct),
            Some(Mismatch::ClassesBeyondOutput { .. })
        ));
        // The classes the loss says it has come first: a segmentation map (N, 21, 8, 8).
        let segmentation = LossSpec {
            class_range: Some((0.0, 20.0)),
            class_units: Some(21),
            ..loss(&["NllLoss2D", "LogSoftmax"], "Convolution", 8)
        };
        assert_eq!(segmentation.classes(), Some(21));
        assert_eq!(mismatch(&segmentation), None);
    }

    #[test]
    fn softmax_probabilities_into_a_binary_cross_entropy_on_logits_are_a_mismatch() {
        let logits_bce = ["BinaryCrossEntropyWithLogits"];
        assert_eq!(
            mismatch(&loss(&logits_bce, "Softmax", 5)),
            Some(Mismatch::SoftmaxIntoLogitsLoss)
        );
        assert_eq!(mismatch(&loss(&logits_bce, "Addmm", 5)), None);
        // On probabilities (BCELoss), a softmax output is a probability and fits one label per
        // sample; not several.
        let probabilities = |labels: u64| LossSpec {
            labels_per_sample: Some(labels),
            ..loss(&["BinaryCrossEntropy"], "Softmax", 5)
        };
        assert_eq!(mismatch(&probabilities(1)), None);
        assert_eq!(
            mismatch(&probabilities(3)),
            Some(Mismatch::SoftmaxForMultiLabel { labels: 3 })
        );
        assert_eq!(
            mismatch(&LossSpec {
                labels_per_sample: Some(3),
                ..loss(&["BinaryCrossEntropy"], "Sigmoid", 5)
            }),
            None
        );
    }

    #[test]
    fn a_sigmoid_output_put_through_a_second_sigmoid_is_a_mismatch() {
        assert_eq!(
            mismatch(&loss(&["BinaryCrossEntropy", "Sigmoid"], "Sigmoid", 1)),
            Some(Mismatch::SigmoidTwice)
        );
        assert_eq!(mismatch(&loss(&["BinaryCrossEntropy"], "Sigmoid", 1)), None);
    }
}
