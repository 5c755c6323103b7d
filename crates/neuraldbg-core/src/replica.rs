//! Data-parallel replicas (DDP): whether the copies of the model on each rank still hold the
//! same values. Replicas are identical by construction; one that differs beyond float noise
//! went its own way (code that changes parameters, gradients or buffers on some ranks only).

use crate::event::{EventType, SemanticEvent, Subject, event_confidence};
use crate::health::{ReplicaHealth, State};
use crate::model::Model;

/// Relative spread (`(max - min) / max` of a norm across ranks) above which data-parallel
/// replicas no longer hold the same values. DDP's replicas are bitwise identical; float noise
/// from a non-deterministic reduction stays orders of magnitude below this.
pub const REPLICA_TOLERANCE: f64 = 1e-4;

/// Whether a data-parallel job's replicas still match (distributed collectors only).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReplicaTrack {
    pub health: ReplicaHealth,
}

impl Default for ReplicaTrack {
    fn default() -> Self {
        Self {
            health: ReplicaHealth::Consistent,
        }
    }
}

impl ReplicaTrack {
    /// Reads one step: `spreads` holds, per parameter, how much its gradient norm and its
    /// parameter norm differ across ranks (`(max - min) / max`; NaN: not a replica or not
    /// measured), `totals` each rank's sum of squares over its replicated gradients and
    /// parameters (to name the odd rank out). Returns the event of a change of state: replicas
    /// that diverged beyond [`REPLICA_TOLERANCE`], or that match again.
    pub fn observe(
        &mut self,
        model: &Model,
        step: u64,
        spreads: [Option<&[f32]>; 2],
        totals: [Option<&[f32]>; 2],
    ) -> Option<SemanticEvent> {
        let mut measured = false;
        let mut worst = 0.0f64;
        // (module, spread, which kind) of the first diverged parameter in forward order.
        let mut first: Option<(usize, f64, usize)> = None;
        for (kind, s) in spreads.iter().enumerate() {
            let Some(s) = s else { continue };
            for (p, &v) in s.iter().enumerate() {
                let v = f64::from(v);
                if v.is_nan() {
                    continue;
                }
                measured = true;
                let v = if v.is_finite() { v } else { f64::INFINITY };
                worst = worst.max(v);
                let module = model.spec.params.get(p).map_or(usize::MAX, |q| q.module);
                if v > REPLICA_TOLERANCE && first.is_none_or(|(m, _, _)| module < m) {
                    first = Some((module, v, kind));
                }
            }
        }
        if !measured {
            return None;
        }
        let (from, to) = match (first, self.health) {
            (Some(_), ReplicaHealth::Consistent) => {
                (ReplicaHealth::Consistent, ReplicaHealth::Diverged)
            }
            (None, ReplicaHealth::Diverged) => (ReplicaHealth::Diverged, ReplicaHealth::Consistent),
            _ => return None,
        };
        self.health = to;
        let (subject, value, rank) = match first {
            Some((module, v, kind)) => {
                let subject = if module < model.spec.modules.len() {
                    Subject::Module(module)
                } else {
                    Subject::Input
                };
                (subject, v, totals[kind].and_then(odd_one_out))
            }
            None => (Subject::Module(0), worst, None),
        };
        let margin = if to == ReplicaHealth::Diverged {
            crate::health::decades(value, REPLICA_TOLERANCE)
        } else {
            0.0
        };
        Some(SemanticEvent {
            step,
            event_type: EventType::ReplicaDivergence,
            subject,
            from_state: State::Replica(from),
            to_state: State::Replica(to),
            confidence: event_confidence(margin, 1),
            value,
            threshold: REPLICA_TOLERANCE,
            confirmed_step: step,
            persistence: 1,
            margin,
            rank,
        })
    }
}

/// The rank whose value stands apart from all the others (with three or more ranks: the one
/// farthest from the median, if the others agree among themselves better than with it).
fn odd_one_out(totals: &[f32]) -> Option<u32> {
    if totals.len() < 3 || totals.iter().any(|v| !v.is_finite()) {
        return None;
    }
    let mut sorted: Vec<f64> = totals.iter().map(|&v| f64::from(v)).collect();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    let dev = |v: f32| (f64::from(v) - median).abs();
    let (odd, d) = totals
        .iter()
        .enumerate()
        .map(|(r, &v)| (r, dev(v)))
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    let second = totals
        .iter()
        .enumerate()
        .filter(|&(r, _)| r != odd)
        .map(|(_, &v)| dev(v))
        .fold(0.0f64, f64::max);
    (d > 0.0 && d > 10.0 * second)
        .then(|| u32::try_from(odd).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::odd_one_out;

    #[test]
    fn the_odd_rank_out_needs_agreeing_others() {
        assert_eq!(odd_one_out(&[1.0, 1.0, 5.0, 1.0]), Some(2));
        assert_eq!(
            odd_one_out(&[1.0, 5.0]),
            None,
            "two ranks: either could be the odd one"
        );
        assert_eq!(
            odd_one_out(&[1.0, 2.0, 3.0, 4.0]),
            None,
            "no agreement among the others"
        );
        assert_eq!(odd_one_out(&[1.0, 1.0, 1.0]), None);
    }
}
