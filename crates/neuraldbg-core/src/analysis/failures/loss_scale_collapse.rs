//! `loss_scale_collapse`: under mixed precision, the `GradScaler` skips step after step for
//! overflowing gradients and its loss scale collapses, so training stops making progress.
//! Confirmed by the loop track (skipped steps and the scale), not by events.

use crate::config::Config;
use crate::engine::Run;
use crate::event::SemanticEvent;

use super::super::episodes::Episode;
use super::super::remedy::Remedy;
use super::super::text::num;
use super::super::vocab::{Cause, Failure};
use super::{FailureRule, Link, Sentence, first_at_onset};

pub(crate) struct LossScaleCollapse;

impl FailureRule for LossScaleCollapse {
    fn failure(&self) -> Failure {
        Failure::LossScaleCollapse
    }

    fn precedence(&self) -> u8 {
        9
    }

    fn episodes(&self, run: &Run, _: &Config, _: &[Episode]) -> Vec<Episode> {
        let Some(c) = run.loop_track.collapse else {
            return Vec::new();
        };
        let last = run.last_step.unwrap_or(c.onset).max(c.onset);
        vec![Episode {
            root: c.module,
            duration: last - c.onset + 1,
            to_end: true,
            ..Episode::new(Failure::LossScaleCollapse, c.onset)
        }]
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

    /// Confirmed by a run of skipped steps (see `training_loop`): certain but for the rare
    /// scaler that recovers after the confirmation.
    fn probability(&self, _: &Run, _: &Episode) -> f64 {
        0.9
    }

    /// A run of skipped steps is nothing's consequence (one bad batch skips one step).
    fn follows_from(&self, _: &Episode, _: &Episode, _: &Link<'_>) -> bool {
        false
    }

    fn sentence(&self, s: &Sentence<'_>) -> Option<String> {
        let lt = &s.run.loop_track;
        let c = lt.collapse?;
        let place = s.episode().root.map_or(String::new(), |m| {
            format!(
                " Values first overflowed in '{}'.",
                crate::model::display_name(s.run.model.module_name(m))
            )
        });
        // Confirmed below a scale of 1, or by a long enough run of skips whatever the scale
        // (which may also be unknown: no loss_scale fact).
        let why = if c.scale < 1.0 {
            format!(
                "shrank the loss scale to {}, below 1, so values overflow float16 even unamplified",
                num(c.scale)
            )
        } else if c.scale.is_finite() {
            format!(
                "the loss scale is still {}: values overflow at every scale it tried",
                num(c.scale)
            )
        } else {
            "values overflow at every scale it tried".to_owned()
        };
        Some(format!(
            "The mixed-precision loss scale collapsed from step {}: the GradScaler skipped \
             {} consecutive optimizer steps for overflowing gradients and {why}, and the \
             model stops learning ({} skipped steps in all).{place}",
            c.onset, c.skips, lt.skipped_steps
        ))
    }

    fn chain(&self, run: &Run, _: &Episode) -> Option<Vec<String>> {
        let c = run.loop_track.collapse?;
        Some(vec![
            format!("values overflow float16 from step {}", c.onset),
            format!(
                "GradScaler skips every step; loss scale at {}",
                num(c.scale)
            ),
            "no parameter update: training stalls".into(),
        ])
    }

    fn remedies(&self, _: Cause, _: Vec<Remedy>) -> Vec<Remedy> {
        vec![
            Remedy::TrainInBfloat16,
            Remedy::KeepModuleInFloat32,
            Remedy::LowerLrOrNormalize,
        ]
    }
}
